"""FedAvgM (Hsu et al. 2019): FedAvg with server momentum.

The averaged client model gives the pseudo-gradient ``d = x - mean(y)``; the server keeps
``v <- beta * v + d`` and steps ``x <- x - server_lr * v``. With ``beta = 0`` and
``server_lr = 1`` this is FedAvg. Momentum acts on parameters; BatchNorm running statistics
are averaged as in FedAvg. Clients are FedAvg's (any ``loss.*``).
"""

from __future__ import annotations

import torch
from pydantic import Field

from fedlt.methods.aggregation import weighted_average
from fedlt.methods.base import MethodArgs
from fedlt.methods.fedavg import FedAvgServer


class FedAvgMArgs(MethodArgs):
    beta: float = Field(0.9, ge=0, lt=1, description="server momentum (Hsu et al.: 0.9)")
    server_lr: float = Field(1.0, gt=0, description="server learning rate")


class FedAvgMServer(FedAvgServer):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.velocity: dict[str, torch.Tensor] = {}

    @classmethod
    def secure_phases(cls, config):
        return {"fit": "weighted_mean", "query:class_counts": "sum"}  # the momentum acts on the mean only

    def aggregate(self, rnd, replies):
        averaged = weighted_average(replies)
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, value in averaged.items():
                if name not in params:
                    continue
                pseudo_grad = params[name] - value
                v = self.velocity.get(name)
                v = pseudo_grad.clone() if v is None else self.args.beta * v + pseudo_grad
                self.velocity[name] = v
                averaged[name] = params[name] - self.args.server_lr * v
        self.model.load_state_dict(averaged, strict=False)

    def state_dict(self):
        return {**super().state_dict(), "velocity": {k: v.clone() for k, v in self.velocity.items()}}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.velocity = state["velocity"]
