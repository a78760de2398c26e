"""GBME and GBME-p (Zeng et al., "Global Balanced Experts for Federated Long-Tailed Learning", ICCV 2023).

Setup (one extra round-trip, before the first round): every client receives the initial global
model, makes one pass over its data with cross-entropy and uploads its local proxy (LPI, Eq. 4) —
one value per class. The server forms the global proxy (GPI, Eq. 5), uses it as the class prior
of the re-balancing loss (broadcast with every model) and groups the clients by the cosine
similarity of their LPI to the GPI (Eq. 6). Each round, expert i is trained by alpha*R clients of
its group and (1-alpha)*R others (:meth:`GBMEServer.select_clients`); a client trains the shared
backbone and its selected expert(s) with the other experts frozen, on balanced softmax (or LDAM,
LA) of the mean of the experts' logits (Eq. 7; ``expert_loss=per_expert``: the released code's
sum of the loss on each trained expert's own logits) and uploads what it trained; the server
averages the round's models with FedAvg (Alg. 1, line 15), a client's untrained experts counting
as the weights it was sent.

Choices where the paper is silent (also in the README):

* The LPI pass (``lpi_pass``). GBME (``auto`` -> ``epoch``) follows Algorithm 1 and the released
  code: one local epoch of CE from the received model under the configured optimiser, the FC
  gradient being the mean of its per-step gradients (the code's weight change of that epoch,
  without the learning rate and momentum). ``lpi_steps`` stops that epoch after its first k
  steps: in the paper's settings the epoch is ~2 steps (CIFAR-100-LT: ~108 samples a client,
  batch 64), the gradient at the initial model, where the reference protocol's is ~23.
  ``fixed`` is Definition 1 read at a single point: the
  per-sample gradients at the received model summed over one pass (eval mode, no augmentation).
  They differ in shape: at the received model the LPI is about n_ik - (what the model predicts
  for i), so classes below 1/C of every client get 0 in Eq. 5 and the GPI is much sharper than
  the label distribution at the tail; along the epoch the model learns the local marginal and
  the GPI comes out flatter than the label distribution — as the paper describes (Sec. 4.2) — but
  the trajectory no longer orders a client's classes exactly by count (measured). The mean
  (not the sum over steps or samples) leaves the n_k/n weights of Eq. 5 as the only client
  weighting. Only the LPI is uploaded; the pass's weights are discarded and round 1 starts from
  the initial model.
* With several experts, "the FC layer" is every expert's head: the LPI sums over all their
  inputs (the heads' weight matrices side by side); biases are not FC weights w_ij and are left out.
* GBME-p must bound the sensitivity for Theorem 2 to mean anything. A trajectory of SGD steps has
  none (one sample changes every later step), so GBME-p uses the fixed pass, whose
  per-sample gradients do not depend on one another; each per-sample FC-weight gradient is
  clipped to L2 norm ``dp_clip`` before the sum, so adding or removing one sample moves the sum
  by at most ``dp_clip`` in L2 (Delta = dp_clip, add/remove adjacency, the paper's), replacing
  one by at most 2 dp_clip (``dp_adjacency=replace``). Gaussian noise N(0, sigma^2) is added to
  every entry of the summed gradient, then it is divided by n_k (post-processing).
  What the guarantee covers: the one LPI upload (the paper's "single query"); the fit uploads
  after it are noiseless model updates whose classifier carries the label distribution. Every
  reply also sends n_k exactly, which add/remove adjacency would have to keep secret, so with n_k
  released the guarantee that holds is replace-one (Delta = 2 dp_clip).
  Calibration (``dp_calibration``): ``classical``, sigma = sqrt(2 ln(1.25/delta)) * Delta /
  epsilon (Theorem 2, the paper's), is (epsilon, delta)-DP for epsilon < 1 only, and the paper's
  epsilons (5..100) are outside it; ``analytic`` is the smallest sigma that is (epsilon, delta)-DP
  by the Gaussian mechanism's exact privacy profile. The run records the epsilon its sigma
  achieves at delta (``dp_epsilon_achieved``) beside ``dp_theorem_applies``.
  Noise source (``dp_noise``): drawn from the run's seed in simulations, so they repeat; on nodes
  that hold their own data from the operating system's entropy, since the server knows the seed.
* Eq. 5 gives 0 to a class whose LPI is non-positive on every client (a rare class: its share of
  each client stays below what the initial model predicts for it). As a balanced-softmax prior,
  0 means log 0: the loss's 1e-8 floor then shifts that class's logit by ~18 and the model
  predicts it everywhere. ``gpi_floor`` (default 1) gives such a class the smallest positive
  GPI value instead; ``gpi_floor=0`` keeps Eq. 5 as is. The GPI itself (grouping, diagnostics)
  is not floored. The default, ``gpi_counts=released``, replaces Eq. 5 by the released code's
  estimate (:func:`fedlt.methods.proxy_prior.count_proxy`), which produced the paper's numbers:
  every class at least 5 counts, so the floor has nothing to lift; the grouping stays Eq. 6
  against that GPI. At 100 classes Eq. 5 leaves a fifth of them at 0 and the floored prior
  over-predicts them (docs/methods/gbme.md).
* ``expert_loss=per_expert`` is the released code's loss: the loss on each trained expert's own
  logits, summed; in the per-expert phase (after ``joint_warmup``) times M, the code's factor for
  its one trained expert, which a client drawn for several experts applies to each of them.
* Selection size. Algorithm 1 trains D^1..D^R in a round, Sec. 4.1 selects 20 clients a round,
  and Sec. 3.3 draws alpha*R + (1-alpha)*R clients *per expert*: R is the round's client count
  and every expert gets R trainers (the released code does the same). A client drawn for several
  experts trains them all in one local training, so a round has between R and M*R distinct
  trainers (about 2x FedAvg's at M=3, alpha=0.6, 20 clients, R=8). ``clients_per_expert`` sets
  R; R = round(clients per round / M) is the budget-matched variant (an earlier reading; each
  expert then sees ~3 clients a round here and the experts' logits swing round to round, measured).
* A frozen expert keeps its BatchNorm in eval mode, so it computes what the server sent.
* Aggregation (``expert_aggregation``). Alg. 1 averages the selected clients' whole models by
  n_k/n, and a client leaves its frozen experts as it received them, so an expert moves by its
  trainers' share of the round's samples times their mean update. ``trainers`` averages each
  expert over its own trainers only (fedlt's earlier reading): every expert then takes its
  trainers' full step although the shared backbone under it is averaged over all the round's
  clients, and at a constant lr the per-expert phase diverges (main job, joint warm-up 0.6:
  75.2% at round 15, 10.3% at round 25, the experts' feature norms up 20x; ``all``: 78.1% at
  round 25, norms steady; +65.37 [51.77, 78.96] over three seeds, docs/methods/gbme.md).
  ``sequential`` is the released code's per-expert round: M sub-rounds (queries that train, run
  before the fit phase, which then trains no one), expert i's trainers starting from the model
  sub-round i-1 averaged, the whole model averaged over them.
* Expert heads are cosine heads, ``s * cos(w_c, h)`` with s = 30 (``expert_head``,
  ``cosine_scale``): the paper's code puts "normed" heads on its experts, and with plain linear
  heads the feature norm grows ~9x along the LPI epoch, late steps dominate the accumulated
  gradient and the GPI loses the head/tail order. A cosine head's gradient into the backbone is
  s/||h|| times a unit-scale term (~20x a linear head's on the CNN at initialisation): at full lr
  the first step alone raised the loss from 2.3 to 9 and left 2/3 of the CNN's features dead
  (measured, lr 0.05, momentum 0.9; the same at lr 0.01, and with the head's lr lowered or frozen,
  so the head's lr is not the cause; the gradients into the CNN's layers were ~200x a linear
  head's). The learning rate is therefore warmed up linearly over the local steps of the first
  ``warmup_rounds`` rounds (the LPI pass counting as round 1): from lr/(W S) at a client's first
  step of round 1 to lr at the end of round W (S: its steps in a round). W = 1 and 2 still let
  the loss jump to 7 and 4 in round 1; W = 5 kept it below 3.2 and the CNN trained (default 5
  with cosine heads, 0 with linear ones). As the features grow the cosine head's gradient
  shrinks, so full lr is then safe.
* ``joint_warmup`` (default 0.6): the released code trains all experts jointly (every selected
  client, every expert) for the first 3/5 of the rounds before the per-expert selection; the paper
  does not mention it. It is the default because it matters: on the reference protocol it is +6.14
  [0.49, 11.79] over per-expert selection from round 1 (``0``, the paper text's reading), 3 seeds,
  AVX512 (docs/results/reference.md). During it the engine's seeded schedule picks the round's
  clients, as for FedAvg, and the round is averaged; the released code's joint rounds average
  nothing (its global model is still the initial one when they end), so this repairs their intent.
  Its per-expert rounds do aggregate, expert by expert (docs/methods/gbme.md).
* ``ensemble=false`` trains the plain configured model (no experts, no grouping, the engine's
  sampling): that is FedAvg + the loss with the chosen prior — the "BSM + GPI" rows of Table 9.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from fedlt.config import FLOAT32_MAX
from fedlt.errors import FedltError, TrainingDiverged
from fedlt.losses import log_prior, make_loss
from fedlt.messages import Message, Query, Reply
from fedlt.methods.base import (
    LINEAR_HEAD, Client, ClientContext, LocalObjective, MethodArgs, ModelHead, Server, ServerContext, Stage,
    broadcast_state, clone_state,
)
from fedlt.methods.proxy_prior import (
    analytic_sigma, cosine_scores, count_proxy, epsilon_achieved, gaussian_sigma, global_proxy, local_proxy, pearson,
    random_groups, rank_groups, select_for_experts,
)
from fedlt.models import FedModel, create_model
from fedlt.models.multi_expert import SUPPORTED, MultiExpertModel, multi_expert_model
from fedlt.training.sequential import steps_per_epoch, train_local
from fedlt.transfer import to_host

LPI_QUERY = "gbme_lpi"
COUNTS_QUERY = "class_counts"
#: a sequential per-expert round's sub-round: the clients of one expert train it (as ``fit`` does)
EXPERT_FIT_QUERY = "gbme_expert_fit"
PHASE_KEY = "per_expert_phase"
GBME_LOSSES = ("bsm", "la", "ldam")
DIAG_KEY = "diag_nonprivate_gpi_pearson"
DIAG_TV_KEY = "diag_nonprivate_gpi_tv"
DIAG_TAIL_KEY = "diag_nonprivate_gpi_tail_ratio"
DIAG_LOG_KEY = "diag_nonprivate_gpi_prior_max_log_ratio"


class GBMEArgs(MethodArgs):
    prior: Literal["gpi", "local", "global"] = Field(
        "gpi", description="class prior of the loss: GPI; the client's own counts; the global counts "
        "(global: a NON-PRIVATE oracle, clients upload label histograms)")
    ensemble: bool = Field(True, description="multi-expert network; false = the plain model (FedAvg + loss + prior)")
    num_experts: int = Field(3, ge=1, description="M, experts and client groups (paper: 3)")
    alpha: float = Field(0.6, ge=0, le=1, description="share of an expert's clients drawn from its own group (Fig. 7: ~0.6)")
    grouping: Literal["gpi", "label", "random"] = Field(
        "gpi", description="rank clients by cos(LPI, GPI); by cos(local, global label distribution) "
        "(NON-PRIVATE); or at random")
    clients_per_expert: int | None = Field(
        None, ge=1, description="R of the selection rule, clients per expert per round; default = the configured "
        "clients per round (Alg. 1: R is the round's client count, each expert gets alpha*R + (1-alpha)*R)")
    expert_width: float = Field(0.75, gt=0, description="experts' width relative to the base model (code: 0.75)")
    expert_head: Literal["cosine", "linear"] = Field(
        "cosine", description="experts' heads: cosine, s * cos(w_c, h) (the paper's code), or linear")
    cosine_scale: float = Field(30.0, gt=0, description="s of the experts' cosine heads (code: 30)")
    warmup_rounds: float | None = Field(
        None, ge=0, description="lr warmed up linearly over the local steps of the first W rounds (the LPI pass "
        "counts as round 1); default 5 with cosine heads (they diverge at full lr from init), 0 with linear")
    joint_warmup: float = Field(
        0.6, ge=0, le=1, description="fraction of the rounds in which every selected client trains all experts "
        "before the per-expert selection (released code: 0.6; 0 = per-expert selection from round 1, the paper text)")
    expert_aggregation: Literal["all", "trainers", "sequential"] = Field(
        "all", description="an expert's average: over every client of the round, a client that did not train "
        "it counting the weights it received (Alg. 1, FedAvg of the clients' models); or over its trainers only; "
        "or sequential (released code): a per-expert round is M sub-rounds, expert i's trainers start from the "
        "model of sub-round i-1 and the whole model is averaged over them")
    expert_loss: Literal["mean_logits", "per_expert"] = Field(
        "mean_logits", description="the loss (bsm, la, ldam) on the mean of the experts' logits (mean_logits, "
        "Eq. 7); or per_expert (released code): its sum over the client's trained experts, each on its own "
        "logits, times M in the per-expert phase (frozen experts then pass no gradient to the backbone)")
    lpi_pass: Literal["auto", "epoch", "fixed"] = Field(
        "auto", description="LPI gradient: mean along one SGD epoch (epoch, Alg. 1/code) or per-sample at "
        "the received model (fixed); auto = epoch, fixed under DP")
    lpi_steps: int | None = Field(
        None, ge=1, description="the epoch pass stops after this many SGD steps (the paper's settings give ~2, "
        "the gradient at the initial model); default = the whole local epoch")
    gpi_counts: Literal["proxy", "released"] = Field(
        "released", description="the GPI: the released code's count estimate (released): each LPI as counts "
        "(entries <= 0 -> 1e-5, normalised, x n_k, rounded), summed, each class at least 5; or Eq. 5 on the "
        "LPIs (proxy), which leaves the rarest classes at 0")
    gpi_floor: float = Field(
        1.0, ge=0, description="prior of a class whose GPI is 0: this times the smallest positive GPI "
        "entry; 0 = Eq. 5 as is (the loss's 1e-8 floor)")
    dp_epsilon: float | None = Field(None, gt=0, description="GBME-p: privacy budget epsilon; None = GBME (no noise)")
    dp_delta: float = Field(0.03, gt=0, lt=1, description="GBME-p: failure probability delta (paper: 0.03)")
    dp_clip: float = Field(1.0, gt=0, description="GBME-p: per-sample L2 clip of the FC gradient")
    dp_adjacency: Literal["add_remove", "replace"] = Field(
        "add_remove", description="GBME-p: neighbouring datasets differ by one sample added or removed "
        "(sensitivity Delta = dp_clip, the paper's) or replaced (Delta = 2 dp_clip: the guarantee that holds "
        "while the client also sends its sample count n_k)")
    dp_calibration: Literal["classical", "analytic"] = Field(
        "classical", description="GBME-p: sigma = sqrt(2 ln(1.25/delta)) Delta / epsilon (classical, Theorem 2 "
        "and the paper's runs; (epsilon, delta)-DP only for epsilon < 1), or the smallest sigma that is "
        "(epsilon, delta)-DP at any epsilon (analytic, Balle & Wang 2018); every run records the epsilon "
        "its sigma achieves as dp_epsilon_achieved")
    dp_noise: Literal["auto", "seeded", "system"] = Field(
        "auto", description="GBME-p: source of the noise. seeded: the run's seed, round and client id, so a "
        "run repeats exactly, but anyone who knows the config can regenerate and subtract the noise; system: "
        "the operating system's entropy, not reproducible; auto: seeded in simulations, system on nodes that "
        "hold their own data (flower.node_data), which refuse seeded")
    diagnose_gpi: bool = Field(False, description="report the GPI against the true global prior (Pearson, TV "
                               "distance, tail ratio, largest log-prior error of the GPI prior); NON-PRIVATE "
                               "diagnostic (uploads label histograms)")

    @model_validator(mode="after")
    def _consistent(self) -> "GBMEArgs":
        if self.dp_epsilon is not None and self.lpi_pass == "epoch":
            raise ValueError("GBME-p bounds the sensitivity only for the per-sample pass; use lpi_pass=fixed "
                             "(or auto) with dp_epsilon")
        if self.lpi_steps is not None and self.pass_kind() == "fixed":
            raise ValueError("lpi_steps caps the epoch pass, not the per-sample one (lpi_pass=fixed, or auto "
                             "under dp_epsilon); drop lpi_steps")
        if self.expert_loss == "per_expert" and not self.ensemble:
            raise ValueError("expert_loss=per_expert needs the experts; drop it or set ensemble=true")
        if self.expert_aggregation == "sequential" and not self.ensemble:
            raise ValueError("expert_aggregation=sequential runs one sub-round per expert and needs the experts; "
                             "drop it or set ensemble=true")
        return self

    def unread_when(self) -> list[tuple[tuple[str, ...], str]]:
        dp = ("dp_delta", "dp_clip", "dp_adjacency", "dp_calibration", "dp_noise")
        unread = []
        if not self.ensemble:
            unread.append((("num_experts", "alpha", "grouping", "clients_per_expert", "expert_width", "expert_head",
                            "cosine_scale", "joint_warmup"), "with ensemble=false (the plain model has no experts)"))
        if not self.needs_lpi():
            unread.append((("lpi_pass", "lpi_steps", "gpi_counts", "diagnose_gpi", "dp_epsilon", *dp),
                           f"with prior={self.prior} and no GPI grouping (no client computes an LPI)"))
        elif self.dp_epsilon is None:
            unread.append((dp, "without dp_epsilon (GBME-p's privacy budget; GBME adds no noise)"))
        if self.prior != "gpi" and not self.diagnoses():  # the diagnosis measures the floored GPI prior
            unread.append((("gpi_floor",), f"with prior={self.prior} (it floors the GPI prior)"))
        elif self.needs_lpi() and self.gpi_counts == "released":
            unread.append((("gpi_floor",), "with gpi_counts=released (every class keeps at least 5 counts, so no "
                           "GPI entry is 0 to floor)"))
        return unread

    def pass_kind(self) -> str:
        if self.lpi_pass != "auto":
            return self.lpi_pass
        return "fixed" if self.dp_epsilon is not None else "epoch"

    def dp_sensitivity(self) -> float:
        """Delta of the clipped per-sample sum: one sample added or removed moves it by at most
        ``dp_clip`` in L2, one sample replaced by at most twice that."""
        return self.dp_clip * (2.0 if self.dp_adjacency == "replace" else 1.0)

    def dp_sigma(self) -> float:
        """GBME-p's noise scale under ``dp_calibration``."""
        calibrate = gaussian_sigma if self.dp_calibration == "classical" else analytic_sigma
        return calibrate(self.dp_epsilon, self.dp_delta, self.dp_sensitivity())

    def needs_lpi(self) -> bool:
        return self.prior == "gpi" or (self.ensemble and self.grouping == "gpi")

    def needs_counts(self) -> bool:
        return self.prior == "global" or (self.ensemble and self.grouping == "label") or self.diagnoses()

    def diagnoses(self) -> bool:
        """Whether ``diagnose_gpi`` has a GPI to diagnose."""
        return self.diagnose_gpi and self.needs_lpi()

    def warmup(self) -> float:
        if self.warmup_rounds is not None:
            return self.warmup_rounds
        return 5.0 if self.ensemble and self.expert_head == "cosine" else 0.0


def make_gbme_model(cfg, num_classes: int, in_channels: int, image_size: int) -> FedModel:
    args = GBMEArgs.model_validate(cfg.method_args)
    if not args.ensemble:
        return create_model(cfg.model.name, num_classes, in_channels=in_channels, image_size=image_size)
    return multi_expert_model(cfg.model.name, num_classes, in_channels, args.num_experts, args.expert_width,
                              args.cosine_scale, args.expert_head)


def gbme_head(args: GBMEArgs) -> ModelHead:
    """What a calibration finds: the ensemble's combined head (the mean of the experts' logits),
    linear when the experts' heads are; the plain model's head without the ensemble."""
    if not args.ensemble:
        return LINEAR_HEAD
    if args.expert_head == "cosine":
        return ModelHead(f"{args.num_experts} cosine expert heads (unit-norm class vectors, nothing learned in "
                         "their norms)", experts=args.num_experts, fix="method_args.expert_head=linear")
    return ModelHead(f"{args.num_experts} linear expert heads", linear=combined_linear, experts=args.num_experts)


@torch.no_grad()
def combined_linear(model: MultiExpertModel) -> nn.Linear:
    """Linear experts as the one linear head they compute: the mean of their logits is
    ``[W_1 .. W_M] / M`` over their features side by side, plus the mean of their biases."""
    heads = list(model.head.heads)
    head = nn.Linear(model.feature_dim, model.num_classes).to(heads[0].weight.device)
    head.weight.copy_(torch.cat([h.weight for h in heads], dim=1) / len(heads))
    head.bias.copy_(torch.stack([h.bias for h in heads]).mean(0))
    return head


def fc_weights(model: FedModel) -> list[torch.nn.Parameter]:
    """The final FC layer's weight matrices (every expert's head; biases excluded)."""
    return [p for _, p in sorted(model.head.named_parameters()) if p.dim() == 2]


# ---- client -------------------------------------------------------------------------------
def warmup_factor(rnd: int, steps: int, rounds: float) -> Callable[[int], float] | None:
    """The lr factor ``min(1, (rnd - 1 + i / steps) / rounds)`` of the i-th local step (i = 1..steps):
    a linear warm-up over the first ``rounds`` rounds of ``steps`` local steps; None after them."""
    if rounds <= 0 or rnd - 1 >= rounds:
        return None
    return lambda i: min(1.0, (rnd - 1 + i / steps) / rounds)


@contextmanager
def lr_warmup(rnd: int, steps: int, rounds: float) -> Iterator[None]:
    """Scale every optimiser's lr by :func:`warmup_factor` at its i-th step."""
    factor_at = warmup_factor(rnd, steps, rounds)
    if factor_at is None:
        yield
        return
    count = 0

    def scale(optimizer, args, kwargs) -> None:
        nonlocal count
        count += 1
        factor = factor_at(count)
        for group in optimizer.param_groups:
            group["lr"] = group.setdefault("warmup_base_lr", group["lr"]) * factor

    handle = register_optimizer_step_pre_hook(scale)
    try:
        yield
    finally:
        handle.remove()


class _StepsDone(Exception):
    """Raised by the batch loss of :func:`first_steps` once its steps are taken."""


def first_steps(ctx: ClientContext, batch_loss, limit: int | None) -> int:
    """:func:`train_local` for one epoch, stopped after ``limit`` SGD steps (None: the whole
    epoch); returns the steps taken. Stopping the shared loop, rather than running a copy of it,
    keeps a capped pass exactly the first steps of the whole one."""
    taken = 0

    def counted(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        nonlocal taken
        if taken == limit:
            raise _StepsDone
        taken += 1
        return batch_loss(x, y)

    try:
        train_local(ctx, counted, epochs=1)
    except _StepsDone:
        pass
    return taken


def epoch_fc_gradient(ctx: ClientContext, warmup: float = 0.0, max_steps: int | None = None) -> torch.Tensor:
    """One local epoch of CE on ``ctx.model`` (warmed up as round 1), or its first ``max_steps``
    steps; the mean over those steps of the FC-weight gradient."""
    weights = fc_weights(ctx.model)
    sums = [torch.zeros_like(w) for w in weights]
    handles = [w.register_hook(lambda g, acc=acc: acc.add_(g.detach())) for w, acc in zip(weights, sums)]
    try:
        with lr_warmup(1, steps_per_epoch(len(ctx.data), ctx.train.batch_size), warmup):
            steps = first_steps(ctx, lambda x, y: F.cross_entropy(ctx.model(x), y), max_steps)
    finally:
        for h in handles:
            h.remove()
    return torch.cat(sums, dim=1) / max(steps, 1)


PER_SAMPLE_CHUNK_ELEMENTS = 1 << 24
"""Bound on the (samples, C, H) per-sample FC gradients :func:`fixed_fc_gradient` builds at once
(256 samples while they fit): at a thousand classes a chunk of 256 would hold gigabytes."""


def per_sample_fc_gradients(model: FedModel, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(B, C, H) per-sample CE gradients of the FC weights at ``model`` (eval mode, features fixed)."""
    names = [n for n, p in sorted(model.head.named_parameters()) if p.dim() == 2]
    rest = {n: p.detach() for n, p in model.head.named_parameters() if n not in names}
    rest.update({n: b for n, b in model.head.named_buffers()})

    def loss(weights: dict[str, torch.Tensor], h: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(model.head, {**rest, **weights}, (h[None],))
        return F.cross_entropy(logits, target[None])

    with torch.no_grad():
        features = model.forward_features(x)
    grads = torch.func.vmap(torch.func.grad(loss), in_dims=(None, 0, 0))(
        {n: p.detach() for n, p in model.head.named_parameters() if n in names}, features, y)
    return torch.cat([grads[n] for n in names], dim=2)


def noise_generator(ctx: ClientContext, source: str) -> torch.Generator:
    """Where GBME-p's noise comes from (``dp_noise``): the run's (seed, round, client) stream, so a
    simulation repeats exactly; or, on a node that holds its own data (``auto``) or by request
    (``system``), a generator seeded from the operating system's entropy, which nobody who knows
    the config can regenerate to subtract the noise."""
    if source == "seeded" or (source == "auto" and not ctx.node_data):
        return ctx.generator(purpose=8)
    generator = torch.Generator(device=ctx.data.images.device)
    generator.manual_seed(int.from_bytes(os.urandom(8), "little"))
    return generator


def fixed_fc_gradient(ctx: ClientContext, clip: float | None, sigma: float,
                      generator: torch.Generator | None = None) -> torch.Tensor:
    """Sum over the client's samples of the (clipped) per-sample FC gradient at the received model,
    plus N(0, sigma^2) noise per entry when sigma > 0 (from ``generator``; default the seeded
    stream), divided by n_k."""
    model, data = ctx.model, ctx.data
    model.eval()
    device = data.indices.device
    total = torch.zeros(model.num_classes, sum(w.shape[1] for w in fc_weights(model)), device=device)
    chunk = min(256, max(1, PER_SAMPLE_CHUNK_ELEMENTS // total.numel()))
    for start in range(0, len(data), chunk):
        x, y = data.batch(torch.arange(start, min(start + chunk, len(data)), device=device))
        g = per_sample_fc_gradients(model, x, y)
        if clip is not None:
            norms = g.flatten(1).norm(dim=1).clamp_min(1e-12)
            g = g * (clip / norms).clamp(max=1.0)[:, None, None]
        total += g.sum(0)
    if sigma > 0:
        noise = torch.randn(total.shape, generator=generator or ctx.generator(purpose=8), device=device)
        total = total + sigma * noise
    return total / max(len(data), 1)


def prior_loss(ctx: ClientContext, prior: torch.Tensor | np.ndarray):
    """The configured re-balancing loss (bsm, la, ldam) with ``prior`` as its class distribution."""
    cfg = ctx.loss_config
    # the loss's terms are made on the host (the server's tensor or the host's counts) and copied
    host = to_host(prior) if isinstance(prior, torch.Tensor) else prior
    if host.sum() <= 0:
        raise RuntimeError("GBME's class prior has no positive entry; every client's proxy was non-positive")
    p = torch.from_numpy(host).to(torch.float64)
    return make_loss(cfg.name, prior=(p / p.sum()).float().numpy(), class_counts=host, tau=cfg.tau,
                     ldam_max_margin=cfg.ldam_max_margin, ldam_scale=cfg.ldam_scale, device=ctx.data.labels.device)


def per_expert_loss(model: MultiExpertModel, loss, experts: list[int], per_expert_phase: bool):
    """The released code's loss: ``loss`` on each trained expert's own logits, summed, times M in
    the per-expert phase. Only the trained experts are in the graph, so a frozen expert sends no
    gradient into the shared backbone; against Eq. 7 (the mean of M experts' logits) a trained
    expert's logits get about M^2 times the gradient in that phase."""
    scale = model.num_experts if per_expert_phase else 1

    def batch_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return scale * torch.stack([loss(v, y) for v in model.expert_logits(x, experts)]).sum()

    return batch_loss


def round_loss(ctx: ClientContext, msg: Message):
    """The round's loss: the configured one with the server's prior (GPI, global), or the client's counts."""
    prior = msg.payload.get("prior")
    return prior_loss(ctx, ctx.data.host_counts() if prior is None else prior)


def local_steps(ctx: ClientContext) -> int:
    """The SGD steps of the client's round (what the warm-up spreads its rate over)."""
    return ctx.train.epochs * steps_per_epoch(len(ctx.data), ctx.train.batch_size)


def trained_part(model: FedModel, state: dict[str, torch.Tensor], experts: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """What a client uploads: with experts, the backbone and the experts it trained; else everything."""
    if not isinstance(model, MultiExpertModel):
        return state
    keep = set(model.shared_keys()).union(*(model.expert_keys(e) for e in to_host(experts).tolist()))
    return {k: v for k, v in state.items() if k in keep}


class GBMEClient(Client):
    args: GBMEArgs
    objective_backends = ("graphed",)
    backend_refusal_why = "its clients train under a class prior it sends and, with the ensemble, only their own experts"

    def query(self, name: str, ctx: ClientContext, msg: Message) -> Reply:
        if name == COUNTS_QUERY:
            return Reply(payload={"class_counts": ctx.data.class_counts().cpu()}, num_samples=len(ctx.data))
        if name == LPI_QUERY:
            return Reply(payload={"lpi": self.lpi(ctx, msg).cpu()}, num_samples=len(ctx.data))
        if name == EXPERT_FIT_QUERY:
            return self.fit(ctx, msg)
        return super().query(name, ctx, msg)

    def lpi(self, ctx: ClientContext, msg: Message) -> torch.Tensor:
        """Eq. 4 from one pass on the received model (noised under GBME-p)."""
        ctx.model.load_state_dict(msg.weights, strict=False)
        a = self.args
        if a.pass_kind() == "epoch":
            grad = epoch_fc_gradient(ctx, a.warmup(), a.lpi_steps)
        else:
            private = a.dp_epsilon is not None
            sigma = a.dp_sigma() if private else 0.0
            noise = noise_generator(ctx, a.dp_noise) if private else None
            grad = fixed_fc_gradient(ctx, a.dp_clip if private else None, sigma, noise)
        return local_proxy(grad.float())

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        loss = round_loss(ctx, msg)
        experts = msg.payload.get("experts")
        multi = isinstance(model, MultiExpertModel)
        if multi:
            model.set_trainable_experts([int(e) for e in experts])
        if self.args.expert_loss == "per_expert":
            batch_loss = per_expert_loss(model, loss, [int(e) for e in experts], bool(msg.payload[PHASE_KEY]))
        else:
            batch_loss = lambda x, y: loss(model(x), y)
        try:
            params = [p for p in model.parameters() if p.requires_grad]
            with lr_warmup(ctx.round, local_steps(ctx), self.args.warmup()):
                metrics = train_local(ctx, batch_loss, params=params)
        finally:
            if multi:
                model.set_trainable_experts(None)
        return Reply(weights=trained_part(model, clone_state(model), experts), num_samples=len(ctx.data),
                     metrics=metrics)

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective | None:
        """Eq. 7's loss of the mean logits, the client's experts the only ones trained (``prepare``)
        and the warm-up's rate per step; None for the released code's per-expert loss (its graph
        depends on the client's experts) and for a client without data."""
        if self.args.expert_loss == "per_expert" or len(ctx.data) == 0:
            return None
        experts = msg.payload.get("experts")
        prepare = None
        if isinstance(ctx.model, MultiExpertModel):
            chosen = to_host(experts).tolist()
            prepare = lambda model: model.set_trainable_experts(chosen)  # noqa: E731
        return LocalObjective(round_loss(ctx, msg), prepare=prepare,
                              lr_scale=warmup_factor(ctx.round, local_steps(ctx), self.args.warmup()),
                              finish=lambda state, _: trained_part(ctx.model, state, experts))


def gpi_diagnostics(gpi: torch.Tensor, counts: torch.Tensor) -> dict[str, float]:
    """The GPI against the true global prior: Pearson correlation with the counts, total-variation
    distance of the normalised GPI, and tail ratio = the GPI's mass on the rarer half of the
    classes over the true mass there (1: right; below 1: sharper than the truth at the tail)."""
    q = gpi.double() / gpi.double().sum().clamp_min(1e-12)
    p = counts.double() / counts.double().sum()
    tail = torch.argsort(counts, stable=True)[: len(counts) // 2]
    return {DIAG_KEY: pearson(gpi, counts), DIAG_TV_KEY: 0.5 * float((q - p).abs().sum()),
            DIAG_TAIL_KEY: float(q[tail].sum() / p[tail].sum().clamp_min(1e-12))}


def prior_log_error(prior: torch.Tensor, counts: torch.Tensor) -> float:
    """max over the classes present of |log q_c - log p_c|, q the prior as the loss reads it
    (normalised, floored: :func:`fedlt.losses.log_prior`), p the true one. A logit-adjusted loss
    trained with q leaves class c's logits biased by log p_c - log q_c, so this is the largest
    such bias; a class at 1/20 of its share moves by 3 nats while the TV distance barely sees it."""
    present = counts > 0
    truth = torch.log(counts.double()[present] / counts.double().sum())
    return float((log_prior(prior).double()[present] - truth).abs().max())


# ---- server -------------------------------------------------------------------------------
class GBMEServer(Server):
    args: GBMEArgs

    @classmethod
    def model_refusal(cls, config, args):
        """The multi-expert network exists for the CNN and the CIFAR ResNets only."""
        if args.ensemble and config.model.name not in SUPPORTED:
            return (f"GBME's multi-expert network has no version of model {config.model.name!r}; use "
                    f"model.name=<one of {', '.join(SUPPORTED)}> or method_args.ensemble=false")
        return None

    @classmethod
    def node_data_refusal(cls, config, args):
        """Seeded noise on nodes that hold their own data: the server knows the seed, so it could
        regenerate the noise and subtract it from the LPI."""
        if args.dp_epsilon is not None and args.dp_noise == "seeded":
            return ("flower.node_data: method_args.dp_noise=seeded lets the server, which knows the seed, "
                    "regenerate GBME-p's noise and subtract it; use method_args.dp_noise=system (or auto)")
        return None

    @classmethod
    def clear_uploads(cls, config, args):
        """Every reading that queries each client's label counts (the GPI exists to avoid them)."""
        named = {"method_args.prior=global": args.prior == "global",
                 "method_args.grouping=label": args.ensemble and args.grouping == "label",
                 "method_args.diagnose_gpi=true": args.diagnoses()}
        return [option for option, used in named.items() if used]

    @classmethod
    def trains_in_fit(cls, config, args):
        """Not with sequential per-expert sub-rounds: those rounds train in queries, their fit phase is empty."""
        return not (args.ensemble and args.expert_aggregation == "sequential")

    @classmethod
    def config_refusal(cls, config, args):
        if config.loss.prior != "local":
            return "method gbme takes its prior from method_args.prior (gpi, local, global); remove loss.prior"
        if args.ensemble and args.num_experts > config.data.num_clients:
            return (f"method_args.num_experts={args.num_experts} needs at least as many clients "
                    f"(data.num_clients={config.data.num_clients}); lower num_experts")
        # each of dp_clip, dp_epsilon passed its float32 check; the noise scale made of them may not
        if args.dp_epsilon is not None and args.needs_lpi() and (sigma := args.dp_sigma()) > FLOAT32_MAX:
            return (f"GBME-p's noise sigma = {sigma:.4g} (from method_args.dp_clip={args.dp_clip:g}, "
                    f"dp_epsilon={args.dp_epsilon:g}, dp_delta={args.dp_delta:g}) is past the 32-bit floats training "
                    f"computes in (at most {FLOAT32_MAX:.4g}); raise dp_epsilon or lower dp_clip")
        return None

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        self.lpis: dict[int, torch.Tensor] | None = None
        self.client_counts: dict[int, torch.Tensor] | None = None
        self.num_samples: dict[int, int] = {}
        self.gpi: torch.Tensor | None = None
        self.groups: list[list[int]] | None = None
        self.selection: dict[int, list[int]] = {}
        self.joint = True
        #: a sequential per-expert round: the experts whose sub-rounds are still to run, and the
        #: (train loss, samples) of the sub-rounds run
        self._sub_rounds: list[int] = []
        self._sub_losses: list[tuple[float, int]] = []
        self._round_metrics: dict[str, float] = {}

    # -- setup ---------------------------------------------------------------------------
    def next_query(self, stage: Stage, rnd: int, clients: list[int]) -> Query | None:
        if stage == "before_fit" and self._sub_rounds:
            expert = self._sub_rounds.pop(0)
            trainers = [cid for cid, experts in self.selection.items() if expert in experts]
            return Query(EXPERT_FIT_QUERY, {cid: self._message([expert]) for cid in trainers})
        if stage != "setup":
            return None
        a = self.args
        if a.needs_counts() and self.client_counts is None:
            return Query(COUNTS_QUERY, {cid: Message() for cid in clients})
        if a.needs_lpi() and self.lpis is None:
            weights = broadcast_state(self.model)
            return Query(LPI_QUERY, {cid: Message(weights=weights) for cid in clients})
        if a.ensemble and self.groups is None:
            self.groups = self._group(clients)
        return None

    def receive(self, query: Query, replies: dict[int, Reply]) -> None:
        if query.name == EXPERT_FIT_QUERY:  # the sub-round's whole model, averaged over its trainers
            super().aggregate(0, replies)
            self._sub_losses += [(r.metrics["train_loss"], r.num_samples) for r in replies.values()
                                 if r.num_samples > 0 and r.metrics.get("train_loss") is not None]
            return
        key = {COUNTS_QUERY: "class_counts", LPI_QUERY: "lpi"}.get(query.name)
        if key is None:
            return super().receive(query, replies)
        values = {cid: r.payload[key].double() for cid, r in replies.items()}
        self.num_samples.update({cid: r.num_samples for cid, r in replies.items()})
        if query.name == COUNTS_QUERY:
            self.client_counts = values
        else:
            self._check_lpis(values)
            self.lpis = values
            estimate = global_proxy if self.args.gpi_counts == "proxy" else count_proxy
            self.gpi = estimate(values, self.num_samples)
            if self.args.prior == "gpi" and not bool((self.gpi > 0).any()):  # else every client's loss refuses it
                cosine = self.args.ensemble and self.args.expert_head == "cosine"
                scale = f"method_args.cosine_scale, now {self.args.cosine_scale:g}"
                raise FedltError("GBME's global proxy (GPI) has no positive entry: every client's local proxy was "
                                 "zero or negative" + (f" (as under a tiny {scale})" if cosine else "")
                                 + ", so it is no class prior; " + ("raise cosine_scale or " if cosine else "")
                                 + "use method_args.gpi_counts=released or method_args.prior=local")

    def _check_lpis(self, lpis: dict[int, torch.Tensor]) -> None:
        """A non-finite local proxy (the LPI pass diverged, or GBME-p's noise overflowed) would make a NaN
        class prior that every client's loss refuses in round 1: stopped here in one line with the fix."""
        bad = [cid for cid, lpi in sorted(lpis.items()) if not bool(torch.isfinite(lpi).all())]
        if not bad:
            return
        a, fixes = self.args, []
        if a.dp_epsilon is not None:
            fixes.append(f"raise method_args.dp_epsilon or lower dp_clip (GBME-p's noise sigma is {a.dp_sigma():.4g})")
        if a.pass_kind() == "epoch":
            fixes.append(f"lower fl.lr (now {self.ctx.config.fl.lr:g})")
        if a.ensemble and a.expert_head == "cosine":
            fixes.append(f"lower method_args.cosine_scale (now {a.cosine_scale:g})")
        raise TrainingDiverged(
            f"training diverged in GBME's LPI pass (the setup stage, before round 1): the local proxy of "
            f"{len(bad)} client(s) (client {bad[0]} first) is not finite; "
            + (", or ".join(fixes) if fixes else "check the method's knobs"))

    def _group(self, clients: list[int]) -> list[list[int]]:
        a = self.args
        if a.grouping == "random":
            return random_groups(clients, a.num_experts, self.ctx.rng(0, purpose=1))
        if a.grouping == "label":
            dists = {k: c / c.sum().clamp_min(1) for k, c in self.client_counts.items()}
            return rank_groups(cosine_scores(dists, self.global_counts()), a.num_experts)
        return rank_groups(cosine_scores(self.lpis, self.gpi), a.num_experts)

    def gpi_prior(self) -> torch.Tensor:
        """The GPI as a class prior: zero entries raised to ``gpi_floor`` x the smallest positive one."""
        gpi = to_host(self.gpi)
        positive = gpi[gpi > 0]
        if positive.size == 0 or self.args.gpi_floor == 0:
            return self.gpi
        return self.gpi.clamp_min(self.args.gpi_floor * float(positive.min()))

    def global_counts(self) -> torch.Tensor:
        return sum(self.client_counts[k] for k in sorted(self.client_counts))

    # -- rounds --------------------------------------------------------------------------
    def per_expert(self) -> int:
        """R: every expert is trained by R clients a round, R = the configured clients per round
        unless ``clients_per_expert`` says otherwise (see the module docstring)."""
        a = self.args
        return a.clients_per_expert if a.clients_per_expert is not None else self.ctx.config.clients_per_round()

    def select_clients(self, rnd: int, scheduled: list[int]) -> list[int]:
        if not self.args.ensemble:
            self.selection = {}
            return scheduled
        self.joint = rnd <= self.args.joint_warmup * self.ctx.config.fl.rounds
        if self.joint:  # every expert, the engine's clients
            self.selection = {cid: list(range(self.args.num_experts)) for cid in scheduled}
            return scheduled
        self.selection = select_for_experts(self.groups, self.args.alpha, self.per_expert(),
                                            self.ctx.rng(rnd, purpose=2))
        if self.args.expert_aggregation == "sequential":  # the round runs as sub-rounds before fit, not in it
            self._sub_rounds, self._sub_losses = list(range(self.args.num_experts)), []
            return []
        return sorted(self.selection)

    def fit_message(self, rnd: int, cid: int) -> Message:
        return self._message(self.selection.get(cid))

    def _message(self, experts: list[int] | None) -> Message:
        """What a client trains on: the model, the prior, and the experts it trains."""
        payload: dict = {}
        if self.args.prior == "gpi":
            payload["prior"] = self.gpi_prior().float()
        elif self.args.prior == "global":
            payload["prior"] = self.global_counts().float()
        if self.args.ensemble:
            payload["experts"] = torch.tensor(experts, dtype=torch.int64)
        if self.args.expert_loss == "per_expert":
            payload[PHASE_KEY] = not self.joint
        return Message(weights=broadcast_state(self.model), payload=payload)

    def aggregate(self, rnd: int, replies: dict[int, Reply]) -> None:
        if self.args.ensemble and self.args.expert_aggregation == "all":  # frozen experts count as sent
            sent = self.model.state_dict()  # read before the average is loaded: no copy needed
            replies = {cid: replace(r, weights={**sent, **r.weights}) for cid, r in replies.items()}
        super().aggregate(rnd, replies)  # per entry, over the replies that carry it
        sequential = not self.joint and self.args.expert_aggregation == "sequential"
        m: dict[str, float] = {"trainers": float(len(self.selection) if sequential else len(replies))}
        if sequential and self._sub_losses:  # the round's loss is its sub-rounds'
            m["train_loss"] = sum(loss * n for loss, n in self._sub_losses) / sum(n for _, n in self._sub_losses)
        for e in range(self.args.num_experts if self.args.ensemble else 0):
            m[f"expert{e}_trainers"] = float(sum(e in ex for ex in self.selection.values()))
        self._round_metrics = m

    def metrics(self) -> dict[str, float]:
        out = dict(self._round_metrics)
        a = self.args
        if a.dp_epsilon is not None and a.needs_lpi():  # without an LPI no noise is added, so no privacy figure
            sigma = a.dp_sigma()
            out.update({
                "dp_epsilon": a.dp_epsilon, "dp_delta": a.dp_delta, "dp_sensitivity": a.dp_sensitivity(),
                "dp_sigma": sigma, "dp_epsilon_achieved": epsilon_achieved(sigma, a.dp_delta, a.dp_sensitivity()),
            })
            if a.dp_calibration == "classical":
                out["dp_theorem_applies"] = float(a.dp_epsilon < 1)
        if a.diagnose_gpi and self.gpi is not None:
            out.update(gpi_diagnostics(self.gpi, self.global_counts()))
            out[DIAG_LOG_KEY] = prior_log_error(self.gpi_prior(), self.global_counts())
        return out

    def state_dict(self):
        return {**super().state_dict(), "lpis": self.lpis, "client_counts": self.client_counts,
                "num_samples": self.num_samples, "gpi": self.gpi, "groups": self.groups}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        for key in ("lpis", "client_counts", "num_samples", "gpi", "groups"):
            setattr(self, key, state[key])
