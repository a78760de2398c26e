"""FedYoYo (2025): augmented self-bootstrap distillation (ASD) and distribution-aware logit
adjustment (DLA), aggregated with FedAvg.

Every local batch is seen twice, as a weak view (crop, flip, rotation) and a strong view (crop,
flip, RandAugment, Cutout); both go through the model in one forward pass. The local loss is
(Eq. 9)

    L = L_DLA + lambda_r * L_ASD.

- **DLA** (Eq. 7-8): cross-entropy of the distribution-fused balanced softmax
  ``p(y|x) ~ pi_mix[y] * exp(f_y(x) / T)`` on both views. ``pi_mix = (1 - gamma) pi_g +
  gamma pi_k`` (Eq. 6) fuses the server's estimate of the global prior ``pi_g`` with the
  client's own prior ``pi_k``.
- **ASD** (Eq. 1): ``KL(p(teacher view) || p(student view))`` with the same adjusted softmax,
  the teacher detached, summed over the samples whose teacher prediction (argmax of the adjusted
  softmax) is the label, divided by the batch size (Eq. 1's ``1/n_k``).
- **Effective prior** (Eq. 3-5): during training the client keeps the teacher view's features;
  per class ``c`` and batch ``b``, the correlation matrix ``R_cb`` of the features centred at the
  class prototype (the class mean of those features over the round) gives an effective number
  ``1 / (a R_cb a^T)``, ``a = (1/m, ..., 1/m)``; these are summed over the round's batches and
  normalised into ``pi_k``. ``a R a^T`` is the squared norm of the mean of the unit vectors
  ``(h_i - mu_c) / ||h_i - mu_c||``, so no ``m x m`` matrix is formed. Many samples, and samples
  that point in different directions, give a large effective number; near-duplicates count
  once. The client uploads ``pi_k`` with its update; the server's ``pi_g`` is the
  sample-weighted mean of the client priors (FedAvg of the priors).

Choices where the paper is silent, and deviations from the released code:

- ``pi_mix`` is fused ONCE per round, before local training, from the ``pi_g`` just received and
  the client's latest ``pi_k``. (The released code re-mixes every batch, ``prior <- (1 - g)
  prior + g pi_k``, which compounds to the purely local prior within a round.)
- Before any estimate exists: ``pi_g`` is uniform until the first clients have reported (round
  1 then trains with ``(1 - gamma) * uniform + gamma * pi_k``); a client that has not yet
  estimated its prior (first participation) uses its label distribution, which is what the
  effective number reduces to for uncorrelated features. Each estimate is made during a round's
  training and used from the client's next participation on.
- ``pi_g`` averages the latest prior of every client that has reported so far (weighted by its
  sample count), not only the current round's 40%; ``prior_memory=false`` uses only the round's
  participants.
- An effective number is capped at the class's sample count in the batch (``a R a^T >= 1/m``):
  anti-correlated samples around the prototype would otherwise give arbitrarily large values
  (the released code clamps ``a R a^T`` at 1e-6 and patches outliers afterwards).
- T = 1.5 divides the logits in both losses, as in Eq. 7 (the released code instead adds
  ``1.5 * log prior`` in the CE and divides by T only in the KL; the two differ by a logit scale).
- ``lambda`` (default 4.0, the released script; the paper recommends 3-5.5) ramps linearly from
  0 over the first ``warmup`` fraction of the rounds (released script: 50 of 300 rounds); the
  server sends ``lambda_r`` with the model.
- ``gamma`` (default 0.1, the released script) weights the LOCAL prior, as in Eq. 6 (the text of
  Sec. 3.4 says the opposite; Eq. 6 and the code agree).

Knobs for what the paper leaves open on small grayscale images: ``strong_magnitude`` and
``cutout`` (the strong view's RandAugment magnitude and Cutout side, CIFAR defaults 9 and 0.5),
``teacher_filter`` (which argmax decides that a teacher is correct: the adjusted softmax, as
released, or the raw logits). Early in training the adjusted-correct teachers are almost all
head samples, so ASD then acts as extra head-class cross-entropy on the strong views; on
Fashion-MNIST-LT at 10-25 rounds this collapses the model to the head (README, FedYoYo).

Ablation knobs: Table 4 — ``asd=false``, ``dla=false`` (no prior: plain softmax at the same
temperature in both losses), RandAug off = ``student_view=weak`` (two weak views); Table 5 —
``teacher_view`` / ``student_view``; Fig. 6 — ``prior_source=counts`` (label counts: the client's
own, and the federation's from a setup query — NOT private) and ``gamma`` (0: no fusion, global
prior only). ``prior_diagnostic=true`` makes the server query every client's label counts once
(NOT private, a diagnostic only) and report ``prior_tv`` (total variation, half the L1 distance)
and ``prior_l2`` between ``pi_g`` and the true global label distribution every round.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Any, Literal

import torch
import torch.nn.functional as F
from pydantic import Field

from fedlt.data.augment import strong_view, weak_view
from fedlt.errors import ConfigError
from fedlt.losses import log_prior
from fedlt.messages import Message, Reply
from fedlt.methods.base import ClientContext, MethodArgs, ServerContext, clone_state
from fedlt.methods.fedavg import FedAvgClient, FedAvgServer
from fedlt.training import train_local

class FedYoYoArgs(MethodArgs):
    lam: float = Field(4.0, ge=0, description="weight lambda of the ASD loss after warm-up (paper: 3-5.5)")
    warmup: float = Field(1 / 6, ge=0, le=1, description="fraction of fl.rounds over which lambda ramps up linearly")
    temperature: float = Field(1.5, gt=0, description="temperature T of the adjusted softmax (both losses)")
    gamma: float = Field(0.1, ge=0, le=1, description="weight of the local prior in pi_mix = (1-gamma) pi_g + gamma pi_k")
    asd: bool = Field(True, description="self-bootstrap distillation on (Table 4)")
    dla: bool = Field(True, description="distribution-aware logit adjustment on; off: no prior (Table 4)")
    teacher_view: Literal["weak", "strong"] = Field("weak", description="view that teaches in ASD (Table 5)")
    student_view: Literal["weak", "strong"] = Field(
        "strong", description="view that learns in ASD; weak = RandAug off (Tables 4, 5)"
    )
    strong_magnitude: float = Field(
        9.0, ge=0, le=10, description="RandAugment magnitude (0..10) of the strong view; 0: no RandAugment"
    )
    cutout: float = Field(0.5, ge=0, le=1, description="Cutout square side as a fraction of the image side; 0: off")
    teacher_filter: Literal["adjusted", "raw"] = Field(
        "adjusted", description="a teacher is correct by the argmax of the adjusted softmax, or of the raw logits"
    )
    prior_source: Literal["estimated", "counts"] = Field(
        "estimated", description="estimated effective priors, or the true label counts (NOT private; Fig. 6)"
    )
    prior_memory: bool = Field(True, description="pi_g averages every client's latest prior; false: this round's only")
    prior_diagnostic: bool = Field(
        False, description="server learns the true label counts (NOT private) and reports its prior's distance to them"
    )


# ---- the math -------------------------------------------------------------------------------
def adjusted_log_softmax(logits: torch.Tensor, log_pi: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log p(y|x)`` of the distribution-fused balanced softmax (Eq. 7)."""
    return F.log_softmax(logits / temperature + log_pi.to(logits.dtype), dim=1)


def dla_loss(logits: torch.Tensor, targets: torch.Tensor, log_pi: torch.Tensor, temperature: float) -> torch.Tensor:
    """Eq. 8: batch-mean negative log-likelihood under the adjusted softmax."""
    return F.nll_loss(adjusted_log_softmax(logits, log_pi, temperature), targets)


def asd_loss(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    targets: torch.Tensor,
    log_pi: torch.Tensor,
    temperature: float,
    teacher_filter: str = "adjusted",
) -> torch.Tensor:
    """Eq. 1: ``KL(p_teacher || p_student)`` summed over the samples the teacher classifies
    correctly, divided by the batch size; no gradient flows into the teacher.

    "Correct" is the argmax of the adjusted softmax (``teacher_filter="adjusted"``, the released
    code) or of the raw logits (``"raw"``, the model's own prediction, as at test time)."""
    log_t = adjusted_log_softmax(teacher_logits.detach(), log_pi, temperature)
    log_s = adjusted_log_softmax(student_logits, log_pi, temperature)
    judged = log_t if teacher_filter == "adjusted" else teacher_logits.detach()
    correct = (judged.argmax(dim=1) == targets).to(log_s.dtype)
    kl = (log_t.exp() * (log_t - log_s)).sum(dim=1)
    return (kl * correct).sum() / targets.shape[0]


def effective_numbers(features: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """Eq. 5's per-batch term ``1 / (a R_cb a^T)`` for every class (0 where absent), capped at
    the class's sample count in the batch."""
    num_classes = prototypes.shape[0]
    units = F.normalize(features - prototypes[labels], dim=1)
    sums = torch.zeros_like(prototypes).index_add_(0, labels, units)
    m = torch.bincount(labels, minlength=num_classes).to(features.dtype)
    quad = sums.pow(2).sum(dim=1) / m.clamp_min(1).pow(2)  # a R a^T = ||mean of unit vectors||^2
    quad = torch.maximum(quad, 1.0 / m.clamp_min(1))
    return torch.where(m > 0, 1.0 / quad, torch.zeros_like(quad))


def estimate_prior(batches: list[tuple[torch.Tensor, torch.Tensor]], num_classes: int) -> torch.Tensor | None:
    """``pi_k`` (float32, sums to 1) from one round's (features, labels) batches; None without data.

    The prototypes are the class means of all the round's features (Eq. 4's ``mu_c``).
    """
    if not batches:
        return None
    features = torch.cat([f for f, _ in batches]).double()
    labels = torch.cat([y for _, y in batches])
    counts = torch.bincount(labels, minlength=num_classes).double()
    prototypes = torch.zeros(num_classes, features.shape[1], dtype=features.dtype, device=features.device)
    prototypes.index_add_(0, labels, features).div_(counts.clamp_min(1)[:, None])
    effective = sum(effective_numbers(f.double(), y, prototypes) for f, y in batches)
    return (effective / effective.sum()).float()


def fuse_priors(global_prior: torch.Tensor, local_prior: torch.Tensor, gamma: float) -> torch.Tensor:
    """Eq. 6: ``pi_mix = (1 - gamma) pi_g + gamma pi_k``."""
    return (1.0 - gamma) * global_prior + gamma * local_prior


def label_distribution(counts: torch.Tensor) -> torch.Tensor:
    counts = counts.double()
    return (counts / counts.sum().clamp_min(1)).float()


# ---- server -----------------------------------------------------------------------------------
class FedYoYoServer(FedAvgServer):
    """FedAvg of the models plus FedAvg of the client priors into ``pi_g``."""

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        if ctx.config.data.augment != "none":
            raise ConfigError(
                f"fedyoyo builds its own weak and strong views; remove data.augment={ctx.config.data.augment}"
            )
        self.global_prior = torch.full((ctx.num_classes,), 1.0 / ctx.num_classes)
        #: client id -> (latest uploaded prior, its sample count)
        self.client_priors: dict[int, tuple[torch.Tensor, int]] = {}

    def _needs_global_counts(self) -> bool:
        a = self.args
        return a.dla and (a.prior_source == "counts" or a.prior_diagnostic)

    def receive(self, query, replies):
        super().receive(query, replies)
        if self.args.prior_source == "counts":
            self.global_prior = label_distribution(self.global_counts)

    def asd_weight(self, rnd: int) -> float:
        """``lambda_r``: linear warm-up over the first ``warmup * fl.rounds`` rounds."""
        a = self.args
        if not a.asd:
            return 0.0
        span = a.warmup * self.ctx.config.fl.rounds
        return a.lam * min(1.0, rnd / span) if span > 0 else a.lam

    def fit_message(self, rnd: int, cid: int) -> Message:
        payload: dict[str, Any] = {"asd_weight": self.asd_weight(rnd)}
        if self.args.dla:
            payload["global_prior"] = self.global_prior.clone()
        return Message(weights=clone_state(self.model), payload=payload)

    def aggregate(self, rnd, replies):
        super().aggregate(rnd, replies)
        fresh = {cid: (r.payload["prior"], r.num_samples) for cid, r in replies.items()
                 if "prior" in r.payload and r.num_samples > 0}
        if not self.args.prior_memory:
            self.client_priors.clear()
        self.client_priors.update(fresh)
        if self.client_priors:  # otherwise keep the previous pi_g (uniform before any report)
            self.global_prior = weighted_mean_prior(self.client_priors.values())

    def metrics(self) -> dict[str, float]:
        if not (self.args.prior_diagnostic and self.global_counts is not None):
            return {}
        diff = self.global_prior.double() - label_distribution(self.global_counts.cpu()).double()
        return {"prior_tv": float(0.5 * diff.abs().sum()), "prior_l2": float(diff.norm())}

    def state_dict(self):
        return {**super().state_dict(), "global_prior": self.global_prior, "client_priors": self.client_priors}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.global_prior = state["global_prior"]
        self.client_priors = state["client_priors"]


def weighted_mean_prior(entries) -> torch.Tensor:
    """Sample-weighted mean of ``(prior, num_samples)`` pairs, the server's ``pi_g``."""
    entries = list(entries)
    total = sum(n for _, n in entries)
    return sum(p.double().cpu() * n for p, n in entries).div(total).float()


# ---- client -----------------------------------------------------------------------------------
class FedYoYoClient(FedAvgClient):
    def round_prior(self, ctx: ClientContext, msg: Message) -> torch.Tensor:
        """``pi_mix`` for this round, fused once before training (uniform when DLA is off)."""
        num_classes = ctx.data.num_classes
        if not self.args.dla:
            return torch.full((num_classes,), 1.0 / num_classes)
        local = ctx.state.get("prior") if self.args.prior_source == "estimated" else None
        if local is None:
            local = label_distribution(ctx.data.class_counts().cpu())
        return fuse_priors(msg.payload["global_prior"].cpu(), local.cpu(), self.args.gamma)

    def view(self, name: str):
        """The weak view, or the strong view at the configured magnitude and Cutout size."""
        if name == "weak":
            return weak_view
        return partial(strong_view, magnitude=self.args.strong_magnitude, cutout_frac=self.args.cutout)

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        a = self.args
        ctx.model.load_state_dict(msg.weights, strict=False)
        device = ctx.data.images.device
        log_pi = log_prior(self.round_prior(ctx, msg)).to(device)
        weight = float(msg.payload["asd_weight"])
        estimate = a.dla and a.prior_source == "estimated"
        teacher, student = (self.view(name) for name in (a.teacher_view, a.student_view))
        standardize, hflip = ctx.data.standardize, ctx.data.hflip
        views_gen = ctx.generator(purpose=2)
        kept: list[tuple[torch.Tensor, torch.Tensor]] = []

        def batch_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            n = y.shape[0]
            both = torch.cat([teacher(x, views_gen, hflip), student(x, views_gen, hflip)])
            features = ctx.model.forward_features(standardize(both))
            logits = ctx.model.forward_head(features)
            loss = dla_loss(logits, torch.cat([y, y]), log_pi, a.temperature)
            if weight > 0:
                loss = loss + weight * asd_loss(logits[:n], logits[n:], y, log_pi, a.temperature, a.teacher_filter)
            if estimate:
                kept.append((features[:n].detach().float(), y))
            return loss

        # the views are built here from [0, 1] images, so the shared loop must not augment or standardise
        raw = replace(ctx, data=replace(ctx.data, augment=None, standardize=lambda x: x))
        metrics = train_local(raw, batch_loss)
        payload = {}
        prior = estimate_prior(kept, ctx.data.num_classes) if estimate else None
        if prior is not None:
            ctx.state["prior"] = prior.cpu()
            payload["prior"] = prior.cpu()
        return Reply(weights=clone_state(ctx.model), num_samples=len(ctx.data), payload=payload, metrics=metrics)
