"""FedYoYo (2025): augmented self-bootstrap distillation (ASD) and distribution-aware logit
adjustment (DLA), aggregated with FedAvg.

Every local batch is seen twice, as a weak view (crop, flip, rotation) and a strong view (crop,
flip, AutoAugment as the paper's reference [4] and the released code: its SVHN policy on SVHN, its
CIFAR-10 policy elsewhere; or RandAugment; then Cutout); both go through the model in one forward
pass. Crops pad an eighth of the image side (4 px on 32 px, as released); flips follow
``data.hflip``. The local loss is (Eq. 9)

    L = L_DLA + lambda_r * L_ASD.

- **DLA** (Eq. 7-8): cross-entropy of the distribution-fused balanced softmax
  ``p(y|x) ~ pi_mix[y] * exp(f_y(x) / T)`` on both views. ``pi_mix = (1 - gamma) pi_g +
  gamma pi_k`` (Eq. 6) fuses the server's estimate of the global prior ``pi_g`` with the
  client's own prior ``pi_k``. Default (``ce_prior_scale=1.5``, the released code): the CE is
  on ``f(x) + 1.5 log pi`` instead, without dividing by T.
- **ASD** (Eq. 1): ``KL(p(teacher view) || p(student view))`` with the same adjusted softmax,
  the teacher detached, summed over the samples whose teacher prediction (argmax of the adjusted
  softmax) is the label, divided by the number of those samples (the released code; Eq. 1 divides
  by the batch size, ``1/n_k``, which at the same lambda distils less: ``asd_average=batch``).
- **Effective prior** (Eq. 3-5): before training, the received model in eval mode embeds the
  client's un-augmented images in shuffled batches of the training size (the released code; the
  text's "during training" features of the teacher view: ``prior_features=train``);
  per class ``c`` and batch ``b``, the correlation matrix ``R_cb`` of the features centred at the
  class prototype (the class mean of those features over the data) gives an effective number
  ``1 / (a R_cb a^T)``, ``a = (1/m, ..., 1/m)``; these are summed over the round's batches and
  normalised into ``pi_k``. ``a R a^T`` is the squared norm of the mean of the unit vectors
  ``(h_i - mu_c) / ||h_i - mu_c||``, so no ``m x m`` matrix is formed. Many samples, and samples
  that point in different directions, give a large effective number; near-duplicates count
  once. The estimate is also this round's ``pi_k``. The client uploads ``pi_k`` with its
  update; the server's ``pi_g`` is the
  sample-weighted mean of the client priors (FedAvg of the priors).

Options where the released code (which produced the paper's numbers) departs from the text:

- ``prior=local_remix`` (default): the released code's per-batch re-mix ``prior <- (1 - gamma)
  prior + gamma pi_local`` from ``pi_g`` at the start of each round, so batch ``t`` uses
  ``(1 - gamma)^t pi_g + (1 - (1 - gamma)^t) pi_local`` with ``pi_local`` the client's label
  distribution: batch 1 is Eq. 6, and within a round the prior moves to the client's own
  distribution (nothing new leaves the client). ``fused_estimate``: Eq. 6 fused ONCE per round,
  before training, from the ``pi_g`` just received and the client's latest estimate ``pi_k``.
- ``ce_prior_scale`` (default 1.5, the released code): DLA's CE on ``f(x) + s log pi``;
  ``null``: Eq. 7's ``f(x) / T + log pi``. ASD always uses Eq. 7's softmax.
- ``prior_features``: ``clean_eval`` (default, the released code: the received model in eval
  mode on the un-augmented images, in shuffled batches of the training size, before training;
  this estimate is then also this round's ``pi_k``) or ``train`` (Eq. 5's "during training": the
  teacher view's features of the round's training, used from the client's next participation).
- ``asd_average``: ``correct`` (default, the released code's ``batchmean`` over the teaching
  samples) or ``batch`` (Eq. 1's ``1 / n_k``).
- ``view_interpolation``: how both views' rotations, shears and translations resample; the
  paper is silent. ``released`` (default) is the code that produced the paper's numbers
  (torchvision's ``RandomRotation`` and PIL's rotate and translate: nearest; its AutoAugment
  shear: bicubic); ``bilinear`` (the earlier default) blurs every training image; ``nearest``
  (torchvision's default for every op) and ``bicubic`` apply one mode to all.

Choices where the paper is silent:

- Before any estimate exists: ``pi_g`` is uniform until the first clients have reported (round
  1 then trains with ``(1 - gamma) * uniform + gamma * pi_k`` under ``prior=fused_estimate``, and
  re-mixes from uniform toward the label distribution under the default ``local_remix``); a client that has not yet
  estimated its prior (first participation) uses its label distribution, which is what the
  effective number reduces to for uncorrelated features. With ``prior_features=train`` each
  estimate is made during a round's training and used from the client's next participation on.
- ``pi_g`` averages the latest prior of every client that has reported so far (weighted by its
  sample count), not only the current round's 40%; ``prior_memory=false`` uses only the round's
  participants.
- An effective number is capped at the class's sample count in the batch (``a R a^T >= 1/m``):
  anti-correlated samples around the prototype would otherwise give arbitrarily large values
  (the released code clamps ``a R a^T`` at 1e-6 and patches outliers afterwards).
- T = 1.5 divides the logits in the KL (and in the CE with ``ce_prior_scale=null``), Eq. 7.
- ``lambda`` (default 4.0, the released script; the paper recommends 3-5.5) ramps linearly from
  0 over the first ``warmup`` fraction of the rounds (released script: 50 of 300 rounds); the
  server sends ``lambda_r`` with the model.
- ``gamma`` (default 0.1, the released script) weights the LOCAL prior, as in Eq. 6 (the text of
  Sec. 3.4 says the opposite; Eq. 6 and the code agree).

Strong view: ``strong_policy`` ``autoaugment`` (default: the paper's [4] and the released code)
with ``autoaugment_policy`` (``auto``, default: AutoAugment's SVHN policy on ``data.dataset=svhn``,
as the released code, its CIFAR-10 policy on every other dataset; or ``cifar10``, ``svhn``; the
server resolves ``auto`` from the dataset's name and sends the policy's name with the model), or
``randaugment`` (2 ops at ``strong_magnitude`` M of 30 bins, torchvision's scale: 9 = 30% of each
op's range; fedlt's earlier strong view, 90%, is about M=27); ``cutout`` (side as a fraction of
the image side, 0.5 = 16px on CIFAR as released). ``teacher_filter`` (which argmax decides that a teacher is correct: the adjusted softmax, as
released, or the raw logits). Early in training the adjusted-correct teachers are almost all
head samples, so ASD then acts as extra head-class cross-entropy on the strong views; on
Fashion-MNIST-LT at 10-25 rounds this collapses the model to the head (README, FedYoYo).

Ablation knobs: Table 4 — ``asd=false``, ``dla=false`` (no prior: the CE on the logits as ``ce_prior_scale`` reads them,
the raw ones by default, and ASD's KL at its temperature), RandAug off = ``student_view=weak`` (two weak views); Table 5 —
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
from pydantic import Field, ValidationInfo, field_validator

from fedlt.data.augment import strong_view, weak_view
from fedlt.losses import log_prior
from fedlt.messages import Message
from fedlt.methods.base import ClientContext, LocalObjective, MethodArgs, ServerContext, broadcast_state
from fedlt.methods.fedavg import FedAvgClient, FedAvgServer
from fedlt.training.sequential import ObjectiveClient, epoch_batches, steps_per_epoch
from fedlt.transfer import to_device


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
    strong_policy: Literal["autoaugment", "randaugment"] = Field(
        "autoaugment", description="strong view: AutoAugment (paper, released code; its policy: autoaugment_policy) "
        "or RandAugment"
    )
    autoaugment_policy: Literal["auto", "cifar10", "svhn"] = Field(
        "auto", description="AutoAugment policy of the strong view (strong_policy=autoaugment): the one found on "
        "CIFAR-10 or on SVHN; auto = svhn on data.dataset=svhn (the released code), cifar10 on every other dataset"
    )
    strong_magnitude: float = Field(
        9.0, ge=0, le=30, description="RandAugment magnitude M of 30 bins (strong_policy=randaugment); 0: none"
    )
    cutout: float = Field(0.5, ge=0, le=1, description="Cutout square side as a fraction of the image side; 0: off")
    view_interpolation: Literal["bilinear", "nearest", "bicubic", "released"] = Field(
        "released", description="resampling of both views' rotations, shears and translations: released = nearest, "
        "bicubic shears (the released code's torchvision/PIL defaults), or one mode for all"
    )
    teacher_filter: Literal["adjusted", "raw"] = Field(
        "adjusted", description="a teacher is correct by the argmax of the adjusted softmax, or of the raw logits"
    )
    prior: Literal["local_remix", "fused_estimate"] = Field(
        "local_remix", description="per-batch re-mix towards the local label distribution (released code), or Eq. 6 once"
    )
    prior_features: Literal["train", "clean_eval"] = Field(
        "clean_eval", description="estimate pi_k from the teacher view's training features, or clean eval-mode features"
    )
    asd_average: Literal["batch", "correct"] = Field(
        "correct", description="ASD divided by the batch size (Eq. 1) or by the number of teaching samples (released)"
    )
    ce_prior_scale: float | None = Field(
        1.5, ge=0, description="DLA's CE on logits + s log(prior) (released: 1.5); null: logits / T + log(prior)"
    )
    prior_source: Literal["estimated", "counts"] = Field(
        "estimated", description="estimated effective priors, or the true label counts (NOT private; Fig. 6)"
    )
    prior_memory: bool = Field(True, description="pi_g averages every client's latest prior; false: this round's only")
    prior_diagnostic: bool = Field(
        False, description="server learns the true label counts (NOT private) and reports its prior's distance to them"
    )

    @field_validator("strong_magnitude")
    @classmethod
    def _magnitude_needs_randaugment(cls, value: float, info: ValidationInfo) -> float:
        """Runs only when set: a magnitude under AutoAugment (which has its own) is a mistake."""
        if info.data.get("strong_policy") == "autoaugment":
            raise ValueError("applies to strong_policy=randaugment only (AutoAugment has its own magnitudes)")
        return value

    @field_validator("autoaugment_policy")
    @classmethod
    def _policy_needs_autoaugment(cls, value: str, info: ValidationInfo) -> str:
        """Runs only when set: a named AutoAugment policy under RandAugment is a mistake."""
        if value != "auto" and info.data.get("strong_policy") == "randaugment":
            raise ValueError("applies to strong_policy=autoaugment only")
        return value

    def unread_when(self) -> list[tuple[tuple[str, ...], str]]:
        if not self.asd:
            return [(("lam", "warmup", "asd_average", "teacher_filter"), "with asd=false (they shape ASD's term)")]
        return []

    def uses_autoaugment(self) -> bool:
        """Whether a view of ASD's pair is the strong one and it applies AutoAugment."""
        return self.strong_policy == "autoaugment" and "strong" in (self.teacher_view, self.student_view)


def autoaugment_policy_for(choice: str, dataset: str | None) -> str:
    """The AutoAugment policy (a key of :data:`fedlt.data.autoaugment.AUTOAUGMENT_POLICIES`) of the
    strong view: ``choice``, or under ``auto`` SVHN's on ``dataset`` ``svhn`` (the released code) and
    CIFAR-10's on any other (``None``: not known)."""
    if choice != "auto":
        return choice
    return "svhn" if dataset == "svhn" else "cifar10"


# ---- the math -------------------------------------------------------------------------------
def adjusted_log_softmax(logits: torch.Tensor, log_pi: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log p(y|x)`` of the distribution-fused balanced softmax (Eq. 7)."""
    return F.log_softmax(logits / temperature + log_pi.to(logits.dtype), dim=1)


def dla_loss(
    logits: torch.Tensor, targets: torch.Tensor, log_pi: torch.Tensor, temperature: float,
    prior_scale: float | None = None,
) -> torch.Tensor:
    """Eq. 8: batch-mean cross-entropy of the adjusted softmax: Eq. 7's ``f / T + log pi``, or
    with ``prior_scale`` s the released code's ``f + s log pi``."""
    if prior_scale is None:
        return F.nll_loss(adjusted_log_softmax(logits, log_pi, temperature), targets)
    return F.cross_entropy(logits + prior_scale * log_pi.to(logits.dtype), targets)


def asd_loss(
    teacher_logits: torch.Tensor,
    student_logits: torch.Tensor,
    targets: torch.Tensor,
    log_pi: torch.Tensor,
    temperature: float,
    teacher_filter: str = "adjusted",
    average: str = "batch",
) -> torch.Tensor:
    """Eq. 1: ``KL(p_teacher || p_student)`` summed over the samples the teacher classifies
    correctly, divided by the batch size (``average="batch"``) or by the number of those
    samples (``"correct"``, the released code); no gradient flows into the teacher.

    "Correct" is the argmax of the adjusted softmax (``teacher_filter="adjusted"``, the released
    code) or of the raw logits (``"raw"``, the model's own prediction, as at test time)."""
    log_t = adjusted_log_softmax(teacher_logits.detach(), log_pi, temperature)
    log_s = adjusted_log_softmax(student_logits, log_pi, temperature)
    judged = log_t if teacher_filter == "adjusted" else teacher_logits.detach()
    correct = (judged.argmax(dim=1) == targets).to(log_s.dtype)
    kl = (log_t.exp() * (log_t - log_s)).sum(dim=1)
    count = correct.sum().clamp_min(1) if average == "correct" else targets.shape[0]
    return (kl * correct).sum() / count


def yoyo_loss(
    model, x: torch.Tensor, y: torch.Tensor, *, log_pi: torch.Tensor, asd_weight: torch.Tensor, distill: bool,
    keep_features: bool, temperature: float, prior_scale: float | None, teacher_filter: str, average: str,
):
    """Eq. 9 on a batch whose first half is the teacher view and second half the student view of the
    ``y.shape[0]`` images: DLA on both, plus ``asd_weight`` x ASD when ``distill``. With
    ``keep_features``, also the teacher view's features (float32, detached) for the prior estimate."""
    n = y.shape[0]
    features = model.forward_features(x)
    logits = model.forward_head(features)
    loss = dla_loss(logits, torch.cat([y, y]), log_pi, temperature, prior_scale)
    if distill:
        loss = loss + asd_weight * asd_loss(logits[:n], logits[n:], y, log_pi, temperature, teacher_filter, average)
    return (loss, features[:n].detach().float()) if keep_features else loss


def effective_numbers(features: torch.Tensor, labels: torch.Tensor, prototypes: torch.Tensor) -> torch.Tensor:
    """Eq. 5's per-batch term ``1 / (a R_cb a^T)`` for every class (0 where absent), capped at
    the class's sample count in the batch."""
    num_classes = prototypes.shape[0]
    units = F.normalize(features - prototypes[labels], dim=1)
    sums = torch.zeros_like(prototypes).index_add_(0, labels, units)
    m = torch.zeros(num_classes, dtype=features.dtype, device=features.device).index_add_(
        0, labels, torch.ones_like(labels, dtype=features.dtype))  # bincount would wait for the device
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
    counts = torch.zeros(num_classes, dtype=torch.float64, device=labels.device).index_add_(
        0, labels, torch.ones_like(labels, dtype=torch.float64))  # bincount's size would wait for the device
    prototypes = torch.zeros(num_classes, features.shape[1], dtype=features.dtype, device=features.device)
    prototypes.index_add_(0, labels, features).div_(counts.clamp_min(1)[:, None])
    effective = sum(effective_numbers(f.double(), y, prototypes) for f, y in batches)
    return (effective / effective.sum()).float()


def fuse_priors(global_prior: torch.Tensor, local_prior: torch.Tensor, gamma: float) -> torch.Tensor:
    """Eq. 6: ``pi_mix = (1 - gamma) pi_g + gamma pi_k``."""
    return (1.0 - gamma) * global_prior + gamma * local_prior


def remixed_prior(start: torch.Tensor, local: torch.Tensor, gamma: float, step: int) -> torch.Tensor:
    """The released code's per-batch re-mix ``prior <- (1 - gamma) prior + gamma local`` after
    ``step`` batches from ``start``, in closed form; step 1 is Eq. 6."""
    keep = (1.0 - gamma) ** step
    return keep * start + (1.0 - keep) * local


def label_distribution(counts: torch.Tensor) -> torch.Tensor:
    counts = counts.double()
    return (counts / counts.sum().clamp_min(1)).float()


# ---- server -----------------------------------------------------------------------------------
class FedYoYoServer(FedAvgServer):
    """FedAvg of the models plus FedAvg of the client priors into ``pi_g``."""

    @classmethod
    def config_refusal(cls, config, args):
        if config.data.augment != "none":
            return (f"method fedyoyo + data.augment={config.data.augment}: fedyoyo builds its own weak and strong "
                    f"views; remove data.augment={config.data.augment}")
        return None

    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        self.global_prior = torch.full((ctx.num_classes,), 1.0 / ctx.num_classes)
        #: the strong view's AutoAugment policy, resolved from the run's dataset and sent to the clients
        self.autoaugment_policy = autoaugment_policy_for(self.args.autoaugment_policy, ctx.config.data.dataset)
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
        if self.args.uses_autoaugment():  # the clients do not know the dataset's name
            payload["autoaugment_policy"] = self.autoaugment_policy
        return Message(weights=broadcast_state(self.model), payload=payload)

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
    return sum(p.to("cpu", torch.float64) * n for p, n in entries).div(total).float()


# ---- client -----------------------------------------------------------------------------------
def clean_features(ctx: ClientContext, generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The model's eval-mode features of the client's un-augmented images, in shuffled batches of
    the training size: the released code's input to the prior estimate (``prior_features=clean_eval``)."""
    ctx.model.eval()
    batches = []
    with torch.no_grad():
        for rows in epoch_batches(len(ctx.data), ctx.train.batch_size, generator):
            x, y = ctx.data.batch(rows)
            batches.append((ctx.model.forward_features(x).float(), y))
    ctx.model.train()
    return batches


class FedYoYoClient(ObjectiveClient, FedAvgClient):
    objective_backends = ("graphed",)
    backend_refusal_why = "its loss reads the features and two views of each image"

    def round_prior(self, ctx: ClientContext, msg: Message) -> torch.Tensor:
        """``pi_mix`` for this round, fused once before training (uniform when DLA is off)."""
        num_classes = ctx.data.num_classes
        if not self.args.dla:
            return torch.full((num_classes,), 1.0 / num_classes)
        local = ctx.state.get("prior") if self.args.prior_source == "estimated" else None
        if local is None:
            local = label_distribution(torch.from_numpy(ctx.data.host_counts()))
        return fuse_priors(msg.payload["global_prior"].to("cpu"), local.to("cpu"), self.args.gamma)

    def prior_schedule(self, ctx: ClientContext, msg: Message):
        """``t -> log prior`` of the round's batch ``t`` (1, 2, ...) on the device: the per-batch
        re-mix towards the label distribution (``local_remix``) or the fixed ``pi_mix``. The re-mixed
        priors of every batch are made before training, so no batch waits for the host."""
        a, device = self.args, ctx.data.images.device
        if a.dla and a.prior == "local_remix":
            start = msg.payload["global_prior"].to("cpu", torch.float32)
            local = label_distribution(torch.from_numpy(ctx.data.host_counts()))
            steps = ctx.train.epochs * steps_per_epoch(len(ctx.data), ctx.train.batch_size)
            # every re-mix is a convex combination of the first and the label distribution: checked once
            table = torch.stack([log_prior(remixed_prior(start, local, a.gamma, t).numpy(), check=t == 1)
                                 for t in range(1, max(steps, 1) + 1)])
            table = to_device(table, device, table.dtype)  # made on the host: copied without a wait
            return lambda t: table[t - 1]
        fixed = log_prior(self.round_prior(ctx, msg).numpy())  # host data: log_prior reads no device
        fixed = to_device(fixed, device, fixed.dtype)
        return lambda t: fixed

    def view(self, name: str, autoaugment_policy: str | None = None):
        """The weak view, or the strong view with the configured policy, magnitude and Cutout; both
        resample by ``view_interpolation``. AutoAugment's policy is ``autoaugment_policy`` (the
        server's, resolved from the dataset) or, without it, ``method_args.autoaugment_policy`` with
        ``auto`` read as ``cifar10``."""
        a = self.args
        if name == "weak":
            return partial(weak_view, interpolation=a.view_interpolation)
        return partial(strong_view, policy=a.strong_policy, magnitude=a.strong_magnitude, cutout_frac=a.cutout,
                       interpolation=a.view_interpolation,
                       autoaugment_policy=autoaugment_policy or autoaugment_policy_for(a.autoaugment_policy, None))

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective | None:
        """Eq. 9 as a loss of the model on both views of a batch: the views are the step's input (made
        outside it from the client's own generator), the re-mixed log-prior a tensor written per step,
        the teacher view's features kept for the round's prior estimate; lambda_r is a tensor, so
        captured steps outlive its warm-up. None for a client without data."""
        if len(ctx.data) == 0:
            return None
        a, num_classes = self.args, ctx.data.num_classes
        estimate = a.dla and a.prior_source == "estimated"
        payload: dict[str, Any] = {}
        fresh = None  # clean_eval: made before training, this round's pi_k, sent (and kept) when the round ends
        if estimate and a.prior_features == "clean_eval":
            ctx.model.load_state_dict(msg.weights, strict=False)
            fresh = estimate_prior(clean_features(ctx, ctx.generator(purpose=3)), num_classes)
            if a.prior == "fused_estimate":  # this round's pi_mix fuses it: the host reads it now
                ctx.state["prior"] = fresh = fresh.cpu()
        log_prior_at = self.prior_schedule(ctx, msg)
        weight = float(msg.payload["asd_weight"])
        keep_features = estimate and a.prior_features == "train"
        loss = partial(yoyo_loss, log_pi=log_prior_at(1), asd_weight=torch.full((), weight, device=ctx.data.images.device),
                       distill=weight > 0, keep_features=keep_features, temperature=a.temperature,
                       prior_scale=a.ce_prior_scale, teacher_filter=a.teacher_filter, average=a.asd_average)
        teacher, student = (self.view(name, msg.payload.get("autoaugment_policy"))
                            for name in (a.teacher_view, a.student_view))
        views_gen, data = ctx.generator(purpose=2), ctx.data
        unscaled = replace(data, augment=None, standardize=lambda x: x)  # the views start from [0, 1] images

        def views(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            x, y = unscaled.batch(rows)
            return data.standardize(torch.cat([teacher(x, views_gen, data.hflip), student(x, views_gen, data.hflip)])), y

        kept: list[tuple[torch.Tensor, torch.Tensor]] = []

        def finish(state: dict[str, torch.Tensor], extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            made = estimate_prior(kept, num_classes) if kept else fresh
            if made is not None:
                ctx.state["prior"] = payload["prior"] = made.cpu()
            return state

        remix = a.dla and a.prior == "local_remix"
        return LocalObjective(loss, on_model=True, payload=payload, finish=finish, batch=views,
                              step_tensors=(lambda t: {"log_pi": log_prior_at(t)}) if remix else None,
                              keep=(lambda features, y: kept.append((features, y))) if keep_features else None)
