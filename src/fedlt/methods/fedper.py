"""FedPer (Arivazhagan et al., 2019): shared base layers, personal head layers.

Clients train body and head jointly with cross-entropy; only the body is uploaded and
aggregated, the head stays in the client's ``ctx.state``. A client's first head is the model's
initial head (every party builds the same initial model from the run's seed), so the server
never sends a head. There is no global model (GM is reported as "-"); personalized model k is
the global body with head k.
"""

from __future__ import annotations

import torch.nn.functional as F

from fedlt.messages import Message, Reply
from fedlt.methods.base import Client, ClientContext, ModelHead, Server, clone_state
from fedlt.methods.personal import keys_with_prefix, personal_module, store_module
from fedlt.models import FedModel
from fedlt.training.sequential import train_local


#: the server's head is the initial one: the trained heads stay with the clients
FEDPER_HEAD = ModelHead("personal heads only (the server's head is never trained)")


class FedPerServer(Server):
    def fit_message(self, rnd: int, cid: int) -> Message:
        return Message(weights=keys_with_prefix(clone_state(self.model), ["encoder."]))

    def eval_message(self, cid: int) -> Message:
        return self.fit_message(0, cid)

    def global_model(self) -> FedModel | None:
        return None


class FedPerClient(Client):
    personalized = True

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        personal_module(ctx, "head", model.head)
        metrics = train_local(ctx, lambda x, y: F.cross_entropy(model(x), y))
        store_module(ctx, "head", model.head)
        return Reply(weights=keys_with_prefix(clone_state(model), ["encoder."]), num_samples=len(ctx.data),
                     metrics=metrics)

    def personalize(self, ctx: ClientContext, msg: Message) -> None:
        ctx.model.load_state_dict(msg.weights, strict=False)
        personal_module(ctx, "head", ctx.model.head)
