"""SFD (Zhang et al., "Synthetic Feature-based Decoupled training", KDD 2025).

Learning stage: FedAvg whose clients train with ABBL (:mod:`fedlt.methods.sfd_losses`): A-CE on
the classifier plus ``beta_SCL(r)`` times A-SCL on a projector's L2-normalised output,
``beta_SCL`` annealed by a cosine over the rounds (Eq. 28). The projector (Linear d -> d/2, BN,
ReLU, Linear d/2 -> d/4; the released code's 512 -> 256 -> 128 on ResNet-18) lives inside the encoder
module, so the model keeps its encoder/head split, is averaged with the rest, and never touches
the features the classifier sees.

Calibration stage: the ``safs`` calibration (:class:`fedlt.calibration.calibrators.SAFS`) — one
statistics query after the last round, then synthetic features and classifier fine-tuning. The
"w/o SAFS & fine-tune" ablation is the ``uncalibrated`` variant every SFD run reports.

Choices where the paper is silent: ``beta_SCL`` at round r is ``beta_1 (1 + cos(pi (r-1)/R)) / 2``,
so round 1 uses ``beta_1`` (as the code does with 0-based rounds); ``beta_1`` defaults to 1 for
100 or more classes and 0.1 otherwise (the paper: 1 on CIFAR-100, 0.1 elsewhere); the contrastive
term is skipped on a batch of one sample (BatchNorm and SCL need two). Local optimisation and
model averaging (by samples) follow ``fl.*``.
"""

from __future__ import annotations

import math
from functools import partial
from typing import Callable, Literal

import torch
from pydantic import Field
from torch import nn

from fedlt.config import Config
from fedlt.messages import Message
from fedlt.methods.base import ClientContext, LocalObjective, MethodArgs, Server, broadcast_state, parse_args
from fedlt.methods.sfd_losses import adaptive_ce, adaptive_logit_offset, adaptive_supcon, released_supcon
from fedlt.models import FedModel, create_model
from fedlt.training.sequential import ObjectiveClient
from fedlt.transfer import to_device


class SFDArgs(MethodArgs):
    """ABBL's knobs; the ablations of the paper's Table 2 are combinations of them (see docs/methods/sfd.md)."""

    ce_gamma: float = Field(0.1, ge=0, description="A-CE: gamma of the logit adjustment (0: plain CE, 'SFD-CE')")
    beta_pi: float = Field(1.0, ge=0, le=1, description="A-CE: a missing class's pi = beta_pi * smallest present "
                           "count (0: plain logit adjustment, 'w/o improved pi')")
    scl_weight: float | None = Field(None, ge=0, description="beta_SCL at round 1, cosine-annealed to 0 (default: 1 "
                                     "for >= 100 classes, which the paper pairs with lr 0.01, else 0.1; 0: no "
                                     "contrastive branch)")
    scl_temperature: float = Field(0.07, gt=0, description="A-SCL temperature tau")
    scl_delta: bool = Field(True, description="A-SCL: add Delta = log n_y to the denominator (false: standard SCL)")
    scl_form: Literal["released", "eq7", "paper"] = Field(
        "released", description="A-SCL as the released code (Delta on other-class samples only; the anchor is its "
        "own positive), as Eq. 7 is printed (eq7: Delta on every other sample; A(i) holds the anchor), or Eq. 7 "
        "with Khosla et al.'s positives (paper: without the anchor; the earlier default)")
    projector_hidden: int | None = Field(None, ge=1, description="projector hidden width (default: feature_dim // 2)")
    projector_dim: int | None = Field(None, ge=1, description="projector output width (default: feature_dim // 4)")

    def unread_when(self) -> list[tuple[tuple[str, ...], str]]:
        unread = []
        if self.ce_gamma == 0:
            unread.append((("beta_pi",), "with ce_gamma=0 (A-CE adds no prior to the logits)"))
        if self.scl_weight == 0:
            unread.append((("scl_temperature", "scl_delta", "scl_form"), "with scl_weight=0 (no contrastive branch)"))
        return unread


class ProjectedEncoder(nn.Module):
    """The backbone's encoder plus the contrastive projector; ``forward`` is the backbone's."""

    def __init__(self, body: nn.Module, feature_dim: int, hidden: int, out: int):
        super().__init__()
        self.body = body
        self.projector = nn.Sequential(nn.Linear(feature_dim, hidden), nn.BatchNorm1d(hidden), nn.ReLU(inplace=True),
                                       nn.Linear(hidden, out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """L2-normalised projections, the input of A-SCL."""
        return nn.functional.normalize(self.projector(features), dim=1)


def parse_sfd_args(raw: dict) -> SFDArgs:
    return parse_args(SFDArgs, raw, "method_args", "method sfd")


def make_sfd_model(cfg: Config, num_classes: int, in_channels: int, image_size: int) -> FedModel:
    model = create_model(cfg.model.name, num_classes, in_channels=in_channels, image_size=image_size)
    args = parse_sfd_args(cfg.method_args)
    d = model.feature_dim
    hidden = args.projector_hidden or max(1, d // 2)
    model.encoder = ProjectedEncoder(model.encoder, d, hidden, args.projector_dim or max(1, d // 4))
    return model


#: the paper's local learning rate (SGD, momentum 0.9), with which it set ``beta_1``
PAPER_LR = 0.01


def initial_scl_weight(args: SFDArgs, num_classes: int | None) -> float | None:
    """``beta_1``: ``scl_weight``, else the paper's 1 on CIFAR-100 and 0.1 on its 10-class datasets (None
    where the class count is not known yet)."""
    if args.scl_weight is not None:
        return args.scl_weight
    return None if num_classes is None else 1.0 if num_classes >= 100 else 0.1


def scl_weight_at(args: SFDArgs, num_classes: int, rnd: int, rounds: int) -> float:
    """Eq. 28 with 1-based rounds: ``beta_1`` at round 1, decaying to ``beta_1 (1 + cos(pi (R-1)/R)) / 2``."""
    return initial_scl_weight(args, num_classes) * 0.5 * (1.0 + math.cos(math.pi * (rnd - 1) / rounds))


class SFDServer(Server):
    """FedAvg that also tells the clients the round's ``beta_SCL``."""

    @classmethod
    def config_notes(cls, config, args, classes):
        """A round-1 ``beta_SCL`` of 1 or more above the paper's lr: on 100 classes at ``fl.lr=0.05`` it cut off
        the CNN's units in round 1 (docs/results/sfd-100-classes.md); a gradient clip kept it training."""
        start, fl = initial_scl_weight(args, classes), config.fl
        if start is None or start < 1 or fl.lr <= PAPER_LR or fl.grad_clip is not None:
            return []
        return [f"method sfd: A-SCL weight {start:g} at round 1 (the paper's at 100 classes) is paired in the paper "
                f"with lr {PAPER_LR:g}, under this run's fl.lr={fl.lr:g}; at fl.lr=0.05 it cut SFD's accuracy at 100 "
                f"classes from 76.92% to 28.29% (docs/results/sfd-100-classes.md); set fl.lr={PAPER_LR:g} or "
                "fl.grad_clip=1.0"]

    def fit_message(self, rnd: int, cid: int) -> Message:
        weight = scl_weight_at(self.args, self.ctx.num_classes, rnd, self.ctx.config.fl.rounds)
        return Message(weights=broadcast_state(self.model), payload={"sfd/scl_weight": weight})


#: A-SCL by ``method_args.scl_form``
SUPCON_FORMS: dict[str, Callable[..., torch.Tensor]] = {
    "released": released_supcon, "eq7": partial(adaptive_supcon, anchor_positive=True), "paper": adaptive_supcon}


def abbl_loss(model: FedModel, x: torch.Tensor, y: torch.Tensor, *, offset: torch.Tensor, contrast: bool,
              scl_weight: torch.Tensor, temperature: float, log_counts: torch.Tensor | None,
              supcon: Callable[..., torch.Tensor] = adaptive_supcon) -> torch.Tensor:
    """Eq. 8 on one batch: A-CE plus ``scl_weight`` times A-SCL on the projections (skipped when the
    round's weight is 0, ``contrast=False``, or the batch holds one sample)."""
    features = model.forward_features(x)
    loss = adaptive_ce(model.forward_head(features), y, offset)
    if contrast and y.shape[0] > 1:
        h = model.encoder.project(features)
        loss = loss + scl_weight * supcon(h, y, temperature, log_counts)
    return loss


class SFDClient(ObjectiveClient):
    """ABBL local training (Eq. 8)."""

    objective_backends = ("graphed",)
    backend_refusal_why = "its loss reads the features and their projections"

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective | None:
        """ABBL as a loss of the model; the round's weight is a tensor, so captured steps outlive
        its annealing. None for a client without data (it has no prior)."""
        if len(ctx.data) == 0:
            return None
        args: SFDArgs = self.args
        counts = ctx.data.host_counts()  # the per-class terms are made on the host, then copied
        device = ctx.data.labels.device
        weight = float(msg.payload["sfd/scl_weight"])
        offset = adaptive_logit_offset(counts, args.beta_pi, args.ce_gamma)
        loss = partial(abbl_loss, offset=to_device(offset, device, offset.dtype),
                       contrast=weight > 0, scl_weight=torch.full((), weight, device=device),
                       temperature=args.scl_temperature,
                       log_counts=to_device(torch.log(torch.from_numpy(counts).float()), device, torch.float32)
                       if args.scl_delta else None,
                       supcon=SUPCON_FORMS[args.scl_form])
        return LocalObjective(loss, on_model=True)
