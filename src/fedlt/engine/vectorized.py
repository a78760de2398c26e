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

from typing import TYPE_CHECKING, Iterator

from fedlt.engine.clients import check_client_hook
from fedlt.messages import Message, Reply
from fedlt.methods.base import check_message, check_objective
from fedlt.training.batched import shared_loss, train_clients
from fedlt.training.graphed import GraphedTrainer, Job

if TYPE_CHECKING:
    from fedlt.engine.simulation import Simulation


def fit_together(sim: Simulation, rnd: int, sampled: list[int]) -> dict[int, Reply]:
    """The fit step of ``sim.fit_round`` with the sampled clients trained by ``sim.backend``
    (vectorized or graphed). Clients whose objective does not fit (``local_objective`` returned
    None, or a step that cannot be shared) train sequentially."""
    messages: dict[int, Message] = {}
    contexts, objectives = {}, {}  # of the clients handed to the backend, in the order they were made

    def jobs() -> Iterator[Job]:
        """The sampled clients with a message and an objective, made one at a time: the graphed
        trainer takes the next only when a lane is free for it."""
        for cid in sampled:
            if (msg := sim.server.fit_message(rnd, cid)) is None:
                continue
            check_message(msg, sim.server)
            messages[cid] = msg
            ctx = sim._context(cid, rnd)
            objective = sim.client.local_objective(ctx, msg)
            check_objective(objective, sim.client)
            if objective is not None and (sim.backend == "graphed" or objective.of_logits_only()):
                contexts[cid], objectives[cid] = ctx, objective
                start = {**sim.clients._worker_init,
                         **{k: v.to(sim.device) for k, v in (*msg.weights.items(), *objective.start.items())}}
                yield ctx, start, objective

    if sim.backend == "graphed":
        if sim.graphed is None:
            sim.graphed = GraphedTrainer(sim.worker, sim.cfg.run.streams)
        results = sim.graphed.train_as_made(jobs())
        done = {cid: result for cid, result in zip(contexts, results) if result is not None}
    else:
        together = list(jobs())
        done = {}
        if together and shared_loss([objectives[c].loss for c in contexts]) is not None:  # else nothing shares a step
            trained = train_clients(sim.worker, *([job[k] for job in together] for k in range(3)))
            done = {cid: (state, metrics, {}) for cid, (state, metrics) in zip(contexts, trained)}
    replies = {}
    for cid, msg in messages.items():
        if cid in done:
            state, metrics, extra = done[cid]
            finish = objectives[cid].finish
            weights = finish(state, extra) if finish else state  # before the payload: finish may add to it
            replies[cid] = Reply(weights=weights, num_samples=len(contexts[cid].data), metrics=metrics,
                                 payload=dict(objectives[cid].payload))
            check_client_hook(sim.client, "local_objective", replies[cid], contexts[cid].state,
                              len(contexts[cid].data))
            sim._forget_empty_state(cid)
            sim._account("fit", msg, replies[cid])
        else:
            replies.update(sim._exchange("fit", rnd, [(cid, msg)]))
    return replies
