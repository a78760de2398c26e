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

import torch
import torch.nn.functional as F
from torch import nn

from fedlt.losses import make_loss
from fedlt.messages import Message, Reply
from fedlt.methods.base import Client, ClientContext, clone_state
from fedlt.methods.personal import personal_module, store_module
from fedlt.training.sequential import train_local


def zero_like_linear(like: nn.Linear) -> nn.Linear:
    layer = torch.nn.utils.skip_init(nn.Linear, like.in_features, like.out_features, bias=like.bias is not None,
                                     device=like.weight.device)
    for p in layer.parameters():
        nn.init.zeros_(p)
    return layer


class FedRoDClient(Client):
    personalized = True

    def fit(self, ctx: ClientContext, msg: Message) -> Reply:
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        p_head = personal_module(ctx, "p_head", zero_like_linear(model.head))
        counts = ctx.data.class_counts().float()
        balanced = make_loss("bsm", prior=counts / counts.sum().clamp_min(1))

        def loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            h = model.forward_features(x)
            generic = model.forward_head(h)
            personal = generic.detach() + p_head(h.detach())
            return balanced(generic, y) + F.cross_entropy(personal, y)

        metrics = train_local(ctx, loss, params=[*model.parameters(), *p_head.parameters()])
        store_module(ctx, "p_head", p_head)
        return Reply(weights=clone_state(model), num_samples=len(ctx.data), metrics=metrics)

    def personalize(self, ctx: ClientContext, msg: Message) -> None:
        model = ctx.model
        model.load_state_dict(msg.weights, strict=False)
        p_head = personal_module(ctx, "p_head", zero_like_linear(model.head))
        with torch.no_grad():
            for generic, personal in zip(model.head.parameters(), p_head.parameters()):
                generic.add_(personal)
