"""FedLC (Zhang et al., "Federated Learning with Label Distribution Skew via Logits Calibration",
ICML 2022): FedAvg whose local loss is cross-entropy on calibrated logits.

Each client subtracts a class-dependent margin from its logits before the softmax,

    calibrated_y = f_y(x) - tau * n_{k,y}^(-1/4),

where ``n_{k,y}`` are the client's own label counts. Rare local classes lose more, so the model
must raise their logits during training and is not pushed to over-predict the locally frequent
classes; the calibration is used only in training, the global model predicts with raw logits.

Choices where the paper is loose:

- The paper writes the denominator of its calibrated softmax over ``y' != y``; that "loss" is
  unbounded below (it decreases forever as ``f_y`` grows). We use the ordinary softmax over all
  classes of the calibrated logits, as every public implementation does (including the
  FedDecorr authors' one).
- A class the client does not hold has ``n = 0`` and an infinite margin, the limit of the
  formula: it drops out of the local softmax, so local training never pushes its logit down
  (the public implementations behave the same way through ``0 ** -0.25 = inf``).
- The paper states no value for tau; public implementations use 0.1 to 1. We default to 1.0,
  where the margins (at most 1 logit, for a single sample) are large enough to matter.

FedLC fixes its own objective, so ``loss.*`` is not used.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field

from fedlt.messages import Message
from fedlt.methods.base import ClientContext, LocalObjective, MethodArgs
from fedlt.methods.fedavg import FedAvgClient
from fedlt.training.sequential import BatchLoss
from fedlt.transfer import to_device


class FedLCArgs(MethodArgs):
    tau: float = Field(1.0, ge=0, description="calibration strength: logits minus tau * n_{k,y}^(-1/4)")


def calibration_margins(class_counts: np.ndarray | torch.Tensor, tau: float) -> torch.Tensor:
    """``tau * n^(-1/4)`` per class (float32, on the host: host counts in); ``inf`` for absent classes
    when ``tau > 0``.

    The power is taken of the present classes only, packed: on a CPU a vector's SIMD body and its
    scalar tail round differently, so which classes are packed together decides the last bit."""
    present = torch.from_numpy(np.flatnonzero(np.asarray(class_counts) > 0))  # host indices: no wait
    counts = torch.as_tensor(class_counts).to(torch.float32)
    margins = torch.full_like(counts, float("inf") if tau > 0 else 0.0)
    return margins.index_copy_(0, present, tau * counts.index_select(0, present).pow(-0.25))


def calibrated_ce(logits: torch.Tensor, targets: torch.Tensor, margins: torch.Tensor) -> torch.Tensor:
    """Batch-mean cross-entropy of ``logits - margins`` (FedLC's calibrated loss)."""
    return F.cross_entropy(logits - margins.to(logits.device, logits.dtype), targets)


class FedLCClient(FedAvgClient):
    def batch_loss(self, ctx: ClientContext, msg: Message) -> BatchLoss:
        loss = self.local_objective(ctx, msg).loss
        return lambda x, y: loss(ctx.model(x), y)

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        """The calibrated cross-entropy as a loss of the logits, its margins a per-client tensor."""
        margins = calibration_margins(ctx.data.host_counts(), self.args.tau)  # made on the host, then copied
        return LocalObjective(partial(calibrated_ce, margins=to_device(margins, ctx.data.labels.device, margins.dtype)))
