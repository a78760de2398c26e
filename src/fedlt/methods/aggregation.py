"""Aggregation of client updates."""

from __future__ import annotations

import torch

from fedlt import fused
from fedlt.messages import Reply


def weighted_average(replies: dict[int, Reply], keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """FedAvg: per-entry average of the replies' weights, weighted by ``num_samples``.

    Every entry present in the replies (parameters and BatchNorm buffers) is averaged over the
    replies that carry it, so methods that send a subset of the model (personal heads kept local)
    aggregate correctly. Integer buffers (BatchNorm's ``num_batches_tracked``) are averaged in
    float and rounded back. Replies with zero samples are ignored.
    """
    sums: dict[str, torch.Tensor] = {}
    totals: dict[str, float] = {}
    dtypes: dict[str, torch.dtype] = {}
    for cid in sorted(replies):
        reply = replies[cid]
        if reply.num_samples <= 0:
            continue
        names = [name for name in reply.weights if keys is None or name in keys]
        values = [reply.weights[name] for name in names]
        with torch.no_grad():  # as detached values: one switch, not a detach per tensor
            weighted = fused.scaled([v if v.is_floating_point() or v.dtype == torch.int64 else v.to(torch.int64)
                                     for v in values], reply.num_samples)
            seen = [i for i, name in enumerate(names) if name in sums]
            fused.add_([sums[names[i]] for i in seen], [weighted[i] for i in seen])
        for name, value, term in zip(names, values, weighted):
            if name not in sums:
                sums[name], dtypes[name] = term, value.dtype
            totals[name] = totals.get(name, 0.0) + reply.num_samples
    out = {}
    for name, total in sums.items():
        if dtypes[name].is_floating_point:
            out[name] = (total / totals[name]).to(dtypes[name])
        else:
            out[name] = (total.to(torch.float64) / totals[name]).round().to(dtypes[name])
    return out
