"""Local training of many clients at once: each step is one batched computation over clients.

The sequential loop (:func:`fedlt.training.sequential.train_local`) trains one client after
another, so a small model leaves the hardware idle. Here the sampled clients' parameters, BatchNorm buffers
and momentum buffers are stacked along a leading client axis and every step runs
``torch.func.vmap`` over ``functional_call`` — the convolutions become one grouped convolution.

Equal to the sequential loop (to float rounding), client by client:

* the same batches: each client draws its shuffles and augmentations from its own generators,
  in the same order as :func:`~fedlt.training.sequential.train_local`;
* its own number of steps: at step ``t`` only the clients that still have a ``t``-th batch take
  part, grouped by batch size (no padding, so BatchNorm's batch statistics see only real samples);
* its own loss (prior, margins) and BatchNorm running statistics;
* SGD with momentum, weight decay and gradient-norm clipping exactly as ``torch.optim.SGD`` and
  ``clip_grad_norm_`` compute them.

Models must be deterministic functions of their input in training mode (no dropout): the
global RNG is not split per client.

On this project's 2-core CPU it measured no faster than the sequential loop (each client's batch already
keeps the cores busy, and grouped convolutions run slower than the same work as separate ones), and on
an H200 it was the slowest backend for every model, where the graphed backend
(:mod:`fedlt.training.graphed`) was the fastest (docs/results/speed.md); it is kept for its
equality tests and for devices where grouped convolutions are fast.
"""

from __future__ import annotations

from functools import partial
from typing import Callable

import torch
from torch.func import functional_call, grad_and_value, vmap

from fedlt.losses import LossFn
from fedlt.methods.base import ClientContext, LocalObjective
from fedlt.seeding import seed_for
from fedlt.transfer import to_device
from fedlt.training.scopes import BATCH, GRADIENT, OPTIMIZER, scope
from fedlt.training.sequential import epoch_batches

Stacked = dict[str, torch.Tensor]


def split_loss(loss: LossFn) -> tuple[Callable, dict, dict[str, torch.Tensor]]:
    """``(function, fixed keywords, tensor keywords)`` of a loss built by ``make_loss``: a plain
    function or a ``partial`` whose tensor keywords (log-prior, margins) differ per client."""
    if not isinstance(loss, partial):
        return loss, {}, {}
    tensors = {k: v for k, v in loss.keywords.items() if isinstance(v, torch.Tensor)}
    fixed = {k: v for k, v in loss.keywords.items() if k not in tensors}
    if loss.args:
        raise ValueError("a batched loss takes keyword arguments only")
    return loss.func, fixed, tensors


def shared_loss(losses: list[LossFn]) -> list[tuple[Callable, dict, dict[str, torch.Tensor]]] | None:
    """Each loss split by :func:`split_loss`; None if the clients' losses differ in kind or fixed
    settings (then they cannot share one step)."""
    parts = [split_loss(loss) for loss in losses]
    fn, fixed, first = parts[0]
    if any(f is not fn or x != fixed or t.keys() != first.keys() for f, x, t in parts):
        return None
    return parts


def stack_losses(losses: list[LossFn], device: torch.device) -> tuple[Callable, dict, Stacked] | None:
    """One loss function and per-client stacked tensor keywords; None if the clients' losses
    differ in kind or fixed settings (then they cannot share one batched step)."""
    parts = shared_loss(losses)
    if parts is None:
        return None
    fn, fixed, first = parts[0]
    return fn, fixed, {k: torch.stack([t[k].to(device) for _, _, t in parts]) for k in first}


def client_plan(ctx: ClientContext, epochs: int) -> list[torch.Tensor]:
    """The client's batches (row positions) of all epochs, drawn as :func:`train_local` draws them."""
    generator = ctx.generator()
    return [rows for _ in range(epochs) for rows in epoch_batches(len(ctx.data), ctx.train.batch_size, generator)]


def train_clients(
    model: torch.nn.Module, contexts: list[ClientContext], starts: list[dict[str, torch.Tensor]],
    objectives: list[LocalObjective],
) -> list[tuple[dict[str, torch.Tensor], dict[str, float]]]:
    """Train every client of ``contexts`` from its state dict in ``starts``; per client the final
    state dict (keys in ``model.state_dict()`` order) and ``train_local``'s metrics.

    ``model`` is only the architecture template; its own weights are not used or changed.
    All clients share one round, so their :class:`TrainSettings` must be equal.
    """
    train = contexts[0].train
    if any(ctx.train != train for ctx in contexts):
        raise ValueError("batched clients must share the round's training settings")
    device = next(model.parameters()).device
    stacked_loss = stack_losses([o.loss for o in objectives], device)
    if stacked_loss is None:
        raise ValueError("batched clients must use the same kind of loss")
    loss_fn, loss_fixed, loss_tensors = stacked_loss
    n = len(contexts)
    param_names = [k for k, _ in model.named_parameters()]
    buffer_names = [k for k, _ in model.named_buffers()]
    params = {k: torch.stack([s[k] for s in starts]).contiguous() for k in param_names}
    buffers = {k: torch.stack([s[k] for s in starts]).contiguous() for k in buffer_names}
    mu = torch.tensor([o.prox_mu for o in objectives], device=device)
    anchor = {k: v.clone() for k, v in params.items()} if bool((mu > 0).any()) else {}
    momentum = {k: torch.zeros_like(v) for k, v in params.items()} if train.momentum else {}

    def client_loss(p, b, x, y, kw, mu_k, a):
        out = functional_call(model, (p, b), (x,))
        loss = loss_fn(out, y, **loss_fixed, **kw)
        if a:
            loss = loss + 0.5 * mu_k * sum(((p[k] - a[k]) ** 2).sum() for k in a)
        return loss

    step = vmap(grad_and_value(client_loss))
    plans = [client_plan(ctx, train.epochs) for ctx in contexts]
    augment = [ctx.generator(purpose=1) for ctx in contexts]
    totals = torch.zeros(n, device=device, dtype=params[param_names[0]].dtype)
    seed_as_sequential_training(contexts)
    model.train()
    schedule = step_groups([[len(rows) for rows in plan] for plan in plans])
    # the client positions of every partial group, on the device before the first step, in one copy
    partial = sorted({m for groups in schedule for m in groups if len(m) < n})
    flat = to_device([k for m in partial for k in m], device)
    ends = [sum(len(m) for m in partial[:i + 1]) for i in range(len(partial))]
    positions = {m: flat[end - len(m):end] for m, end in zip(partial, ends)}
    for t, groups in enumerate(schedule):
        for members in groups:
            with scope(BATCH):
                batches = [contexts[k].data.batch(plans[k][t], augment[k]) for k in members]
                x = torch.stack([b[0] for b in batches]).contiguous()  # channels-last inputs hit slow vmap paths
                y = torch.stack([b[1] for b in batches])
            idx = positions.get(members)
            pick = (lambda d: d) if idx is None else (lambda d: {k: v[idx] for k, v in d.items()})
            p, b, m, a = pick(params), pick(buffers), pick(momentum), pick(anchor)
            kw = pick(loss_tensors)
            with scope(GRADIENT):
                grads, losses = step(p, b, x, y, kw, mu if idx is None else mu[idx], a)
            with scope(OPTIMIZER):
                _sgd_step(p, grads, m, train)
            if idx is None:
                totals.add_(losses.detach())
            else:
                totals.index_add_(0, idx, losses.detach())
            if idx is not None:
                for full, part in ((params, p), (buffers, b), (momentum, m)):
                    for k in part:
                        full[k].index_copy_(0, idx, part[k])
    order = list(model.state_dict())
    results = []
    for k, plan in enumerate(plans):
        state = {name: (params[name][k] if name in params else buffers[name][k]).clone() for name in order}
        steps = len(plan)
        loss = float(totals[k]) / steps if steps else float("nan")
        results.append((state, {"train_loss": loss, "steps": float(steps)}))
    return results


def seed_as_sequential_training(contexts: list[ClientContext]) -> None:
    """Leave the global RNG as :func:`~fedlt.training.sequential.train_local` leaves it after the
    same clients: seeded for the last one that has data (the models draw nothing from it)."""
    trained = [ctx for ctx in contexts if len(ctx.data)]
    if trained:
        last = trained[-1]
        torch.manual_seed(seed_for(last.seed, "train", last.round, last.cid, 99))


def step_groups(batch_sizes: list[list[int]]) -> list[list[tuple[int, ...]]]:
    """Per step ``t``, the clients (positions in ``batch_sizes``) that take part, grouped by the
    size of their ``t``-th batch: clients whose batches differ in size cannot share a step."""
    schedule = []
    for t in range(max((len(sizes) for sizes in batch_sizes), default=0)):
        groups: dict[int, list[int]] = {}
        for k, sizes in enumerate(batch_sizes):
            if t < len(sizes):
                groups.setdefault(sizes[t], []).append(k)
        schedule.append([tuple(m) for m in groups.values()])
    return schedule


def _sgd_step(params: Stacked, grads: Stacked, momentum: Stacked, train) -> None:
    """In place, per client: ``clip_grad_norm_`` then ``torch.optim.SGD`` (dampening 0, no Nesterov)."""
    if train.grad_clip is not None:
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in grads.values()], dim=1).norm(dim=1)
        scale = (train.grad_clip / (norms + 1e-6)).clamp(max=1.0)
        for g in grads.values():
            g.mul_(scale.view(-1, *([1] * (g.dim() - 1))))
    names = list(params)  # foreach operations: one launch per operation on a GPU, the same arithmetic
    p, d = [params[k] for k in names], [grads[k] for k in names]
    if train.weight_decay:
        d = torch._foreach_add(d, p, alpha=train.weight_decay)
    if momentum:
        m = [momentum[k] for k in names]
        torch._foreach_mul_(m, train.momentum)
        torch._foreach_add_(m, d)
        d = m
    torch._foreach_add_(p, d, alpha=-train.lr)
