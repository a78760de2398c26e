"""Ditto (Li et al., ICML 2021): FedAvg for the global model plus a personal model per client,
regularised towards the global one.

Each round a sampled client trains its personal model ``v_k`` (kept whole in ``ctx.state``)
on ``CE + mu/2 ||v_k - w||^2`` with ``w`` the global model it received, then trains a copy of
``w`` with plain CE for the FedAvg update it uploads; both for ``fl.local_epochs``. ``v_k``
starts as the first global model the client receives. GM: the FedAvg model; PM: ``v_k`` (the
global model for a client that never trained).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from pydantic import Field

from fedlt.messages import Message, Reply
from fedlt.methods.base import Client, ClientContext, MethodArgs, clone_state
from fedlt.methods.personal import load_personal, store_personal
from fedlt.training.sequential import train_local


class DittoArgs(MethodArgs):
    personal_knobs = ("mu",)
    mu: float = Field(0.1, ge=0, description="weight of the pull of each personal model towards the global one "
                                             "(the paper's lambda, tuned over 0.05-2)")


def proximal_term(model: torch.nn.Module, anchor: dict[str, torch.Tensor]) -> torch.Tensor:
    """``||theta - anchor||^2`` over the model's parameters."""
    return sum(((p - anchor[k]) ** 2).sum() for k, p in model.named_parameters())


class DittoClient(Client):
    personalized = True
    backend_refusal_why = "it trains two models a round: its personal one, pulled towards the global, then the global"

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        global_weights = clone_state(model)
        personal = load_personal(ctx, "model")
        if personal is not None:
            model.load_state_dict(personal)
        mu = self.args.mu
        personal_metrics = train_local(
            ctx, lambda x, y: F.cross_entropy(model(x), y) + 0.5 * mu * proximal_term(model, global_weights))
        store_personal(ctx, "model", clone_state(model))
        model.load_state_dict(global_weights)
        metrics = train_local(ctx, lambda x, y: F.cross_entropy(model(x), y))
        metrics["personal_train_loss"] = personal_metrics["train_loss"]
        return Reply(weights=clone_state(model), num_samples=len(ctx.data), metrics=metrics)

    def personalize(self, ctx: ClientContext, msg: Message) -> None:
        ctx.model.load_state_dict(msg.weights, strict=False)
        personal = load_personal(ctx, "model")
        if personal is not None:
            ctx.model.load_state_dict(personal)
