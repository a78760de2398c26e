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
FedAvg).
"""

from __future__ import annotations

import torch

from fedlt.messages import Message, Reply
from fedlt.methods.base import ClientContext
from fedlt.methods.fedavg import FedAvgClient, FedAvgServer

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


class ScaffoldClient(FedAvgClient):
    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        ctx.model.load_state_dict(msg.weights, strict=False)
        x = param_vector(ctx.model)
        c = msg.payload["c_global"].to(x)
        c_i = ctx.state.get(STATE_KEY, torch.zeros_like(x)).to(x)
        correction = c - c_i
        params = list(ctx.model.parameters())
        sizes = [p.numel() for p in params]
        corrections = [d.view(p.shape) for p, d in zip(params, correction.split(sizes))]
        sums = [torch.zeros_like(p) for p in params]
        wd = ctx.train.weight_decay

        def accumulate(i: int, p: torch.nn.Parameter):
            def hook(grad: torch.Tensor) -> torch.Tensor:  # sum the step's own gradient, then correct it
                sums[i].add_(grad + wd * p.detach())
                return grad + corrections[i]
            return hook

        handles = [p.register_hook(accumulate(i, p)) for i, p in enumerate(params)]
        try:
            reply = super().fit(ctx, msg)
        finally:
            for handle in handles:
                handle.remove()
        steps = reply.metrics.get("steps", 0.0)
        if steps > 0:
            c_new = torch.cat([s.reshape(-1) for s in sums]) / steps
            ctx.state[STATE_KEY] = c_new.cpu()
            reply.payload["delta_c"] = (c_new - c_i).cpu()
        else:
            reply.payload["delta_c"] = torch.zeros_like(x).cpu()
        return reply
