"""A small method: FedAvg whose clients add a penalty on the squared logits, and whose server
reports the mean norm of the classifier's rows after every round."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedlt.messages import Message, Reply
from fedlt.methods.base import Client, ClientContext, MethodArgs, MethodSpec, Server, clone_state
from fedlt.training.sequential import train_local


class SqueezeArgs(MethodArgs):
    """The method's knobs (`method_args.*`), validated; unknown knobs are config errors."""

    beta: float = Field(0.01, ge=0, description="weight of the mean squared logit")


class SqueezeClient(Client):
    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        ctx.model.load_state_dict(msg.weights, strict=False)  # the global model the server sent
        # per-client memory lives in ctx.state (kept by client id and checkpointed)
        ctx.state["rounds_trained"] = ctx.state.get("rounds_trained", 0) + 1

        def batch_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            logits = ctx.model(x)
            return F.cross_entropy(logits, y) + self.args.beta * logits.pow(2).mean()

        metrics = train_local(ctx, batch_loss)  # SGD with the round's fl.* settings
        return Reply(weights=clone_state(ctx.model), num_samples=len(ctx.data), metrics=metrics)


class SqueezeServer(Server):
    """FedAvg's broadcast and sample-weighted average (inherited), plus one diagnostic."""

    row_norm: float | None = None

    def end_round(self, rnd: int) -> None:  # after aggregate(), every round
        self.row_norm = float(self.model.head.weight.detach().norm(dim=1).mean())

    def metrics(self) -> dict[str, float]:  # written into the round's metrics line
        return {} if self.row_norm is None else {"head_row_norm": self.row_norm}


SPEC = MethodSpec("squeeze", "FedAvg + squared-logit penalty (method_args.beta)",
                  SqueezeServer, SqueezeClient, SqueezeArgs, uses_loss_config=False)
