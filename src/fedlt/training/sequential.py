"""Local training on one client: shuffled index batches over in-memory tensors, plain SGD.

Methods supply only the loss of a batch; the loop, the optimiser and the seeded shuffling are
shared so every method trains under identical conditions.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch

from fedlt.messages import Message, Reply
from fedlt.methods.base import (Client, ClientContext, GradientCorrection, LocalObjective, TrainSettings, check_objective,
                               clone_state)
from fedlt.seeding import seed_for
from fedlt.training.scopes import BACKWARD, BATCH, FORWARD, OPTIMIZER, scope

BatchLoss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def epoch_batches(n: int, batch_size: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """Row positions of one shuffled epoch, split into batches (last one may be smaller).

    A trailing batch of a single sample is merged into the previous one: BatchNorm cannot
    train on one sample.
    """
    order = torch.randperm(n, generator=generator, device=generator.device)
    starts = list(range(0, n, batch_size))
    if len(starts) > 1 and n - starts[-1] == 1:
        starts.pop()
    for i, start in enumerate(starts):
        end = starts[i + 1] if i + 1 < len(starts) else n
        yield order[start:end]


def steps_per_epoch(n: int, batch_size: int) -> int:
    """Optimiser steps of one local epoch: the number of batches :func:`epoch_batches` yields."""
    steps = -(-n // batch_size)
    return steps - 1 if steps > 1 and n - (steps - 1) * batch_size == 1 else steps


def make_sgd(params: Iterable[torch.nn.Parameter], train: TrainSettings) -> torch.optim.SGD:
    """``torch.optim.SGD``; on a GPU its fused kernel (one launch for all parameters, equal to the
    per-tensor update to rounding), on the CPU the per-tensor update that fedlt's results were made with."""
    params = list(params)  # tensors, or parameter groups (dicts with "params")
    tensors = [t for p in params for t in (p["params"] if isinstance(p, dict) else [p])]
    fused = bool(tensors) and all(t.device.type == "cuda" for t in tensors)
    return torch.optim.SGD(params, lr=train.lr, momentum=train.momentum,
                           weight_decay=train.weight_decay, fused=fused or None)


def train_local(
    ctx: ClientContext,
    batch_loss: BatchLoss,
    params: Iterable[torch.nn.Parameter] | None = None,
    epochs: int | None = None,
    batch: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None,
) -> dict[str, float]:
    """Run ``epochs`` (default: the round's) of SGD on ``params`` (default: ``ctx.model``'s) minimising
    ``batch_loss(x, y)``, the gradient of ``params`` clipped to ``fl.grad_clip``. ``batch``: the input
    and labels of a batch's rows, in place of ``ctx.data.batch`` with ``data.augment``
    (:attr:`~fedlt.methods.base.LocalObjective.batch`).

    Returns training metrics: mean loss over batches and the number of optimisation steps.
    """
    model, data, train = ctx.model, ctx.data, ctx.train
    if len(data) == 0:
        return {"train_loss": float("nan"), "steps": 0.0}
    torch.manual_seed(seed_for(ctx.seed, "train", ctx.round, ctx.cid, 99))  # for modules that use the global RNG
    optimizer = make_sgd(params if params is not None else model.parameters(), train)
    # clipping sees the gradient of what this loop trains, never a gradient left on a parameter it does
    # not train (a frozen expert trained by the client before, a head outside ``params``)
    trained = [p for group in optimizer.param_groups for p in group["params"]]
    generator = ctx.generator()
    augment_generator = ctx.generator(purpose=1)
    model.train()
    total, steps = torch.zeros((), device=data.images.device), 0
    for _ in range(train.epochs if epochs is None else epochs):
        for rows in epoch_batches(len(data), train.batch_size, generator):
            with scope(BATCH):
                x, y = batch(rows) if batch is not None else data.batch(rows, augment_generator)
            with scope(FORWARD):
                loss = batch_loss(x, y)
            with scope(BACKWARD):
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
            with scope(OPTIMIZER):
                if train.grad_clip is not None:
                    torch.nn.utils.clip_grad_norm_(trained, train.grad_clip)
                optimizer.step()
                total += loss.detach()
            steps += 1
    return {"train_loss": float(total) / max(steps, 1), "steps": float(steps)}


def fit_objective(ctx: ClientContext, msg: Message, objective: LocalObjective | None) -> Reply:
    """A client's fit as its :class:`LocalObjective` says, one step after another: the received weights
    with ``start`` over them, the step's input from ``batch``, ``step_tensors`` per step, ``keep``
    after each, the reply from ``finish`` and ``payload``. The methods whose ``fit`` is this cannot
    train differently one by one than together. ``objective`` None: a client without data, which
    replies the received weights untrained. (Extras, ``prepare`` and ``lr_scale`` need their
    method's own loop.)"""
    if objective is not None and (objective.extra or objective.prepare or objective.lr_scale):
        raise ValueError("fit_objective trains neither extra tensors, a prepared part of the model nor a per-step rate")
    model = ctx.model
    model.load_state_dict({**msg.weights, **(objective.start if objective else {})}, strict=False)
    if objective is None:
        return Reply(weights=clone_state(model), num_samples=0, metrics={"train_loss": float("nan"), "steps": 0.0})
    step = 0

    def batch_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal step
        step += 1
        tensors = objective.step_tensors(step) if objective.step_tensors else {}
        loss = objective.loss(model, x, y, **tensors) if objective.on_model else objective.loss(model(x), y, **tensors)
        if objective.keep is None:
            return loss
        loss, kept = loss
        objective.keep(kept, y)
        return loss

    if objective.correction is None:
        metrics = train_local(ctx, batch_loss, batch=objective.batch)
    else:
        with corrected_gradients(model, objective.correction, ctx.train.weight_decay) as sums:
            metrics = train_local(ctx, batch_loss, batch=objective.batch)
        objective.correction.done(sums, int(metrics["steps"]))
    state = clone_state(model)
    weights = objective.finish(state, {}) if objective.finish else state  # before the payload: finish may add to it
    return Reply(weights=weights, num_samples=len(ctx.data), payload=dict(objective.payload), metrics=metrics)


class ObjectiveClient(Client):
    """A client whose ``fit`` is its :meth:`~Client.local_objective` trained one step after another
    (:func:`fit_objective`): the one definition every backend trains, so they cannot differ."""

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        objective = self.local_objective(ctx, msg)
        check_objective(objective, self)
        return fit_objective(ctx, msg, objective)


@contextmanager
def corrected_gradients(model: torch.nn.Module, correction: GradientCorrection, weight_decay: float):
    """While open, backward adds ``correction.offset`` to each parameter's gradient, after adding the
    gradient plus weight decay to that parameter's sum; yields the sums (a hook per parameter, so any
    loss works and the loss itself is unchanged)."""
    params = list(model.parameters())
    sums = [torch.zeros_like(p) for p in params]

    def hook_for(p: torch.nn.Parameter, offset: torch.Tensor, total: torch.Tensor):
        def hook(grad: torch.Tensor) -> torch.Tensor:
            total.add_(grad + weight_decay * p.detach())
            return grad + offset
        return hook

    handles = [p.register_hook(hook_for(p, o, s)) for p, o, s in zip(params, correction.offset, sums)]
    try:
        yield sums
    finally:
        for handle in handles:
            handle.remove()
