"""The vectorized backend in the engine: one round's fit with the sampled clients trained together.

(``run.backend=parallel``, clients in worker processes, is :mod:`fedlt.engine.process_pool`.)

``run.backend=vectorized`` trains the round's sampled clients together
(:func:`fedlt.training.batched.train_clients`) when the method's client declares its local step
as a :class:`~fedlt.methods.base.LocalObjective`; ``auto`` does so where supported and trains one
client after another otherwise (:func:`fedlt.run_parts.choose_backend` decides). Server hooks,
messages and traffic accounting are unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlt.messages import Reply
from fedlt.training.batched import stack_losses, train_clients

if TYPE_CHECKING:
    from fedlt.engine.simulation import Simulation


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
