"""The vectorized backend in the engine: which backend a run uses, and one round's fit with it.

(``run.backend=parallel``, clients in worker processes, is :mod:`fedlt.engine.process_pool`.)

``run.backend=vectorized`` trains the round's sampled clients together
(:func:`fedlt.batched_training.train_clients`) when the method's client declares its local step
as a :class:`~fedlt.methods.base.LocalObjective`; ``auto`` does so where supported and trains one
client after another otherwise. Server hooks, messages and traffic accounting are unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from fedlt.batched_training import stack_losses, train_clients
from fedlt.config import Config
from fedlt.errors import ConfigError
from fedlt.messages import Reply
from fedlt.methods.base import Client

if TYPE_CHECKING:
    from fedlt.engine.simulation import Simulation


def supports_vectorized(client_cls: type[Client]) -> bool:
    """Whether the client class declares its own :meth:`Client.local_objective` (inheriting one is
    not enough: a subclass may have changed ``fit``)."""
    return "local_objective" in vars(client_cls)


def choose_backend(cfg: Config, client_cls: type[Client], device: torch.device) -> str:
    """``sequential``, ``parallel`` or ``vectorized`` for this run; a ConfigError for an impossible
    request."""
    wanted = cfg.run.backend
    if wanted == "parallel":
        if device.type != "cpu":
            raise ConfigError(f"run.backend=parallel trains clients in CPU processes, but run.device is {device}; "
                              "use run.backend=vectorized (or sequential) on a GPU, or run.device=cpu")
        return "parallel"
    if wanted == "sequential" or cfg.secagg.enabled or (wanted == "auto" and not supports_vectorized(client_cls)):
        return "sequential"
    if not supports_vectorized(client_cls):
        raise ConfigError(f"run.backend=vectorized does not support method {cfg.method} (its local step is its own); "
                          "use run.backend=auto or run.backend=sequential")
    return "vectorized"


def fit_vectorized(sim: Simulation, rnd: int, sampled: list[int]) -> dict[int, Reply]:
    """The fit step of ``sim.fit_round`` with the sampled clients trained together. Clients whose
    objective does not fit (``local_objective`` returned None) train sequentially."""
    messages = {cid: msg for cid in sampled if (msg := sim.server.fit_message(rnd, cid)) is not None}
    contexts, objectives, starts = {}, {}, {}
    for cid, msg in messages.items():
        ctx = sim._context(cid, rnd)
        objective = sim.client.local_objective(ctx, msg)
        if objective is not None:
            contexts[cid], objectives[cid] = ctx, objective
            starts[cid] = {**sim.clients._worker_init, **{k: v.to(sim.device) for k, v in msg.weights.items()}}
    batched = list(contexts)
    if batched and stack_losses([objectives[c].loss for c in batched], sim.device) is None:
        batched = []  # clients with different kinds of loss: nothing to share a step
    trained = {}
    if batched:
        results = train_clients(sim.worker, [contexts[c] for c in batched], [starts[c] for c in batched],
                                [objectives[c] for c in batched])
        for cid, (weights, metrics) in zip(batched, results):
            trained[cid] = Reply(weights=weights, num_samples=len(contexts[cid].data), metrics=metrics)

    replies = {}
    for cid, msg in messages.items():
        if cid in trained:
            replies[cid] = trained[cid]
            sim._forget_empty_state(cid)
            sim._account("fit", msg, trained[cid])
        else:
            replies.update(sim._exchange("fit", rnd, [(cid, msg)]))
    return replies
