"""SCAFFOLD (Karimireddy et al., ICML 2020): local steps corrected by control variates.

Each client keeps its control variate c_i in ``ctx.state`` (one flat vector over the model's
parameters, zero at first); the server keeps c. Local SGD follows ``g(y) - c_i + c``: a gradient
hook adds ``c - c_i`` to each parameter's gradient, so any local loss works and the reported
training loss stays the task loss (a linear loss term ``<y, c - c_i>`` would give the same step but
a loss without a floor). After K local steps at learning
rate lr the client sets ``c_i+`` to the mean over its K steps of the minibatch gradient it
computed (plus weight decay as SGD adds it): with plain SGD that is exactly the paper's option II,
``c_i - c + (x - y) / (K lr)``; with momentum beta, option II's formula overestimates it by about
1 / (1 - beta) (10x at 0.9, which made the run diverge to NaN within 5 rounds on Fashion-MNIST-LT).

Messages: down, the model and c (one vector the size of the parameters); up, the model (averaged
by samples, as in FedAvg: with zero variates SCAFFOLD is FedAvg) and ``delta_c = c_i+ - c_i``.
The server sets ``c <- c + (1/N) * sum_S delta_c`` (N = all clients; global step size 1).

Choices: variates cover parameters only (BatchNorm running statistics are averaged as in
FedAvg). The corrected step is a :class:`~fedlt.methods.base.GradientCorrection`, so the graphed
backend trains SCAFFOLD's clients together.
"""

from __future__ import annotations

import torch

from fedlt.messages import Message
from fedlt.methods.base import ClientContext, GradientCorrection, LocalObjective
from fedlt.methods.fedavg import FedAvgClient, FedAvgServer, local_loss
from fedlt.training.sequential import ObjectiveClient

STATE_KEY = "scaffold_c"


def param_vector(model: torch.nn.Module) -> torch.Tensor:
    """All parameters as one flat vector (reshape: channels-last weights are not viewable)."""
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


class ScaffoldServer(FedAvgServer):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.c = torch.zeros_like(param_vector(self.model))

    def fit_message(self, rnd: int, cid: int) -> Message:
        msg = super().fit_message(rnd, cid)
        msg.payload["c_global"] = self.c.clone()
        return msg

    def aggregate(self, rnd, replies):
        super().aggregate(rnd, replies)
        deltas = [r.payload["delta_c"].to(self.c) for _, r in sorted(replies.items()) if r.num_samples > 0]
        if deltas:
            self.c += torch.stack(deltas).sum(0) / self.ctx.num_clients

    def state_dict(self):
        return {**super().state_dict(), "c": self.c.clone()}

    def load_state_dict(self, state):
        super().load_state_dict(state)
        self.c = state["c"]


class ScaffoldClient(ObjectiveClient, FedAvgClient):
    objective_backends = ("graphed",)
    backend_refusal_why = "its gradient is corrected by control variates"

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        """FedAvg's loss on the gradient corrected by ``c - c_i``; ``finish`` sets ``c_i+`` (the mean
        of the steps' own gradients) and puts ``delta_c`` into the reply."""
        params = list(ctx.model.parameters())
        c = msg.payload["c_global"].to(params[0])
        c_i = ctx.state.get(STATE_KEY, torch.zeros_like(c)).to(c)
        offset = [d.view(p.shape) for p, d in zip(params, (c - c_i).split([p.numel() for p in params]))]
        summed = {}
        objective = LocalObjective(local_loss(ctx, msg), correction=GradientCorrection(
            offset, done=lambda sums, steps: summed.update(sums=sums, steps=steps)))

        def finish(state: dict[str, torch.Tensor], extra: dict) -> dict[str, torch.Tensor]:
            if summed["steps"] > 0:
                c_new = torch.cat([s.reshape(-1) for s in summed["sums"]]) / summed["steps"]
                ctx.state[STATE_KEY] = c_new.cpu()
                objective.payload["delta_c"] = (c_new - c_i).cpu()
            else:
                objective.payload["delta_c"] = torch.zeros_like(c).cpu()
            return state

        objective.finish = finish
        return objective
