"""Re-training a linear classifier on fixed features with mini-batch SGD.

The last step of classifier calibration: CReFF re-trains on its federated features (Eq. 7 of
Shang et al., IJCAI 2022), CCVR on virtual features sampled from class Gaussians, and the
decoupled-training baseline (cRT, Kang et al. ICLR 2020) on real features with class-balanced
sampling.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F

from fedlt.calibration.math.stats import validate_features


def linear_init(in_features: int, out_features: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``nn.Linear``'s default initialisation, drawn from ``generator`` (on its device).

    ``nn.Linear`` uses kaiming-uniform with ``a = sqrt(5)`` for the weight and U(-1/sqrt(d),
    1/sqrt(d)) for the bias; the former also reduces to U(-1/sqrt(d), 1/sqrt(d)).
    """
    bound = 1.0 / math.sqrt(in_features) if in_features > 0 else 0.0
    weight = torch.rand(out_features, in_features, generator=generator, device=generator.device) * 2 - 1
    bias = torch.rand(out_features, generator=generator, device=generator.device) * 2 - 1
    return weight * bound, bias * bound


def _batches(
    labels: torch.Tensor, batch_size: int, balanced: bool, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """Endless stream of index batches (on the generator's device).

    Plain: epochs of a fresh permutation cut into batches of ``batch_size`` (the last one of an
    epoch may be smaller). Balanced: each sample drawn with probability proportional to
    ``1 / n_y``, i.e. a uniformly drawn class then a uniform sample of it, with replacement.
    """
    labels = labels.to(generator.device)
    n = labels.shape[0]
    if balanced:
        weights = 1.0 / torch.bincount(labels).to(torch.float64)[labels]
        while True:
            yield torch.multinomial(weights, batch_size, replacement=True, generator=generator)
    else:
        while True:
            # a batch past the samples is all of them (torch cannot take a split size past 64 bits)
            yield from torch.randperm(n, generator=generator, device=generator.device).split(min(batch_size, n))


def retrain_linear(
    features: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    *,
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    steps: int,
    lr: float,
    batch_size: int,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    generator: torch.Generator,
    balanced: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Train ``(weight (C, d), bias (C,))`` by ``steps`` SGD steps on the cross-entropy.

    ``init`` is the starting classifier (copied, never modified); ``None`` draws a fresh
    ``nn.Linear``-style one from ``generator``. Batches come from ``generator`` too, reshuffled
    every epoch, or class-balanced when ``balanced`` (see :func:`_batches`), so a seed fixes the
    result. Runs on the features' device; returns detached float32 tensors.
    """
    validate_features(features, labels, num_classes)
    if features.shape[0] == 0:
        raise ValueError("retrain_linear needs at least one sample")
    if steps < 0 or batch_size < 1:
        raise ValueError(f"need steps >= 0 and batch_size >= 1, got {steps} and {batch_size}")
    device = features.device
    if init is None:
        init = linear_init(features.shape[1], num_classes, generator)
    weight = init[0].detach().to(device=device, dtype=torch.float32).clone().requires_grad_(True)
    bias = init[1].detach().to(device=device, dtype=torch.float32).clone().requires_grad_(True)
    if weight.shape != (num_classes, features.shape[1]) or bias.shape != (num_classes,):
        raise ValueError(
            f"init must be ({num_classes}, {features.shape[1]}) and ({num_classes},), "
            f"got {tuple(weight.shape)} and {tuple(bias.shape)}"
        )
    x = features.detach().to(torch.float32)
    optimizer = torch.optim.SGD([weight, bias], lr=lr, momentum=momentum, weight_decay=weight_decay)
    batches = _batches(labels, batch_size, balanced, generator)
    with torch.enable_grad():
        for _ in range(steps):
            idx = next(batches).to(device)
            loss = F.cross_entropy(x[idx] @ weight.T + bias, labels[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return weight.detach(), bias.detach()
