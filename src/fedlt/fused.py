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
    """Detached copies of ``tensors`` in their memory format, as ``t.detach().clone()`` makes them.
    A group of real or integer tensors is copied by one multiplication by 1, exact in those dtypes (a
    NaN stays a NaN, its payload the arithmetic's; subnormals too, unless torch.set_flush_denormal is on):
    its copies are allocated inside that one call instead of by an ``empty_like`` each from Python,
    the most frequent host operation of a client's message and reply. Other dtypes (bool, complex,
    where 1 is not an identity factor; float8, which has no such kernel) are copied one allocation at a time."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    with torch.no_grad():
        for group in groups(tensors):
            members = [tensors[i] for i in group]
            dtype = members[0].dtype
            if dtype.is_complex or dtype == torch.bool or (dtype.is_floating_point and dtype.itemsize == 1):
                made = [torch.empty_like(t) for t in members]
                torch._foreach_copy_(made, members)
            else:
                made = torch._foreach_mul(members, 1)
            for i, copy in zip(group, made):
                out[i] = copy
    return out


def packed_clones(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Detached copies of ``tensors``, as ``clones`` makes them (same values, shapes and strides), with
    the dense ones of each device and dtype laid out in one new buffer and copied in one fused call;
    and the buffers. What a client hands back to another stream then needs one allocation and one
    ``record_stream`` a group, where ``clones`` makes (and a caller marks) one a tensor: on a GPU each
    mark becomes an event the caching allocator records and polls. A copy keeps its whole buffer
    alive: for copies that are consumed together, not kept one by one."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    buffers = []
    with torch.no_grad():
        for group in groups(tensors):
            dense = [i for i in group if _dense(tensors[i])]
            if len(dense) > 1:
                first = tensors[dense[0]]
                align = max(1, ALIGNMENT // first.element_size())
                offsets, size = [], 0
                for i in dense:
                    offsets.append(size)
                    size += -(-tensors[i].numel() // align) * align
                buffers.append(torch.empty(size, dtype=first.dtype, device=first.device))
                views = [buffers[-1].as_strided(tensors[i].shape, tensors[i].stride(), offset)
                         for i, offset in zip(dense, offsets)]
                torch._foreach_copy_(views, [tensors[i] for i in dense])
                for i, view in zip(dense, views):
                    out[i] = view
            rest = [i for i in group if out[i] is None]
            for i, copy in zip(rest, clones([tensors[i] for i in rest])):
                out[i] = copy
                buffers.append(copy)
    return out, buffers


#: bytes each packed copy starts on a multiple of, so that later fused kernels read it with vector loads
ALIGNMENT = 16


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t``'s elements fill a span of storage of its size with no gaps or overlaps (contiguous in
    some memory format), so that a view with its strides fits in ``numel`` elements of a buffer."""
    return t.is_contiguous() or (t.dim() == 4 and t.is_contiguous(memory_format=torch.channels_last)) \
        or (t.dim() == 5 and t.is_contiguous(memory_format=torch.channels_last_3d))


def scaled(tensors: list[torch.Tensor], factor: float) -> list[torch.Tensor]:
    """``t * factor`` for each tensor (new tensors)."""
    out: list[torch.Tensor | None] = [None] * len(tensors)
    for group in groups(tensors):
        for i, product in zip(group, torch._foreach_mul([tensors[i] for i in group], factor)):
            out[i] = product
    return out


def mul_(tensors: list[torch.Tensor], factor: float) -> None:
    """``t *= factor`` for each tensor."""
    for group in groups(tensors):
        torch._foreach_mul_([tensors[i] for i in group], factor)


def add_(totals: list[torch.Tensor], terms: list[torch.Tensor]) -> None:
    """``total += term`` for each pair."""
    for group in groups(totals, terms):
        torch._foreach_add_([totals[i] for i in group], [terms[i] for i in group])
