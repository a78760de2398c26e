"""FedProx (Li et al. 2020): FedAvg plus the proximal term mu/2 ||w - w_global||^2 on each client."""

from __future__ import annotations

import torch
from pydantic import Field

from fedlt.messages import Message, Reply
from fedlt.methods.base import ClientContext, LocalObjective, MethodArgs
from fedlt.methods.fedavg import FedAvgClient, local_loss


class FedProxArgs(MethodArgs):
    mu: float = Field(0.01, ge=0, description="weight of the proximal term")


class FedProxClient(FedAvgClient):
    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        params = dict(ctx.model.named_parameters())
        self._anchor = [(params[k], msg.weights[k].to(params[k].device)) for k in params if k in msg.weights]
        return super().fit(ctx, msg)

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective | None:
        if set(dict(ctx.model.named_parameters())) - set(msg.weights):
            return None  # the proximal term covers only the weights sent; the batched step anchors all
        return LocalObjective(local_loss(ctx, msg), prox_mu=self.args.mu)

    def regularizer(self, ctx: ClientContext, msg: Message) -> torch.Tensor:
        prox = sum(((p - w0) ** 2).sum() for p, w0 in self._anchor)
        return 0.5 * self.args.mu * prox
