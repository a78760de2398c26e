"""FedDecorr (Shi et al., "Towards Understanding and Mitigating Dimensional Collapse in
Heterogeneous Federated Learning", ICLR 2023): FedAvg plus a feature-decorrelation term.

Under heterogeneous data the local (and hence global) representations collapse onto a few
dimensions. FedDecorr adds to the local loss

    beta * ||K||_F^2 / d^2,

(the released code's scale by default, below), where ``K`` is the ``d x d`` correlation matrix of the batch's encoder features, each feature
dimension standardised over the batch. Pushing the off-diagonal correlations to zero spreads the
representation over more dimensions.

The encoder runs once per batch: the head is applied to the same features the term uses.

Choices:

- ``normalization`` (default ``code``, the authors' released loss, which produced the paper's numbers
  and on whose scale beta = 0.1 was tuned): the mean of the squared off-diagonal entries of the
  unnormalised ``Z^T Z`` (features standardised with the unbiased batch variance), divided by the
  batch size ``N``. That is ``(N-1)^2 / N`` times the paper's off-diagonal term over ``d (d-1)``:
  about ``N`` times stronger than the formula as written. ``paper`` is the written formula; its
  diagonal is 1 for every non-constant dimension and only adds a constant ``(#non-constant dims) / d^2``
  with no gradient. With it, beta = 0.1 is about batch-size times weaker than in the paper's runs.
- The variance gets 1e-8 before its square root, as in the released code, so a dimension that is
  constant over the batch (a dead ReLU) contributes zeros instead of NaN.
- The term adds to the configured ``loss.*`` (CE by default), as FedDecorr is a regulariser on
  top of any local objective.
"""

from __future__ import annotations

from functools import partial
from typing import Literal

import torch
from pydantic import Field

from fedlt.messages import Message
from fedlt.methods.base import ClientContext, LocalObjective, MethodArgs
from fedlt.methods.fedavg import FedAvgClient, local_loss
from fedlt.training.sequential import BatchLoss

STD_EPS = 1e-8


class FedDecorrArgs(MethodArgs):
    beta: float = Field(0.1, ge=0, description="weight of the decorrelation term (0.1: the paper's, on the "
                        "released code's scale)")
    normalization: Literal["code", "paper"] = Field(
        "code", description="the term: code = the released loss, the mean squared off-diagonal entry of Z^T Z over "
        "the batch size N (~N times the formula); paper = the formula ||K||_F^2 / d^2")


def decorrelation_loss(features: torch.Tensor, normalization: str = "paper") -> torch.Tensor:
    """The decorrelation term of a ``(N, d)`` batch; 0 when ``N < 2``. ``paper``: ``||K||_F^2 / d^2`` for
    the correlation matrix ``K``; ``code``: the released loss, the mean squared off-diagonal entry of
    ``Z^T Z`` (unbiased standardisation) over ``N``; 0 also when ``d < 2``, which has no off-diagonal."""
    n, d = features.shape
    if n < 2 or (normalization == "code" and d < 2):
        return features.new_zeros(())
    z = features - features.mean(dim=0, keepdim=True)
    if normalization == "code":
        z = z / torch.sqrt(z.var(dim=0, keepdim=True) + STD_EPS)
        corr = (z.T @ z).masked_fill(torch.eye(d, dtype=torch.bool, device=z.device), 0.0)
        return corr.pow(2).sum() / (d * (d - 1)) / n
    z = z / torch.sqrt(z.pow(2).mean(dim=0, keepdim=True) + STD_EPS)
    corr = z.T @ z / n
    return corr.pow(2).sum() / d**2


def decorrelated_loss(model, x: torch.Tensor, y: torch.Tensor, *, decorr_base, decorr_beta: float,
                      decorr_normalization: str, **base_keywords) -> torch.Tensor:
    """The configured loss of the logits (``decorr_base`` with its keywords) plus ``decorr_beta``
    times the decorrelation term of the batch's features."""
    features = model.forward_features(x)
    return (decorr_base(model.forward_head(features), y, **base_keywords)
            + decorr_beta * decorrelation_loss(features.float(), decorr_normalization))


class FedDecorrClient(FedAvgClient):
    objective_backends = ("graphed",)
    backend_refusal_why = "its loss reads the features"

    def batch_loss(self, ctx: ClientContext, msg: Message) -> BatchLoss:
        loss = self.local_objective(ctx, msg).loss
        return lambda x, y: loss(ctx.model, x, y)

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        """A loss of the model; the configured loss's keywords (a per-client log-prior) are its own."""
        loss = local_loss(ctx, msg)
        base, keywords = (loss.func, loss.keywords) if isinstance(loss, partial) else (loss, {})
        return LocalObjective(partial(decorrelated_loss, decorr_base=base, decorr_beta=self.args.beta,
                                      decorr_normalization=self.args.normalization, **keywords),
                              on_model=True)
