"""FedRoD (Chen & Chao, ICLR 2022): a generic head trained for the balanced risk and a personal
head on top of it, from one shared body.

Each local step minimises the balanced softmax (Ren et al. 2020; the client's own class counts
as the prior) of the generic head ``g`` on the body's features, which trains the body and ``g``
(both aggregated), plus the cross-entropy of ``g(h).detach() + p_k(h.detach())``, which trains
only the personal head ``p_k`` (kept in ``ctx.state``, never uploaded). The global model is the
body with ``g``; personalized model k predicts ``g(h) + p_k(h)``, i.e. one linear head with the
summed weights.

Choices: ``p_k`` is linear (the paper's simpler variant, not the hypernetwork) and starts at
zero, so a new client's personalized model is the global one; it is updated with the same SGD
settings as the body.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from fedlt.losses import make_loss
from fedlt.messages import Message, Reply
from fedlt.methods.base import Client, ClientContext, LocalObjective, clone_state
from fedlt.methods.personal import personal_module, store_module, store_personal
from fedlt.training.sequential import train_local


def zero_like_linear(like: nn.Linear) -> nn.Linear:
    layer = torch.nn.utils.skip_init(nn.Linear, like.in_features, like.out_features, bias=like.bias is not None,
                                     device=like.weight.device)
    for p in layer.parameters():
        nn.init.zeros_(p)
    return layer


def rod_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, *, rod_balanced, p_weight: torch.Tensor,
             p_bias: torch.Tensor | None = None, **balanced_keywords) -> torch.Tensor:
    """The balanced softmax (``rod_balanced`` with its keywords) of the generic head plus the
    cross-entropy of ``g(h).detach() + p_k(h.detach())``, which trains only the personal head."""
    h = model.forward_features(x)
    generic = model.forward_head(h)
    personal = generic.detach() + F.linear(h.detach(), p_weight, p_bias)
    return rod_balanced(generic, y, **balanced_keywords) + F.cross_entropy(personal, y)


def rod_objective_loss(ctx: ClientContext):
    """:func:`rod_loss` with this client's balanced softmax (its own class counts as the prior)."""
    balanced = make_loss("bsm", prior=ctx.data.host_prior(), device=ctx.data.labels.device)
    return partial(rod_loss, rod_balanced=balanced.func, **balanced.keywords)


class FedRoDClient(Client):
    personalized = True
    objective_backends = ("graphed",)
    backend_refusal_why = "its loss reads the features and trains a personal head outside the model"

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        p_head = personal_module(ctx, "p_head", zero_like_linear(model.head))
        loss = rod_objective_loss(ctx)
        metrics = train_local(ctx, lambda x, y: loss(model, x, y, p_weight=p_head.weight, p_bias=p_head.bias),
                              params=[*model.parameters(), *p_head.parameters()])
        store_module(ctx, "p_head", p_head)
        return Reply(weights=clone_state(model), num_samples=len(ctx.data), metrics=metrics)

    def local_objective(self, ctx: ClientContext, msg: Message) -> LocalObjective:
        """:func:`rod_loss` as a loss of the model, the personal head's weight and bias trainable
        tensors outside it, kept on the client after training."""
        p_head = personal_module(ctx, "p_head", zero_like_linear(ctx.model.head))
        extra = {f"p_{k}": v.detach() for k, v in p_head.named_parameters()}

        def finish(state: dict[str, torch.Tensor], trained: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            store_personal(ctx, "p_head", {k.removeprefix("p_"): v for k, v in trained.items()})
            return state

        return LocalObjective(rod_objective_loss(ctx), on_model=True, extra=extra, finish=finish)

    def personalize(self, ctx: ClientContext, msg: Message) -> None:
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        p_head = personal_module(ctx, "p_head", zero_like_linear(model.head))
        with torch.no_grad():
            for generic, personal in zip(model.head.parameters(), p_head.parameters()):
                generic.add_(personal)
