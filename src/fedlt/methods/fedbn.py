"""FedBN (Li et al., ICLR 2021): FedAvg with local BatchNorm layers.

BatchNorm weights, biases and running statistics stay in each client's ``ctx.state``: the
server sends none for training, and a client never loads anything over its own (a new client
trains from the model's initial BatchNorm). Everything else is averaged as in FedAvg.

For a global model the server needs BatchNorm values too: with ``global_bn`` (default) clients
upload theirs and the server averages them into its model, used as the GM and sent with the
evaluation message, so a client that has not trained yet is evaluated with the GM (one that has
loads its own over it). With ``global_bn=false`` BatchNorm never leaves a client, there is no GM,
and a client that has not trained yet is evaluated with the initial BatchNorm. On a model
without BatchNorm (the small CNN) FedBN is exactly FedAvg.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedlt.messages import Message
from fedlt.methods.base import ClientContext, LocalObjective, MethodArgs, Server, ServerContext, broadcast_state
from fedlt.methods.personal import batchnorm_keys, load_personal, store_personal
from fedlt.models import FedModel
from fedlt.training.sequential import ObjectiveClient


class FedBNArgs(MethodArgs):
    global_bn: bool = Field(True, description="clients upload BatchNorm so the server can average a global model (GM); "
                                              "false: BatchNorm never leaves a client and there is no GM")


class FedBNServer(Server):
    def __init__(self, ctx: ServerContext):
        super().__init__(ctx)
        self.bn_keys = set(batchnorm_keys(self.model))

    def fit_message(self, rnd: int, cid: int) -> Message:
        return Message(weights={k: v for k, v in broadcast_state(self.model).items() if k not in self.bn_keys})

    def eval_message(self, cid: int) -> Message:
        """The GM with its averaged BatchNorm (``global_bn``), for a client without its own yet."""
        return Message(weights=broadcast_state(self.model)) if self.args.global_bn else self.fit_message(0, cid)

    def global_model(self) -> FedModel | None:
        return self.model if self.args.global_bn or not self.bn_keys else None


def keeps_batchnorm(args: FedBNArgs, model: FedModel) -> bool:
    """``MethodSpec.keeps_state``: the clients keep the model's BatchNorm, so nothing where it has none."""
    return bool(batchnorm_keys(model))


class FedBNClient(ObjectiveClient):
    personalized = True

    def _load(self, ctx: ClientContext, msg: Message) -> None:
        ctx.model.load_state_dict(msg.weights, strict=False)
        own = load_personal(ctx, "bn")
        if own is not None:
            ctx.model.load_state_dict(own, strict=False)

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        """Cross-entropy from the received weights and the client's own BatchNorm; the BatchNorm after
        training stays on the client (and is uploaded with ``global_bn``)."""
        bn = set(batchnorm_keys(ctx.model))

        def finish(state: dict[str, torch.Tensor], extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if bn:
                store_personal(ctx, "bn", {k: state[k] for k in bn})
            return state if self.args.global_bn else {k: v for k, v in state.items() if k not in bn}

        return LocalObjective(F.cross_entropy, start=load_personal(ctx, "bn") or {}, finish=finish)

    def personalize(self, ctx: ClientContext, msg: Message) -> None:
        self._load(ctx, msg)
