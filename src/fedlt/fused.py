"""A model's state is hundreds of small tensors (a ResNet-32's 200 parameters and BatchNorm
buffers). Copying or summing them one by one costs a kernel launch and a Python call each: on a GPU
that host time, not the arithmetic, is what a client's start, its reply and the aggregation take.
These helpers do the same per-element arithmetic with ``torch._foreach_*`` ops, one fused call per
group of tensors that share a device and dtype (a mixed list would fall back to one kernel per
tensor), so results are bitwise those of the one-by-one loops."""

from __future__ import annotations

from collections import defaultdict

import torch


def groups(*lists: list[torch.Tensor]) -> list[list[int]]:
    """Positions of the tensors of ``lists`` (equally long) grouped by every list's device and dtype,
    in order of first appearance. Torch's own grouping (the optimizers') does it in C++, several times
    faster than reading each tensor's device and dtype from Python (a ResNet-32's 200 tensors, six
    times per client); it refuses lists that disagree at a position, which are grouped here."""
    try:
        grouped = torch._C._group_tensors_by_device_and_dtype([list(ts) for ts in lists], True)
        return sorted((list(indices) for _, indices in grouped.values()), key=lambda group: group[0])
    except RuntimeError:  # another device or dtype at the same position of two lists
        found: dict[tuple, list[int]] = defaultdict(list)
        for i, ts in enumerate(zip(*lists)):
            found[tuple((t.device, t.dtype) for t in ts)].append(i)
        return list(found.values())


def copy_(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """``d.copy_(s)`` for each pair, without recording autograd history (parameters included)."""
    with torch.no_grad():
        for group in groups(destinations, sources):
            torch._foreach_copy_([destinations[i] for i in group], [sources[i] for i in group])


def clones(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Detached copies of ``tensors`` in their memory format, as ``t.detach().clone()`` makes them."""
    out = [torch.empty_like(t, requires_grad=False) for t in tensors]
    copy_(out, tensors)
    return out


def scaled(tensors: list[torch.Tensor], factor: float) -> list[torch.Tensor]:
    """``t * factor`` for each tensor (new tensors)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for group in groups(tensors):
        for i, product in zip(group, torch._foreach_mul([tensors[i] for i in group], factor)):
            out[i] = product
    return out


def add_(totals: list[torch.Tensor], terms: list[torch.Tensor]) -> None:
    """``total += term`` for each pair."""
    for group in groups(totals, terms):
        torch._foreach_add_([totals[i] for i in group], [terms[i] for i in group])
