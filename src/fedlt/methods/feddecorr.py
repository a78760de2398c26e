"""FedDecorr (Shi et al., "Towards Understanding and Mitigating Dimensional Collapse in
Heterogeneous Federated Learning", ICLR 2023): FedAvg plus a feature-decorrelation term.

Under heterogeneous data the local (and hence global) representations collapse onto a few
dimensions. FedDecorr adds to the local loss

    beta * ||K||_F^2 / d^2,

where ``K`` is the ``d x d`` correlation matrix of the batch's encoder features, each feature
dimension standardised over the batch. Pushing the off-diagonal correlations to zero spreads the
representation over more dimensions.

The encoder runs once per batch: the head is applied to the same features the term uses.

Choices:

- The diagonal of ``K`` is 1 for every non-constant dimension, so including it (as the paper's
  formula does) only adds the constant ``(#non-constant dims) / d^2`` and changes no gradient.
  The authors' code instead averages the squared off-diagonal entries of the unnormalised
  ``Z^T Z`` and divides by the batch size, which is ``~N`` times the paper's off-diagonal term;
  we follow the paper's formula and its beta = 0.1.
- Standardisation uses the biased batch variance plus 1e-8, so a dimension that is constant over
  the batch (a dead ReLU) contributes zeros instead of NaN.
- The term adds to the configured ``loss.*`` (CE by default), as FedDecorr is a regulariser on
  top of any local objective.
"""

from __future__ import annotations

from functools import partial

import torch
from pydantic import Field

from fedlt.messages import Message
from fedlt.methods.base import ClientContext, LocalObjective, MethodArgs
from fedlt.methods.fedavg import FedAvgClient, local_loss
from fedlt.training.sequential import BatchLoss

STD_EPS = 1e-8


class FedDecorrArgs(MethodArgs):
    beta: float = Field(0.1, ge=0, description="weight of the decorrelation term ||K||_F^2 / d^2")


def decorrelation_loss(features: torch.Tensor) -> torch.Tensor:
    """``||K||_F^2 / d^2`` for the correlation matrix ``K`` of a ``(N, d)`` batch; 0 when ``N < 2``."""
    n, d = features.shape
    if n < 2:
        return features.new_zeros(())
    z = features - features.mean(dim=0, keepdim=True)
    z = z / torch.sqrt(z.pow(2).mean(dim=0, keepdim=True) + STD_EPS)
    corr = z.T @ z / n
    return corr.pow(2).sum() / d**2


def decorrelated_loss(model, x: torch.Tensor, y: torch.Tensor, *, decorr_base, decorr_beta: float,
                      **base_keywords) -> torch.Tensor:
    """The configured loss of the logits (``decorr_base`` with its keywords) plus ``decorr_beta``
    times the decorrelation term of the batch's features."""
    features = model.forward_features(x)
    return (decorr_base(model.forward_head(features), y, **base_keywords)
            + decorr_beta * decorrelation_loss(features.float()))


class FedDecorrClient(FedAvgClient):
    objective_backends = ("graphed",)  # its loss reads the features

    def batch_loss(self, ctx: ClientContext, msg: Message) -> BatchLoss:
        loss = self.local_objective(ctx, msg).loss
        return lambda x, y: loss(ctx.model, x, y)

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        """A loss of the model; the configured loss's keywords (a per-client log-prior) are its own."""
        loss = local_loss(ctx, msg)
        base, keywords = (loss.func, loss.keywords) if isinstance(loss, partial) else (loss, {})
        return LocalObjective(partial(decorrelated_loss, decorr_base=base, decorr_beta=self.args.beta, **keywords),
                              on_model=True)
