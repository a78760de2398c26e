"""Aggregation of client updates."""

from __future__ import annotations

import torch

from fedlt import fused
from fedlt.messages import Reply


#: devices where a reply's weighted entries are written into the previous reply's instead of new tensors:
#: an allocation per tensor costs a GPU's host more than a copy into an existing one; a CPU, less
REWRITTEN_ON = frozenset({"cuda"})
#: dtypes whose in-place product by a sample count is the new tensor's, bit for bit (an in-place
#: half-precision product rounds the factor to the tensor's dtype first)
EXACT_IN_PLACE = frozenset({torch.float32, torch.float64, torch.int64})


def weighted_average(replies: dict[int, Reply], keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """FedAvg: per-entry average of the replies' weights, weighted by ``num_samples``.

    Every entry present in the replies (parameters and BatchNorm buffers) is averaged over the
    replies that carry it, so methods that send a subset of the model (personal heads kept local)
    aggregate correctly. Integer buffers (BatchNorm's ``num_batches_tracked``) are summed exactly in
    int64 and their mean rounded back (the float64 sum they once took gave the same wherever it was
    exact). Replies with zero samples are ignored. On a GPU each new tensor is host time per client:
    there a round converts each integer buffer once and makes two tensors per entry, however many replies.
    """
    sums: dict[str, torch.Tensor] = {}
    terms: dict[str, torch.Tensor] = {}  # a reply's weighted entry, made once and rewritten by later replies
    totals: dict[str, float] = {}
    dtypes: dict[str, torch.dtype] = {}
    for cid in sorted(replies):
        reply = replies[cid]
        if reply.num_samples <= 0:
            continue
        names = [name for name in reply.weights if keys is None or name in keys]
        values = [v if v.is_floating_point() or v.dtype == torch.int64 else v.to(torch.int64)
                  for v in (reply.weights[name] for name in names)]
        first = [i for i, name in enumerate(names) if name not in sums]
        later = [i for i, name in enumerate(names) if name in sums]
        fresh = [i for i in later if names[i] not in terms or values[i].device.type not in REWRITTEN_ON
                 or values[i].dtype not in EXACT_IN_PLACE]
        reused = [i for i in later if i not in fresh]
        with torch.no_grad():  # as detached values: one switch, not a detach per tensor
            # the same products either way: new tensors, or on a GPU the last reply's rewritten in place
            products = fused.scaled([values[i] for i in first + fresh], reply.num_samples)
            for i, product in zip(first + fresh, products):
                if i in fresh:
                    terms[names[i]] = product
                else:
                    sums[names[i]], dtypes[names[i]] = product, reply.weights[names[i]].dtype
            fused.copy_([terms[names[i]] for i in reused], [values[i] for i in reused])
            fused.mul_([terms[names[i]] for i in reused], reply.num_samples)
            fused.add_([sums[names[i]] for i in later], [terms[names[i]] for i in later])
        for name in names:
            totals[name] = totals.get(name, 0.0) + reply.num_samples
    out = {}
    for name, total in sums.items():
        if dtypes[name].is_floating_point:
            out[name] = (total / totals[name]).to(dtypes[name])
        else:
            out[name] = (total.to(torch.float64) / totals[name]).round().to(dtypes[name])
    return out
