"""What personalized methods share: personal parameters kept in ``ctx.state``, splitting a state
dict into shared and local entries, and training a classifier on a client's frozen features.

Personal parameters live only in the client's ``ctx.state`` (the engine keeps it per client id
and checkpoints it); they are stored under ``personal/<name>/<key>`` as detached tensors and never
put into a :class:`~fedlt.messages.Reply`, so they cannot reach the server.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace

import torch
from torch import nn

from fedlt.calibration.math.retrain import linear_init
from fedlt.calibration.wrapper import client_features
from fedlt.methods.base import ClientContext
from fedlt.training.sequential import epoch_batches

PREFIX = "personal/"


def at_evaluation_lr(ctx: ClientContext) -> ClientContext:
    """``ctx`` with its SGD at ``fl.lr`` without the schedule, for fine-tuning at evaluation: a
    decaying schedule takes the round's lr near 0 by the last evaluation, where a personalized
    model's fine-tuning would then leave it as it is."""
    return replace(ctx, train=replace(ctx.train, lr=ctx.train.base_lr or ctx.train.lr))


def load_personal(ctx: ClientContext, name: str) -> dict[str, torch.Tensor] | None:
    """The tensors stored as ``name`` for this client, or None if it has none yet."""
    prefix = f"{PREFIX}{name}/"
    found = {k[len(prefix):]: v for k, v in ctx.state.items() if k.startswith(prefix)}
    return found or None


def store_personal(ctx: ClientContext, name: str, tensors: dict[str, torch.Tensor]) -> None:
    """Keep detached copies of ``tensors`` as this client's ``name`` (replacing earlier ones)."""
    prefix = f"{PREFIX}{name}/"
    for key in [k for k in ctx.state if k.startswith(prefix)]:
        del ctx.state[key]
    ctx.state.update({prefix + k: v.detach().clone() for k, v in tensors.items()})


def personal_module(ctx: ClientContext, name: str, module: nn.Module) -> nn.Module:
    """Load this client's stored ``name`` into ``module`` (in place) when it has one; a client
    without one keeps ``module``'s current weights (the caller's initialisation). Returns it."""
    stored = load_personal(ctx, name)
    if stored is not None:
        module.load_state_dict(stored)
    return module


def fresh_linear(like: nn.Linear, generator: torch.Generator) -> nn.Linear:
    """A new linear layer shaped like ``like`` with ``nn.Linear``'s initialisation drawn from
    ``generator`` (so it does not depend on the global RNG)."""
    weight, bias = linear_init(like.in_features, like.out_features, generator)
    layer = torch.nn.utils.skip_init(nn.Linear, like.in_features, like.out_features, bias=like.bias is not None,
                                     device=like.weight.device)
    with torch.no_grad():
        layer.weight.copy_(weight)
        if layer.bias is not None:
            layer.bias.copy_(bias)
    return layer


def store_module(ctx: ClientContext, name: str, module: nn.Module) -> None:
    store_personal(ctx, name, module.state_dict())


def keys_with_prefix(state: dict[str, torch.Tensor], prefixes: Iterable[str]) -> dict[str, torch.Tensor]:
    prefixes = tuple(prefixes)
    return {k: v for k, v in state.items() if k.startswith(prefixes)}


def batchnorm_keys(model: nn.Module) -> list[str]:
    """``state_dict`` keys of every BatchNorm layer (affine weights and running statistics)."""
    keys = []
    for module_name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            keys += [f"{module_name}.{k}" if module_name else k for k in module.state_dict()]
    return keys


def train_on_features(
    ctx: ClientContext,
    params: list[nn.Parameter],
    logits: Callable[[torch.Tensor], torch.Tensor],
    epochs: int,
    *,
    features: tuple[torch.Tensor, torch.Tensor] | None = None,
    lr: float | None = None,
    momentum: float | None = None,
    weight_decay: float | None = None,
    purpose: int = 50,
) -> dict[str, float]:
    """Train ``params`` for ``epochs`` (cross-entropy) over the client's features under the frozen ``ctx.model``
    encoder (``features`` if given, else computed once: eval mode, no augmentation), the cheap way
    to fit a head on a fixed body. Batch size, lr, momentum and weight decay default to ``ctx.train``."""
    if epochs <= 0 or len(ctx.data) == 0:
        return {"steps": 0.0}
    feats, labels = features if features is not None else client_features(ctx.model, ctx)
    t = ctx.train
    optimizer = torch.optim.SGD(params, lr=t.lr if lr is None else lr, momentum=t.momentum if momentum is None else momentum,
                                weight_decay=t.weight_decay if weight_decay is None else weight_decay)
    generator = ctx.generator(purpose)
    steps = 0
    with torch.enable_grad():
        for _ in range(epochs):
            for rows in epoch_batches(feats.shape[0], t.batch_size, generator):
                value = nn.functional.cross_entropy(logits(feats[rows]), labels[rows])
                optimizer.zero_grad(set_to_none=True)
                value.backward()
                optimizer.step()
                steps += 1
    return {"steps": float(steps)}
