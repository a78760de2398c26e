"""Server-side classifier calibrations: new heads for a federated backbone.

Each calibrator turns what clients may share — per-class gradients (CReFF), per-class feature
sums (CCVR, FedNCM, Fed3R), nothing (tau-norm), or real features (the non-private oracle) —
into a classifier head. They are wired into any method by :mod:`fedlt.calibration.wrapper`.
"""

from __future__ import annotations

import math
import time
from typing import Any, ClassVar, Literal

import torch
from pydantic import Field, model_validator
from torch import nn

from fedlt.calibration.math import creff, safs
from fedlt.calibration.math.classifiers import ncm_classifier, ridge_classifier, tau_normalize
from fedlt.calibration.math.retrain import linear_init, retrain_linear
from fedlt.calibration.math.rff import rff_frequencies
from fedlt.calibration.math.stats import class_moments
from fedlt.calibration.math.virtual import sample_class_gaussians
from fedlt.config import FLOAT32_MAX
from fedlt.errors import ConfigError
from fedlt.messages import Payload, Reply
from fedlt.methods.base import MethodArgs, ModelHead, ServerContext
from fedlt.plugins import PluginRegistry

#: statistics a calibrator can ask every client for after training
STAT_KINDS = ("class_sums", "normalized_sums", "ridge_sums", "features", "rff_sums")


class CalibrationArgs(MethodArgs):
    """Knobs of every calibration (``calibration_args.*``), defaults from the papers."""

    creff_features_per_class: int = Field(100, ge=1, description="CReFF m: federated features per class")
    creff_feature_steps: int = Field(100, ge=1, description="CReFF I: feature-optimisation steps per round")
    creff_retrain_steps: int = Field(300, ge=1, description="CReFF J: classifier re-training steps (or epochs) per round")
    creff_retrain_unit: Literal["steps", "epochs"] = Field(
        "steps", description="CReFF: J counts mini-batch steps (paper text) or epochs over the federated features "
        "(Algorithm 1 and the released code, which pairs it with creff_retrain_lr=0.01)")
    creff_feature_lr: float = Field(0.1, gt=0, description="CReFF: SGD lr of the federated features on the row-summed "
                                    "matching loss (paper and code: 0.1)")
    creff_matching_bias: Literal["released", "row", "weights"] = Field(
        "released", description="CReFF: the bias gradient in Eq. 6: one extra cosine next to the C weight rows (the "
        "released code, whose lr the default step reproduces), one more column of every row (fedlt before), or left "
        "out (the paper's C x d gradient)")
    creff_retrain_lr: float = Field(0.1, gt=0, description="CReFF: SGD lr of classifier re-training (paper: 0.1)")
    creff_retrain_momentum: float = Field(0.0, ge=0, description="CReFF: momentum of re-training (paper: plain SGD)")
    creff_feature_momentum: float = Field(0.0, ge=0, description="CReFF: momentum of the feature optimiser (paper: "
                                          "plain SGD; the released code: 0; 0.5 was fedlt's earlier default, the "
                                          "gradient-matching optimiser of Zhao et al. 2021)")
    retrain_steps: int = Field(300, ge=1, description="CCVR / oracle: classifier re-training steps")
    retrain_lr: float = Field(0.1, gt=0, description="CCVR / oracle: re-training lr")
    retrain_momentum: float = Field(0.9, ge=0, lt=1, description="CCVR / oracle: re-training SGD momentum (SFD's "
                                    "CCVR: lr 0.01 with momentum 0.9)")
    retrain_batch_size: int = Field(32, ge=1, description="re-training mini-batch (CReFF, CCVR, oracle)")
    ccvr_virtual_per_class: int = Field(100, ge=1, description="CCVR: virtual features sampled per class")
    fed3r_lambda: float = Field(0.01, gt=0, description="Fed3R: ridge regularisation")
    taunorm_tau: float = Field(1.0, ge=0, description="tau-norm: w_c / ||w_c||^tau")
    oracle_per_class: int = Field(100, ge=1, description="oracle: real features per class (sampled with replacement)")
    safs_rff_dim: int = Field(1000, ge=2, multiple_of=2, description="SAFS: D, random Fourier features (paper 5000, "
                              "code 3000; the synthesis cost is linear in D)")
    safs_rbf_gamma: float = Field(0.01, gt=0, description="SAFS: RBF kernel gamma of the MMD")
    safs_max_per_class: int | None = Field(None, ge=2, description="SAFS: synthetic features of the rarest class "
                                           "(default: the paper's 2000 on its 512-d ResNet-18, scaled to the feature "
                                           "dim: 500 for d=128)")
    safs_min_per_class: int | None = Field(None, ge=2, description="SAFS: synthetic features of the most frequent "
                                           "class (default: the paper's 600 scaled to the feature dim: 150 for d=128)")
    safs_steps: int = Field(100, ge=0, description="SAFS: T, optimisation steps of each class's memory bank")
    safs_lr: float = Field(1.0, gt=0, description="SAFS: SGD lr of the memory bank (momentum 0.9, cosine to 0)")
    safs_eps: float = Field(1e-5, gt=0, description="SAFS: diagonal added to both covariances before Cholesky")
    safs_aligner: bool = Field(True, description="SAFS: MeanCov Aligner (false: the 'w/o MeanCov Aligner' ablation)")
    safs_mmd: bool = Field(True, description="SAFS: L_MMD in the synthesis loss (false: 'w/o L_MMD')")
    safs_arr: bool = Field(True, description="SAFS: L_ARR in the synthesis loss (false: 'w/o L_ARR')")
    safs_finetune_epochs: int = Field(100, ge=0, description="SAFS: epochs of classifier fine-tuning on the synthetic features")
    safs_finetune_batch_size: int = Field(64, ge=1, description="SAFS: fine-tuning mini-batch")
    safs_finetune_lr: float = Field(0.01, gt=0, description="SAFS: fine-tuning SGD lr (momentum 0.9)")
    safs_finetune_weight_decay: float = Field(1e-5, ge=0, description="SAFS: fine-tuning weight decay")

    @model_validator(mode="after")
    def _safs_counts_ordered(self) -> "CalibrationArgs":
        if None not in (self.safs_min_per_class, self.safs_max_per_class) and \
                self.safs_min_per_class > self.safs_max_per_class:
            raise ValueError(f"safs_min_per_class={self.safs_min_per_class} exceeds safs_max_per_class="
                             f"{self.safs_max_per_class}; the rarest class gets the most synthetic features")
        return self


def linear_head(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """A linear head holding ``weight`` (classes x features) and ``bias``: what a calibrator's
    :meth:`Calibrator.finish` stores in ``self._head``."""
    head = nn.Linear(weight.shape[1], weight.shape[0]).to(weight.device)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.copy_(bias)
    return head


class L2Normalize(nn.Module):
    """Unit-norm features: FedNCM compares cosine similarity to normalised class means."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.normalize(x, dim=1)


class Calibrator:
    """One calibration: what it asks of clients and how it builds a head."""

    name: ClassVar[str]
    #: False when clients must reveal more than the method's paper allows (the oracle)
    private: ClassVar[bool] = True
    #: statistics it needs from every client after training (see STAT_KINDS)
    needs: ClassVar[frozenset[str]] = frozenset()
    #: whether :meth:`on_fit_replies` reads each client's reply (then fit cannot be aggregated securely)
    reads_fit_replies: ClassVar[bool] = False
    #: the head it works on: ``new``, a linear head it builds over the backbone's feature (from the
    #: statistics in ``needs`` or the fit replies; re-training starts from the model's learned
    #: linear head where there is one); ``learned_linear``, the model's learned linear head itself
    acts_on: ClassVar[Literal["new", "learned_linear"]] = "new"
    #: whether it works on an ensemble's combined head: averaging linear experts' logits is one
    #: linear map over their features side by side, so a head over that feature replaces them all
    ensembles: ClassVar[bool] = True
    #: the shared knobs it reads (those of ``calibration_args`` not named ``<calibration>_...``); None:
    #: any of them (a plug-in's, which does not say)
    shared_knobs: ClassVar[frozenset[str] | None] = None

    @classmethod
    def refusal(cls, method: str, head: ModelHead) -> str | None:
        """Why this calibration has no meaning on ``method``'s declared head; None when it has one."""
        if cls.acts_on == "learned_linear" and head.linear is None:
            return f"{cls.name} works on the model's learned linear head, and {method}'s model has {head.what}"
        if head.experts > 1 and not cls.ensembles:
            return f"{cls.name} works on a single head, and {method}'s model has {head.what}"
        return None

    def __init__(self, args: CalibrationArgs, ctx: ServerContext):
        self.args, self.ctx = args, ctx
        self.num_classes = ctx.num_classes
        self._head: nn.Module | None = None

    def features_held(self, dim: int) -> tuple[int, str] | None:
        """How many feature rows of width ``dim`` :meth:`finish` builds at once (virtual, synthetic or
        sampled real ones), and the knob that sizes them; None when it builds none. The run refuses,
        before its first round, rows that the machine cannot hold."""
        return None

    def head(self) -> nn.Module | None:
        """The calibrated head, once there is one."""
        return self._head

    def fit_payload(self, rnd: int) -> Payload:
        """Extra payload of every fit message (CReFF's re-trained classifier)."""
        return {}

    def stats_payload(self) -> Payload:
        """Extra payload of the statistics query (SAFS's random-feature seed)."""
        return {}

    def on_fit_replies(self, rnd: int, replies: dict[int, Reply]) -> None:
        """Read this calibrator's part of the fit replies."""

    def end_round(self, rnd: int, model) -> None:
        """Per-round server step after aggregation."""

    def metrics(self) -> dict[str, float]:
        """Diagnostics for the round's metrics line."""
        return {}

    def finish(self, stats: dict[str, Any], head: nn.Linear | None) -> None:
        """Post-training step from the merged client statistics; ``head`` is the model's learned
        linear head (:attr:`ModelHead.linear`), None when it has none. It stores the calibrated head in
        ``self._head`` (what :meth:`head` returns, and the run evaluates) and returns None."""

    def artifacts(self) -> dict[str, torch.Tensor]:
        """Tensors for the report (e.g. synthetic features); none by default."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        return {"head": self._head.state_dict() if self._head is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["head"] is not None:
            head = self._build_empty_head()
            head.load_state_dict(state["head"])
            self._head = head

    def _build_empty_head(self) -> nn.Module:
        return nn.Linear(self.ctx.model.feature_dim, self.num_classes).to(self.ctx.device)

    def _retrain_from(self, head: nn.Linear | None, feats, labels, generator) -> nn.Linear:
        """A linear head re-trained on (features, labels), from the learned ``head`` (fresh without one)."""
        a, device = self.args, self.ctx.device
        init = weight_and_bias(head) if head is not None else None
        weight, bias = retrain_linear(feats.to(device).float(), labels.to(device), self.num_classes, init=init,
                                      steps=a.retrain_steps, lr=a.retrain_lr, batch_size=a.retrain_batch_size,
                                      momentum=a.retrain_momentum, generator=generator)
        return linear_head(weight, bias)


class CReFF(Calibrator):
    """CReFF (Shang et al. IJCAI 2022): federated features matched to the clients' real-feature
    gradients (Eq. 3-6), a new classifier re-trained on them every round (Eq. 7)."""

    name = "creff"
    reads_fit_replies = True
    shared_knobs = frozenset({"retrain_batch_size"})

    def __init__(self, args, ctx):
        super().__init__(args, ctx)
        d, c = ctx.model.feature_dim, self.num_classes
        if args.creff_feature_lr * c > FLOAT32_MAX:  # the knob passed its own float32 check, the step does not
            raise ConfigError(f"CReFF's feature step calibration_args.creff_feature_lr x {c} classes = "
                              f"{args.creff_feature_lr * c:.4g} is past the 32-bit floats training computes in (at "
                              f"most {FLOAT32_MAX:.4g}); lower creff_feature_lr")
        # Eq. 6 averages over the C classifier rows; the released code sums them, and only that
        # step size (lr 0.1 on the sum = lr 0.1*C on Eq. 6) moves the features enough in I=100 steps.
        self.features = creff.FederatedFeatures(c, args.creff_features_per_class, d, ctx.generator(0, purpose=31),
                                                feature_lr=args.creff_feature_lr * c,
                                                momentum=args.creff_feature_momentum, device=ctx.device)
        # v-hat^t, the re-trained classifier sent with round t (round 1: a fresh one)
        self.retrained = linear_head(*linear_init(d, c, ctx.generator(0, purpose=32)))
        self.g_agg: torch.Tensor | None = None
        self.matching_loss: float | None = None
        self.present: torch.Tensor | None = None

    def fit_payload(self, rnd: int) -> Payload:
        return {"creff/weight": self.retrained.weight.detach().clone(), "creff/bias": self.retrained.bias.detach().clone()}

    def on_fit_replies(self, rnd: int, replies: dict[int, Reply]) -> None:
        parts = [(r.payload["creff/classes"], r.payload["creff/grads"]) for r in replies.values()
                 if "creff/grads" in r.payload]
        self.g_agg, self.present = creff.aggregate_held_gradients(
            ((classes.to(self.ctx.device), grads.to(self.ctx.device)) for classes, grads in parts),
            self.num_classes) if parts else (None, None)

    def end_round(self, rnd: int, model) -> None:
        if self.g_agg is None or not bool(self.present.any()):  # no sampled client held any data
            self.matching_loss = None
            return
        w, b = self.retrained.weight.detach(), self.retrained.bias.detach()
        self.matching_loss = self.features.match(w, b, self.g_agg, self.present, self.args.creff_feature_steps,
                                                 self.args.creff_matching_bias)
        feats, labels = self.features.features_and_labels()
        weight, bias = retrain_linear(
            feats.detach(), labels, self.num_classes, init=None, steps=self.retrain_steps(len(labels)),
            lr=self.args.creff_retrain_lr, momentum=self.args.creff_retrain_momentum,
            batch_size=self.args.retrain_batch_size,
            generator=self.ctx.generator(rnd, purpose=33),
        )
        self.retrained = linear_head(weight, bias)
        self._head = self.retrained

    def retrain_steps(self, num_features: int) -> int:
        """SGD steps of the re-training: J, or J epochs of ``ceil(num_features / batch)`` batches."""
        a = self.args
        if a.creff_retrain_unit == "steps":
            return a.creff_retrain_steps
        return a.creff_retrain_steps * -(-num_features // a.retrain_batch_size)

    def metrics(self) -> dict[str, float]:
        return {"creff_matching_loss": self.matching_loss} if self.matching_loss is not None else {}

    def artifacts(self):
        feats, labels = self.features.features_and_labels()
        return {"synthetic_features": feats, "synthetic_labels": labels}

    def state_dict(self):
        return {**super().state_dict(), "features": self.features.state_dict(),
                "retrained": self.retrained.state_dict()}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.features.load_state_dict(state["features"])
        self.retrained.load_state_dict(state["retrained"])


def creff_client_gradients(model, features: torch.Tensor, labels: torch.Tensor, payload: Payload) -> Payload:
    """Client side of CReFF (Eq. 3): per-class mean gradients of CE w.r.t. the received re-trained
    classifier, on features of the received backbone."""
    w = payload["creff/weight"].to(features.device)
    b = payload["creff/bias"].to(features.device)
    classes, grads = creff.held_class_gradients(w, b, features, labels, model.num_classes)
    return {"creff/classes": classes, "creff/grads": grads}  # only the classes it holds


class CCVR(Calibrator):
    """CCVR (Luo et al. NeurIPS 2021): per-class Gaussians from the clients' feature statistics,
    virtual features sampled from them, the classifier re-trained on those."""

    name = "ccvr"
    needs = frozenset({"class_sums"})
    shared_knobs = frozenset({"retrain_steps", "retrain_lr", "retrain_momentum", "retrain_batch_size"})
    #: the virtual features and labels the head was re-trained on (for the report's projection)
    _virtual: tuple[torch.Tensor, torch.Tensor] | None = None

    def features_held(self, dim):
        return self.num_classes * self.args.ccvr_virtual_per_class, "ccvr_virtual_per_class"

    def finish(self, stats, head) -> None:
        mean, cov, count = class_moments(stats["class_sums"])
        present = count > 0
        n = torch.where(present, torch.full_like(count, self.args.ccvr_virtual_per_class), torch.zeros_like(count))
        feats, labels = sample_class_gaussians(mean, cov, n.long(), self.ctx.generator(0, purpose=41))
        self._virtual = (feats, labels)
        self._head = self._retrain_from(head, feats, labels, self.ctx.generator(0, purpose=42))

    def artifacts(self):
        if self._virtual is None:  # before finish(), or resumed after it
            return {}
        return {"synthetic_features": self._virtual[0], "synthetic_labels": self._virtual[1]}


def weight_and_bias(head: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear head's detached weight and bias (zeros for a head without one)."""
    bias = head.bias if head.bias is not None else torch.zeros(head.out_features, device=head.weight.device)
    return head.weight.detach(), bias.detach()


class FedNCM(Calibrator):
    """FedNCM (Legate et al. 2023): nearest class mean of L2-normalised features."""

    name = "fedncm"
    shared_knobs = frozenset()
    needs = frozenset({"normalized_sums"})

    def finish(self, stats, head) -> None:
        sums = stats["normalized_sums"]
        means = sums["sum"] / sums["count"].clamp(min=1).unsqueeze(1)
        weight, bias = ncm_classifier(means.float(), normalize=True)
        self._head = nn.Sequential(L2Normalize(), linear_head(weight.to(self.ctx.device), bias.to(self.ctx.device)))

    def _build_empty_head(self) -> nn.Module:
        return nn.Sequential(L2Normalize(), super()._build_empty_head())


class Fed3R(Calibrator):
    """Fed3R (Fanì et al. 2024): closed-form ridge-regression classifier from summed statistics."""

    name = "fed3r"
    shared_knobs = frozenset()
    needs = frozenset({"ridge_sums"})

    def finish(self, stats, head) -> None:
        sums = stats["ridge_sums"]
        weight, bias = ridge_classifier(sums["gram"], sums["cross"], lam=self.args.fed3r_lambda)
        self._head = linear_head(weight.to(self.ctx.device), bias.to(self.ctx.device))


class TauNorm(Calibrator):
    """tau-norm (Kang et al. ICLR 2020): rescale each class's weight vector by ||w_c||^-tau;
    needs nothing from clients."""

    name = "taunorm"
    shared_knobs = frozenset()
    acts_on = "learned_linear"

    def finish(self, stats, head) -> None:
        self._head = linear_head(*tau_normalize(*weight_and_bias(head), tau=self.args.taunorm_tau))


class RealFeatureOracle(Calibrator):
    """Diagnostic upper bound, NOT private: clients upload real features (a class-balanced sample)
    and the server re-trains the head on them."""

    name = "oracle"
    private = False
    needs = frozenset({"features"})
    shared_knobs = frozenset({"retrain_steps", "retrain_lr", "retrain_momentum", "retrain_batch_size"})

    def features_held(self, dim):
        return self.num_classes * self.args.oracle_per_class, "oracle_per_class"

    def finish(self, stats, head) -> None:
        feats, labels = stats["features"]
        generator = self.ctx.generator(0, purpose=51)
        keep = torch.cat([  # class-balanced: oracle_per_class of every class, with replacement
            idx[torch.randint(idx.numel(), (self.args.oracle_per_class,), generator=generator, device=generator.device)
                .to(idx.device)]
            for idx in (torch.nonzero(labels == c).flatten() for c in labels.unique())
        ])
        self._head = self._retrain_from(head, feats[keep], labels[keep], generator)


def safs_bank_sizes(args: CalibrationArgs, dim: int) -> tuple[int, int]:
    """``M_c`` of the rarest and the most frequent class: the knobs, or the paper's 2000 and 600 for
    its 512-d features scaled by ``dim / 512`` (estimating a d x d covariance takes O(d) samples,
    and the cost of the synthesis is linear in them)."""
    largest = args.safs_max_per_class or max(2, round(2000 * dim / 512))
    smallest = args.safs_min_per_class or max(2, round(600 * dim / 512))
    if args.safs_min_per_class is None or args.safs_max_per_class is None:
        smallest = min(smallest, largest)
        largest = max(smallest, largest)
    return largest, smallest


class SAFS(Calibrator):
    """SFD's SAFS (Zhang et al. KDD 2025, Section 4.3): synthetic features whose mean, covariance
    and mean random Fourier features match the federation's (all from client sums), then the
    learned classifier fine-tuned on them with CE (:mod:`fedlt.calibration.math.safs`)."""

    name = "safs"
    shared_knobs = frozenset()
    needs = frozenset({"class_sums", "rff_sums"})

    def __init__(self, args, ctx):
        super().__init__(args, ctx)
        # the seed r_0 of Algorithm 2: every client draws the same frequencies from it
        self.rff_seed = int(ctx.rng(0, purpose=71).integers(2**31 - 1))
        self.info: dict[str, float] = {}

    def features_held(self, dim):
        return self.num_classes * safs_bank_sizes(self.args, dim)[0], "safs_max_per_class"  # at most the rarest's

    def stats_payload(self) -> Payload:
        return {"rff_seed": self.rff_seed, "rff_dim": self.args.safs_rff_dim, "rff_gamma": self.args.safs_rbf_gamma}

    def finish(self, stats, head) -> None:
        start = time.perf_counter()
        a, device = self.args, self.ctx.device
        mean, cov, count = class_moments(stats["class_sums"])
        rff = stats["rff_sums"]
        rff_mean = rff["sum"] / rff["count"].clamp_min(1.0)[:, None]
        frequencies = rff_frequencies(mean.shape[1], a.safs_rff_dim, a.safs_rbf_gamma, self.rff_seed)
        largest, smallest = safs_bank_sizes(a, mean.shape[1])
        per_class = safs.synthetic_counts(count, largest, smallest)
        options = safs.SynthesisOptions(steps=a.safs_steps, lr=a.safs_lr, eps=a.safs_eps, aligner=a.safs_aligner,
                                        mmd=a.safs_mmd, arr=a.safs_arr)
        feats, labels, losses = safs.synthesize(
            mean.to(device), cov.to(device), rff_mean.to(device), frequencies, per_class,
            self.ctx.generator(0, purpose=72), options,
            done=lambda k, classes: self.ctx.stage_progress(k, classes, "classes synthesized (SAFS)"))
        synthesized = time.perf_counter()
        init = weight_and_bias(head) if head is not None else None  # fine-tune the learned classifier, if any
        steps = a.safs_finetune_epochs * math.ceil(labels.numel() / a.safs_finetune_batch_size)
        weight, bias = retrain_linear(feats, labels, self.num_classes, init=init, steps=steps, lr=a.safs_finetune_lr,
                                      batch_size=a.safs_finetune_batch_size, momentum=0.9,
                                      weight_decay=a.safs_finetune_weight_decay,
                                      generator=self.ctx.generator(0, purpose=73))
        self._head = linear_head(weight, bias)
        done = time.perf_counter()
        self.info = {"safs_synthesis_s": synthesized - start, "safs_finetune_s": done - synthesized,
                     "safs_features": float(labels.numel()),
                     "safs_loss": sum(losses.values()) / len(losses) if losses else float("nan")}


def calibrator_from_plugin(name: str, loaded: object) -> type[Calibrator]:
    """What a ``fedlt.calibrations`` entry point loads: a Calibrator subclass of the same name."""
    if not (isinstance(loaded, type) and issubclass(loaded, Calibrator)):
        what = f"the class {loaded.__name__}" if isinstance(loaded, type) else f"an object of type {type(loaded).__name__}"
        raise TypeError(f"loads {what}, not a subclass of fedlt.calibration.calibrators.Calibrator; "
                        "point the entry point at the calibration's class")
    if unknown := sorted(set(loaded.needs) - set(STAT_KINDS)):
        raise ValueError(f"loads {loaded.__name__}, whose needs name no statistic: {', '.join(unknown)}; use "
                         f"{', '.join(STAT_KINDS)}")
    if getattr(loaded, "name", None) != name:
        raise ValueError(f"loads {loaded.__name__}, whose name is {getattr(loaded, 'name', None)!r}; set "
                         f"{loaded.__name__}.name = '{name}' or name the entry point after it")
    return loaded


CALIBRATORS: PluginRegistry[type[Calibrator]] = PluginRegistry("fedlt.calibrations", "calibration", {
    c.name: c for c in (CReFF, CCVR, FedNCM, Fed3R, TauNorm, RealFeatureOracle, SAFS)
}, calibrator_from_plugin)
CALIBRATION_DESCRIPTIONS = {
    "creff": "CReFF: federated features matched to real-feature gradients, classifier re-trained every round",
    "ccvr": "CCVR: classifier re-trained on virtual features from per-class Gaussians (after training)",
    "fedncm": "FedNCM: nearest-class-mean head from normalised feature means (after training)",
    "fed3r": "Fed3R: closed-form ridge-regression head from summed feature statistics (after training)",
    "taunorm": "tau-norm: per-class weight normalisation of the learned head (after training)",
    "oracle": "NOT PRIVATE diagnostic: head re-trained on a class-balanced sample of real features",
    "safs": "SFD's SAFS: head fine-tuned on synthetic features aligned to mean, covariance and random-feature MMD",
}


def list_calibrations() -> list[tuple[str, str]]:
    """(name, description) of every calibration; one without a description here (a plug-in) gives
    its docstring's first line, and a plug-in names its distribution."""
    out = []
    for name, cal in CALIBRATORS.items():
        desc = CALIBRATION_DESCRIPTIONS.get(name) or (cal.__doc__ or cal.__name__).strip().splitlines()[0]
        origin = CALIBRATORS.origin(name)
        out.append((name, desc + (f" [plug-in: {origin}]" if origin else "")))
    return out
