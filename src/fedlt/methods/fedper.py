"""FedPer (Arivazhagan et al., 2019): shared base layers, personal head layers.

Clients train body and head jointly with cross-entropy; only the body is uploaded and
aggregated, the head stays in the client's ``ctx.state``. A client's first head is the model's
initial head (every party builds the same initial model from the run's seed), so the server
never sends a head. There is no global model (GM is reported as "-"); personalized model k is
the global body with head k.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fedlt.messages import Message
from fedlt.methods.base import ClientContext, LocalObjective, ModelHead, Server, broadcast_state
from fedlt.methods.personal import keys_with_prefix, load_personal, personal_module, store_personal
from fedlt.models import FedModel
from fedlt.training.sequential import ObjectiveClient


#: the server's head is the initial one: the trained heads stay with the clients
FEDPER_HEAD = ModelHead("personal heads only (the server's head is never trained)")


class FedPerServer(Server):
    def fit_message(self, rnd: int, cid: int) -> Message:
        return Message(weights=keys_with_prefix(broadcast_state(self.model), ["encoder."]))

    def eval_message(self, cid: int) -> Message:
        return self.fit_message(0, cid)

    def global_model(self) -> FedModel | None:
        return None

    @classmethod
    def has_global_model(cls, config, args) -> bool:
        return False


class FedPerClient(ObjectiveClient):
    personalized = True

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        """Cross-entropy from the received body and the client's own head (the received one at its
        first participation); the head stays on the client, the body is uploaded."""
        head = {f"head.{k}": v for k, v in (load_personal(ctx, "head") or {}).items()}

        def finish(state: dict[str, torch.Tensor], extra: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            store_personal(ctx, "head", {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")})
            return keys_with_prefix(state, ["encoder."])

        return LocalObjective(F.cross_entropy, start=head, finish=finish)

    def personalize(self, ctx: ClientContext, msg: Message) -> None:
        ctx.model.load_state_dict(msg.weights, strict=False)
        personal_module(ctx, "head", ctx.model.head)
