"""The backends in the engine that take a round's sampled clients together: ``vectorized`` (one
batched computation, :func:`fedlt.training.batched.train_clients`) and ``graphed`` (each client's
step a captured CUDA graph, several clients on their own streams,
:class:`fedlt.training.graphed.GraphedTrainer`).

(``run.backend=parallel``, clients in worker processes, is :mod:`fedlt.engine.process_pool`.)

Both train the clients whose method declares its local step as a
:class:`~fedlt.methods.base.LocalObjective` (the vectorized one only losses of the logits); ``auto``
picks one of them where it was measured fastest (:func:`fedlt.run_parts.choose_backend` decides).
Clients whose objective does not fit train one after another. Server hooks, messages and traffic
accounting are unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedlt.messages import Reply
from fedlt.training.batched import shared_loss, train_clients
from fedlt.training.graphed import GraphedTrainer, step_form

if TYPE_CHECKING:
    from fedlt.engine.simulation import Simulation


def fit_together(sim: Simulation, rnd: int, sampled: list[int]) -> dict[int, Reply]:
    """The fit step of ``sim.fit_round`` with the sampled clients trained by ``sim.backend``
    (vectorized or graphed). Clients whose objective does not fit (``local_objective`` returned
    None) train sequentially."""
    messages = {cid: msg for cid in sampled if (msg := sim.server.fit_message(rnd, cid)) is not None}
    contexts, objectives, starts = {}, {}, {}
    for cid, msg in messages.items():
        ctx = sim._context(cid, rnd)
        objective = sim.client.local_objective(ctx, msg)
        if objective is not None and (sim.backend == "graphed" or objective.of_logits_only()):
            contexts[cid], objectives[cid] = ctx, objective
            starts[cid] = {**sim.clients._worker_init,
                           **{k: v.to(sim.device) for k, v in (*msg.weights.items(), *objective.start.items())}}
    together = list(contexts)
    if together and shared_loss([objectives[c].loss for c in together]) is None:
        together = []  # clients with different kinds of loss: nothing to share a step
    if sim.backend == "graphed" and len({step_form(objectives[c]) for c in together}) > 1:
        together = []  # a captured step bakes FedProx's mu and the step's form in
    trained = {}
    if together:
        args = ([contexts[c] for c in together], [starts[c] for c in together], [objectives[c] for c in together])
        if sim.backend == "graphed":
            if sim.graphed is None:
                sim.graphed = GraphedTrainer(sim.worker, sim.cfg.run.streams)
            results = sim.graphed.train(*args)
        else:
            results = [(state, metrics, {}) for state, metrics in train_clients(sim.worker, *args)]
        for cid, (state, metrics, extra) in zip(together, results):
            finish = objectives[cid].finish
            weights = finish(state, extra) if finish else state  # before the payload: finish may add to it
            trained[cid] = Reply(weights=weights, num_samples=len(contexts[cid].data), metrics=metrics,
                                 payload=dict(objectives[cid].payload))

    replies = {}
    for cid, msg in messages.items():
        if cid in trained:
            replies[cid] = trained[cid]
            sim._forget_empty_state(cid)
            sim._account("fit", msg, trained[cid])
        else:
            replies.update(sim._exchange("fit", rnd, [(cid, msg)]))
    return replies
