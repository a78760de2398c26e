"""Local training whose step is captured once as a CUDA graph and replayed, several clients at once
on their own CUDA streams (``run.backend=graphed``).

A BatchNorm ResNet's step at batch 32 is a few hundred small kernels. Launched one by one from
Python, the GPU waits for the host between them; a CUDA graph launches them all with one call, and
clients on separate streams (``run.streams`` lanes, each with its own copy of the model) keep the
device busy while the host prepares the next batches. A lane takes its next client only when it is
free (:meth:`GraphedTrainer.train_as_made`), so the host makes later clients' messages, contexts and
objectives while the lanes train the first ones.

Everything a step touches lives at fixed addresses: the lane's model (its parameters and BatchNorm
buffers, loaded in place from each client's start), the momentum buffers, the FedProx anchor, the
loss's per-client tensors (log-prior, margins; FedYoYo's re-mixed prior, written before each
step), the trainable tensors outside the model (FedLoGe's personal head), SCAFFOLD's gradient offset
and gradient sums, the loss sum, one input buffer per batch size and one buffer for what the loss
keeps (FedYoYo's teacher features). A step
reads its batch (made outside the graph: augmented, or FedYoYo's two views) from the input buffer,
computes the loss (of the logits, or of the model for methods whose loss reads features: SFD,
FedLoGe, FedYoYo) and the gradient of what the client trains (GBME: its experts) with
``torch.autograd.grad``, corrects it (SCAFFOLD), clips it and applies SGD with foreach operations in ``torch.optim.SGD``'s
order (dampening 0, no Nesterov). Graphs are kept per step shape (batch size, trained parameters),
captured on a shape's second use (a client's last, shorter batch is often a size no other client of
the lane has: it runs uncaptured), share one memory pool per lane, and are made again when the loss
or an SGD setting changes; the learning rate is read from a tensor, so a schedule needs no new graphs.

Equal to the sequential loop, client by client, to float rounding: the same batches from each
client's own generators, the same loss and the same SGD arithmetic. On a CPU the same step runs
without capture, one client after another: what CUDA replays is what the CPU tests check.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from functools import partial
from typing import Callable, Iterable

import torch

from fedlt import fused
from fedlt.methods.base import ClientContext, LocalObjective, TrainSettings
from fedlt.training.batched import client_plan, seed_as_sequential_training, shared_loss, split_loss
from fedlt.training.scopes import BATCH, GRADIENT, scope

#: a client to train: its context, the state it starts from, its local objective
Job = tuple[ClientContext, dict[str, torch.Tensor], LocalObjective]
#: a trained client: its final state dict, ``train_local``'s metrics, its trained extras
Trained = tuple[dict[str, torch.Tensor], dict[str, float], dict[str, torch.Tensor]]

WARMUP_STEPS = 2  # eager steps on a side stream before a capture (cuDNN/cuBLAS set-up, autograd's threads)
#: a step shape (batch size, trained parameters) is captured on its second use; until then it runs
#: uncaptured on the lane's stream. A client's last, shorter batch is often a size no other client
#: of the lane has, and a capture costs a device-wide synchronisation and two warm-up steps
CAPTURE_AT_USE = 2
#: devices where a client's trained state is handed back packed (``fused.packed_clones``): one buffer per
#: dtype, its tensors views of it. There each new tensor is a caching-allocator call, and each mark for the
#: stream that reads it (``record_stream``) an event the allocator records and later polls; on a CPU an
#: allocation costs less than making the views
PACKED_ON = frozenset({"cuda"})


@dataclass
class Lane:
    """One model copy and everything its steps write, on one stream (None on a CPU, where
    ``torch.cuda.stream(None)`` does nothing)."""

    model: torch.nn.Module
    stream: torch.cuda.Stream | None
    #: where the lane's graphs are captured and warmed up: cuBLAS keeps a workspace per stream, and
    #: graphs captured on one stream would share it while lanes replay them at the same time
    capture_stream: torch.cuda.Stream | None = None
    #: the model's parameters and buffers by state-dict key: what a client's start is loaded into
    state: dict[str, torch.Tensor] = field(init=False)
    params: list[torch.Tensor] = field(init=False)
    momentum: list[torch.Tensor] = field(init=False)
    anchor: list[torch.Tensor] = field(init=False)
    total: torch.Tensor = field(init=False)
    neg_lr: torch.Tensor = field(init=False)  # minus the round's rate: graphs read it, a schedule needs none new
    loss_tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    extra: dict[str, torch.Tensor] = field(default_factory=dict)  # trainable tensors outside the model
    extra_momentum: dict[str, torch.Tensor] = field(default_factory=dict)
    inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    kept: dict[int, torch.Tensor] = field(default_factory=dict)  # per batch size: what the loss kept this step
    #: per parameter, the client's gradient offset and the sum of its own gradients (made at the first
    #: client with a :class:`~fedlt.methods.base.GradientCorrection`)
    offset: list[torch.Tensor] = field(default_factory=list)
    gradient_sums: list[torch.Tensor] = field(default_factory=list)
    graphs: dict[tuple, torch.cuda.CUDAGraph] = field(default_factory=dict)  # per batch size and trained set
    uses: dict[tuple, int] = field(default_factory=dict)  # uncaptured steps per shape
    #: one memory pool for the lane's graphs: a lane replays them one after another on its stream, and
    #: nothing a step allocates outlives it (all it keeps is in the lane's fixed tensors), so their
    #: intermediates can share memory instead of one pool per graph (batch sizes x trained sets)
    pool: tuple | None = None

    def __post_init__(self) -> None:
        self.state = self.model.state_dict(keep_vars=True)
        self.params = [p for p in self.model.parameters()]
        for p in self.params:
            p.requires_grad_(True)
        self.momentum = [torch.zeros_like(p) for p in self.params]
        self.anchor = [torch.zeros_like(p) for p in self.params]
        self.total = torch.zeros((), device=self.params[0].device, dtype=self.params[0].dtype)
        self.neg_lr = torch.zeros((), device=self.params[0].device, dtype=self.params[0].dtype)

    def forget_graphs(self) -> None:
        """Drop the lane's graphs and their pool: a pool whose graphs are all gone may be released by
        the allocator, so the next capture starts a new one. (``uses`` is kept: a shape seen before
        is captured again at its next use.)"""
        self.graphs.clear()
        self.pool = None


class GraphedTrainer:
    """Trains clients from their start states with captured steps; one per engine, so the lanes,
    their buffers and graphs are made once and reused every round."""

    def __init__(self, template: torch.nn.Module, lanes: int):
        self.device = next(template.parameters()).device
        self.capture = self.device.type == "cuda"
        count = lanes if self.capture else 1
        streams = (lambda: torch.cuda.Stream(self.device)) if self.capture else (lambda: None)
        self.lanes = [Lane(copy.deepcopy(template), streams(), streams()) for _ in range(count)]
        self.signature = None  # what the graphs baked in: loss function, its fixed settings, prox, SGD settings
        self.captures = 0  # graphs captured so far (a bench waits for a round without one)

    def train(self, contexts: list[ClientContext], starts: list[dict[str, torch.Tensor]], objectives: list[LocalObjective]
              ) -> list[Trained]:
        """Per client its final state dict, ``train_local``'s metrics and its trained extras
        (:attr:`LocalObjective.extra`), in the order given; every client must share one step."""
        if not contexts:
            return []
        if any(ctx.train != contexts[0].train for ctx in contexts):
            raise ValueError("graphed clients must share the round's training settings")
        if shared_loss([o.loss for o in objectives]) is None:
            raise ValueError("graphed clients must use the same kind of loss")
        if len({step_form(o) for o in objectives}) > 1:
            raise ValueError("graphed clients must share the form of their step (FedProx's mu, loss, extras, hooks)")
        return self.train_as_made(zip(contexts, starts, objectives))  # type: ignore[return-value]

    def train_as_made(self, jobs: Iterable[Job]) -> list[Trained | None]:
        """Train the clients ``jobs`` yields, ``(context, start state, objective)``, taking the next one
        only when a lane is free for it: on a GPU the host makes a client's message, context and
        objective while the lanes train the clients before it, instead of the device idling until every
        client of the round is made. The first job fixes the step (the loss's kind and fixed settings,
        the step's form, the training settings); a later job whose step differs is not trained (None in
        its place in the result, which follows ``jobs``' order), for the caller to train another way."""
        jobs = iter(jobs)
        first = next(jobs, None)
        if first is None:
            return []
        train, objective = first[0].train, first[2]
        fn, fixed, tensors = split_loss(objective.loss)
        form = step_form(objective)
        if objective.correction is not None and objective.extra:
            raise ValueError("a gradient correction covers the model's parameters only, not extra tensors")
        # captured steps read the learning rate from a tensor; the uncaptured one (CPU) takes it as
        # torch.optim.SGD does, so that it is the same arithmetic to the bit
        signature = (fn, tuple(sorted(fixed.items())), form, None if self.capture else train.lr,
                     train.momentum, train.weight_decay, train.grad_clip)
        if signature != self.signature:  # another loss or SGD setting: capture again
            for lane in self.lanes:
                lane.forget_graphs()
                lane.uses.clear()
                lane.loss_tensors, lane.extra, lane.extra_momentum, lane.inputs, lane.kept = {}, {}, {}, {}, {}
            self.signature = signature
        step = _step_function(fn, fixed, objective.prox_mu, train, self.capture, objective.on_model,
                              objective.keep is not None, objective.correction is not None)
        made: list[Job] = []  # every job taken, held until the lanes are done: they read its tensors
        results: dict[int, tuple[dict[str, torch.Tensor], torch.Tensor, int, dict[str, torch.Tensor]]] = {}
        pending = itertools.chain([first], jobs)

        def take() -> tuple[int, Job, dict[str, torch.Tensor]] | None:
            """The next job that shares the first one's step, its position and its loss's tensors."""
            for job in pending:
                made.append(job)
                f, x, t = split_loss(job[2].loss)
                if job[0].train == train and f is fn and x == fixed and t.keys() == tensors.keys() \
                        and step_form(job[2]) == form:
                    return len(made) - 1, job, t
            return None

        current = torch.cuda.current_stream(self.device) if self.capture else None
        for lane in self.lanes:
            lane.neg_lr.fill_(-train.lr)
        runs = [self._client_runs(lane, take, step, results, current) for lane in self.lanes]
        while runs:  # one step of every lane in turn, so their streams overlap on the device
            runs = [run for run in runs if next(run, StopIteration) is not StopIteration]
        for lane in self.lanes:
            if lane.stream is not None:
                current.wait_stream(lane.stream)
        order = sorted(results)
        seed_as_sequential_training([made[i][0] for i in order])
        losses = torch.stack([results[i][1] for i in order]).tolist() if order else []  # one wait for the device
        trained: list[Trained | None] = [None] * len(made)
        for i, loss in zip(order, losses):
            state, _, steps, extra = results[i]
            trained[i] = (state, {"train_loss": loss / steps if steps else float("nan"), "steps": float(steps)}, extra)
        return trained

    def _client_runs(self, lane: Lane, take, step, results, consumer: torch.cuda.Stream | None):
        """A generator that trains clients from ``take`` on the lane, one batch per ``next``. A client's
        start is made on ``consumer`` (the stream ``train`` was called on), so the lane waits for that
        stream before loading it; what it hands back is made on the lane's stream and used on
        ``consumer``, so it is recorded there (a packed state by its buffers): its memory is not reused
        before that stream is done with it."""
        with torch.cuda.stream(lane.stream):
            lane.model.train()
        while (taken := take()) is not None:  # made on the consumer's stream, outside the lane's
            i, (ctx, start, objective), loss_tensors = taken
            if lane.stream is not None:
                lane.stream.wait_stream(consumer)
            with torch.cuda.stream(lane.stream):
                _load(lane, start, loss_tensors, objective.extra)
                if objective.correction is not None:
                    _load_correction(lane, objective.correction.offset)
                for p in lane.params:
                    p.requires_grad_(True)
                if objective.prepare is not None:
                    objective.prepare(lane.model)
                trained = tuple(k for k, p in enumerate(lane.params) if p.requires_grad)
                plan = client_plan(ctx, ctx.train.epochs)
                augment = ctx.generator(purpose=1)
            for t, rows in enumerate(plan, start=1):
                lr = ctx.train.lr * objective.lr_scale(t) if objective.lr_scale else None
                with torch.cuda.stream(lane.stream):
                    with scope(BATCH):
                        x, y = objective.batch(rows) if objective.batch else ctx.data.batch(rows, augment)
                        for k, v in (objective.step_tensors(t) if objective.step_tensors else {}).items():
                            lane.loss_tensors[k].copy_(v)
                    with scope(GRADIENT):
                        self._run_step(lane, x, y, partial(step, trained=trained, lr=lr), trained, lr)
                    if objective.keep:
                        kept = lane.kept[x.shape[0]].clone()
                        if lane.stream is not None:  # read by finish on the consumer's stream
                            kept.record_stream(consumer)
                            y.record_stream(consumer)
                        objective.keep(kept, y)
                yield
            with torch.cuda.stream(lane.stream):  # read on the host once every lane is done: no wait here
                state, buffers = fused.packed_clones(list(lane.state.values())) if self.device.type in PACKED_ON \
                    else (fused.clones(list(lane.state.values())), [])
                results[i] = (dict(zip(lane.state, state)), lane.total.clone(), len(plan),
                              {k: v.detach().clone() for k, v in lane.extra.items()})
                sums = [s.clone() for s in lane.gradient_sums] if objective.correction is not None else []
                if lane.stream is not None:
                    for made in (*buffers, results[i][1], *results[i][3].values(), *sums):
                        made.record_stream(consumer)
                if objective.correction is not None:
                    objective.correction.done(sums, len(plan))

    def _run_step(self, lane: Lane, x: torch.Tensor, y: torch.Tensor, step, trained: tuple[int, ...],
                  lr: float | None) -> None:
        """One step: uncaptured on a CPU; else the graph for this batch size and set of trained
        parameters (captured on first use), with this step's learning rate when it has its own."""
        size = x.shape[0]
        if size not in lane.inputs:
            lane.inputs[size] = (torch.empty_like(x), torch.empty_like(y))
        x_in, y_in = lane.inputs[size]
        x_in.copy_(x)
        y_in.copy_(y)
        if not self.capture:
            step(lane, x_in, y_in)
            return
        if lr is not None:
            lane.neg_lr.fill_(-lr)
        key = (size, trained)
        if key not in lane.graphs:
            lane.uses[key] = lane.uses.get(key, 0) + 1
            if lane.uses[key] < CAPTURE_AT_USE:
                step(lane, x_in, y_in)  # the captured step's arithmetic (it reads neg_lr), launched kernel by kernel
                return
            lane.graphs[key] = _capture(lane, step, x_in, y_in)
            self.captures += 1
        lane.graphs[key].replay()


def step_form(objective: LocalObjective) -> tuple:
    """What a captured step bakes in of a client's objective besides its loss: clients train together
    only when these are equal."""
    return (objective.prox_mu, objective.on_model, tuple(objective.extra), objective.prepare is not None,
            objective.lr_scale is not None, objective.batch is not None, objective.step_tensors is not None,
            objective.keep is not None, objective.correction is not None)


def _step_function(fn: Callable, fixed: dict, mu: float, train: TrainSettings, captured: bool,
                   on_model: bool = False, keeps: bool = False, corrected: bool = False) -> Callable[..., None]:
    """The step on a lane's fixed tensors: loss, gradient, its correction (``corrected``: summed, then
    offset, as :func:`fedlt.training.sequential.corrected_gradients` does), clipping, SGD, loss sum, and
    what the loss keeps (``keeps``: it returns ``(value, tensor)``) in ``lane.kept``. ``trained``: the positions of
    the parameters it trains (None: all); ``lr``: this step's rate when it is not the round's
    (uncaptured; a captured step reads ``lane.neg_lr``)."""

    def step(lane: Lane, x: torch.Tensor, y: torch.Tensor, trained: tuple[int, ...] | None = None,
             lr: float | None = None) -> None:
        model_params = lane.params if trained is None else [lane.params[k] for k in trained]
        if on_model:
            loss = fn(lane.model, x, y, **fixed, **lane.loss_tensors, **lane.extra)
        else:
            loss = fn(lane.model(x), y, **fixed, **lane.loss_tensors)
        if keeps:
            loss, kept = loss
            held = lane.kept.get(x.shape[0])
            if not _fits(held, kept):  # on a shape's first, uncaptured use: a capture follows warm-up steps
                held = lane.kept[x.shape[0]] = torch.empty_like(kept)
            held.copy_(kept.detach())
        if mu > 0:
            loss = loss + 0.5 * mu * sum(((p - a) ** 2).sum() for p, a in zip(lane.params, lane.anchor))
        own = lane.momentum if trained is None else [lane.momentum[k] for k in trained]
        params, momentum = [*model_params, *lane.extra.values()], [*own, *lane.extra_momentum.values()]
        grads = torch.autograd.grad(loss, params, allow_unused=True)
        # a parameter the loss did not use this step (SFD's projector on a batch of one) has no
        # gradient, and torch.optim.SGD leaves it and its momentum as they are
        used = [k for k, g in enumerate(grads) if g is not None]
        params, momentum, grads = ([seq[k] for k in used] for seq in (params, momentum, grads))
        with torch.no_grad():
            if corrected:  # only model parameters (no extras): positions in ``params`` are theirs
                at = [k if trained is None else trained[k] for k in used]
                offsets, sums = [lane.offset[k] for k in at], [lane.gradient_sums[k] for k in at]
                # + 0 * p would change no bit of the sums: without weight decay, two kernels less per step
                torch._foreach_add_(sums, torch._foreach_add(grads, torch._foreach_mul(params, train.weight_decay))
                                    if train.weight_decay else grads)
                grads = torch._foreach_add(grads, offsets)
            if train.grad_clip is not None:  # clip_grad_norm_'s arithmetic over everything trained
                norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
                torch._foreach_mul_(grads, (train.grad_clip / (norm + 1e-6)).clamp(max=1.0))
            d = torch._foreach_add(grads, params, alpha=train.weight_decay) if train.weight_decay else grads
            if train.momentum:
                torch._foreach_mul_(momentum, train.momentum)
                torch._foreach_add_(momentum, d)
                d = momentum
            if captured:
                torch._foreach_add_(params, torch._foreach_mul(d, lane.neg_lr))
            else:
                torch._foreach_add_(params, d, alpha=-(train.lr if lr is None else lr))
            lane.total.add_(loss.detach())

    return step


def _load(lane: Lane, start: dict[str, torch.Tensor], loss_tensors: dict[str, torch.Tensor],
          extra: dict[str, torch.Tensor]) -> None:
    """A client's start in the lane's fixed tensors: weights and buffers, zero momentum and loss sum,
    the FedProx anchor, the loss's tensors, the extra trainable tensors."""
    fused.copy_(list(lane.state.values()), [start[k] for k in lane.state])  # in place: graphs see the new values
    with torch.no_grad():
        torch._foreach_zero_(lane.momentum)
        lane.total.zero_()
        torch._foreach_copy_(lane.anchor, lane.params)
        for k, v in loss_tensors.items():
            if not _fits(lane.loss_tensors.get(k), v):
                lane.loss_tensors[k] = torch.empty_like(v)
                lane.forget_graphs()  # they read the tensor this one replaces
            lane.loss_tensors[k].copy_(v)
        for k, v in extra.items():
            if not _fits(lane.extra.get(k), v):
                lane.extra[k] = torch.empty_like(v).requires_grad_(True)
                lane.extra_momentum[k] = torch.empty_like(v)
                lane.forget_graphs()
            lane.extra[k].copy_(v)
            lane.extra_momentum[k].zero_()


def _load_correction(lane: Lane, offset: list[torch.Tensor]) -> None:
    """A client's gradient offset in the lane's fixed tensors, its gradient sums zeroed."""
    with torch.no_grad():
        if not lane.offset:
            lane.offset = [torch.empty_like(p) for p in lane.params]
            lane.gradient_sums = [torch.empty_like(p) for p in lane.params]
            lane.forget_graphs()  # they read no offset yet
        torch._foreach_copy_(lane.offset, offset)
        torch._foreach_zero_(lane.gradient_sums)


def _fits(held: torch.Tensor | None, value: torch.Tensor) -> bool:
    """Whether a lane's fixed tensor can take ``value`` in place (graphs read it where it is)."""
    return held is not None and held.shape == value.shape and held.dtype == value.dtype


def _capture(lane: Lane, step, x_in, y_in) -> torch.cuda.CUDAGraph:
    """Capture ``step`` on the lane's fixed tensors. The warm-up steps change the lane's state (a
    client may be mid-way through its batches), so that state is put back afterwards."""
    with torch.no_grad():
        held = [*lane.momentum, *lane.extra.values(), *lane.extra_momentum.values(), *lane.gradient_sums]
        saved = ({k: v.clone() for k, v in lane.model.state_dict().items()}, [m.clone() for m in held],
                 lane.total.clone())
    side = lane.capture_stream
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(WARMUP_STEPS):
            step(lane, x_in, y_in)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    if lane.pool is None:
        lane.pool = torch.cuda.graph_pool_handle()
    with torch.cuda.graph(graph, pool=lane.pool, stream=side):
        step(lane, x_in, y_in)
    with torch.no_grad():
        lane.model.load_state_dict(saved[0])
        torch._foreach_copy_(held, saved[1])
        lane.total.copy_(saved[2])
    return graph
