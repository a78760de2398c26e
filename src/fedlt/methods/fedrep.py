"""FedRep (Collins et al., ICML 2021): a shared representation with personal heads.

Each round a client first fits its personal head with the body frozen (``head_epochs``, the
paper's 10), then trains the body with its head frozen (``fl.local_epochs``, as every method's local
training; the authors' runs train it for 1 epoch, which ``fl.local_epochs=1`` reproduces). The body is
aggregated; the head stays in the client's ``ctx.state``. A client joining for the first time
starts its head from the global head it receives.

A global model needs a global head, which FedRep does not define. Like the authors' code (which
averages every entry and lets clients keep their own head), clients upload their head and the
server's model — body plus the sample-weighted average of the round's heads — is the GM; clients
never load that average over a head of their own. ``global_head=false`` keeps heads strictly
local (no upload) and then the method has no GM.

The head epochs run on the client's features under the frozen body (computed once, eval mode,
without augmentation): the same optimisation as a forward pass per step for models without
BatchNorm, and far cheaper. They run client by client when the local objective is made; the body
epochs, the costly part, train together with other clients' on the graphed backend.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedlt.messages import Message, Reply
from fedlt.methods.base import (
    LINEAR_HEAD, Client, ClientContext, LocalObjective, MethodArgs, ModelHead, Server, clone_state,
)
from fedlt.methods.fedbabu import train_body_only
from fedlt.methods.personal import keys_with_prefix, personal_module, store_personal, train_on_features
from fedlt.models import FedModel
from fedlt.training.sequential import train_local


class FedRepArgs(MethodArgs):
    head_epochs: int = Field(10, ge=0, description="epochs fitting the personal head with the body frozen (paper 10)")
    global_head: bool = Field(True, description="upload heads so the server averages them into a global model "
                                                "(GM); false: heads never leave the clients and there is no GM")


def fedrep_head(args: FedRepArgs) -> ModelHead:
    """The average of the clients' heads, or, when heads stay local, the never-trained initial head."""
    if args.global_head:
        return LINEAR_HEAD
    return ModelHead("personal heads only (global_head=false: the server's head is never trained)",
                     fix="method_args.global_head=true")


class FedRepServer(Server):
    def global_model(self) -> FedModel | None:
        return self.model if self.args.global_head else None

    @classmethod
    def has_global_model(cls, config, args) -> bool:
        return args.global_head


class FedRepClient(Client):
    personalized = True
    objective_backends = ("graphed",)
    backend_refusal_why = "its head and body train in turn: the head first, then only the body under it"

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        model = ctx.model
        self._fit_head(ctx, msg)
        metrics = train_local(ctx, lambda x, y: F.cross_entropy(model(x), y), params=model.encoder.parameters())
        return Reply(weights=self._reply(ctx, clone_state(model)), num_samples=len(ctx.data), metrics=metrics)

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        """The head fitted first (here, client by client), then cross-entropy through it with the
        body trained: the fitted head is the client's ``start``, kept by ``finish``."""
        head = {f"head.{k}": v for k, v in self._fit_head(ctx, msg).items()}
        return LocalObjective(F.cross_entropy, start=head, prepare=train_body_only,
                              finish=lambda state, extra: self._reply(ctx, state))

    def _fit_head(self, ctx: ClientContext, msg: Message) -> dict[str, torch.Tensor]:
        """The received weights with the client's own head over them, the head then fitted on the
        frozen body's features; returns the fitted head."""
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        personal_module(ctx, "head", model.head)  # own head over the received one, if any
        train_on_features(ctx, list(model.head.parameters()), model.forward_head, self.args.head_epochs)
        return {k: v.detach().clone() for k, v in model.head.state_dict().items()}

    def _reply(self, ctx: ClientContext, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Keeps the (unchanged) head on the client; the body, and the head when heads are averaged, go up."""
        store_personal(ctx, "head", {k.removeprefix("head."): v for k, v in state.items() if k.startswith("head.")})
        return keys_with_prefix(state, ["encoder.", "head."] if self.args.global_head else ["encoder."])

    def personalize(self, ctx: ClientContext, msg: Message) -> None:
        ctx.model.load_state_dict(msg.weights, strict=False)
        personal_module(ctx, "head", ctx.model.head)
