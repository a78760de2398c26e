"""fedlt messages and client state <-> Flower records, losslessly and for any method.

A value tree (nested dicts, lists and tuples of tensors, numpy arrays and scalars, scalars,
strings and None) becomes two records: an ``ArrayRecord`` with every tensor and array, and a ``ConfigRecord``
holding the tree's JSON skeleton, where each array is a reference into the ArrayRecord. Dict keys
keep their type, tensors come back as tensors and arrays as arrays, so decoding gives back exactly
what the method sent. Anything else cannot cross a network and is refused by name.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict

from fedlt.messages import Message, Reply

_ARRAYS, _TREE = "arrays", "tree"
#: torch dtypes numpy has no type for (bfloat16 of mixed precision, the float8s): they cross as the
#: integers of their size and are viewed back, bit for bit
_VIEWED = {dtype: {1: torch.uint8, 2: torch.int16}[dtype.itemsize] for dtype in
           (torch.bfloat16, *(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, name)))}


def _pack(value: Any, arrays: dict[str, Array], where: str) -> Any:
    if isinstance(value, torch.Tensor):
        key, tensor = str(len(arrays)), value.detach().cpu().contiguous()
        if tensor.dtype in _VIEWED:
            arrays[key] = Array(tensor.view(_VIEWED[tensor.dtype]).numpy())
            return {"viewed": [key, str(tensor.dtype).removeprefix("torch.")]}
        arrays[key] = Array(tensor.numpy())
        return {"tensor": key}
    if isinstance(value, (np.ndarray, np.generic)):  # a numpy scalar crosses as a 0-d array, and comes back one
        key = str(len(arrays))
        arrays[key] = Array(np.asarray(value, order="C"))  # not ascontiguousarray: it makes a 0-d array 1-d
        return {"ndarray" if isinstance(value, np.ndarray) else "npscalar": key}
    if isinstance(value, dict):
        if not all(isinstance(k, (str, int)) for k in value):
            raise TypeError(f"{where} has a dict key that is not a string or int; use string or int keys")
        return {"dict": [[k, _pack(v, arrays, f"{where}[{k!r}]")] for k, v in value.items()]}
    if type(value) in (list, tuple):  # a subclass (torch.Size, a namedtuple) would come back as neither
        return {type(value).__name__: [_pack(v, arrays, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, (str, bool, int, float)) or value is None:
        return {"value": value}
    hint = f", e.g. {'tuple' if isinstance(value, tuple) else 'list'}(...)" if isinstance(value, (list, tuple)) else ""
    raise TypeError(f"{where} is a {type(value).__name__}, which cannot cross a network; "
                    f"keep only tensors, arrays, scalars, strings and dicts or lists of them{hint}")


def _unpack(node: dict[str, Any], arrays: ArrayRecord, device: torch.device) -> Any:
    (tag, body), = node.items()
    if tag == "tensor":
        return torch.from_numpy(arrays[body].numpy().copy()).to(device)
    if tag == "viewed":
        key, dtype = body
        return torch.from_numpy(arrays[key].numpy().copy()).view(getattr(torch, dtype)).to(device)
    if tag == "ndarray":
        return arrays[body].numpy().copy()
    if tag == "npscalar":
        return arrays[body].numpy()[()]
    if tag == "dict":
        return {k: _unpack(v, arrays, device) for k, v in body}
    if tag in ("list", "tuple"):
        items = [_unpack(v, arrays, device) for v in body]
        return items if tag == "list" else tuple(items)
    return body


def put_tree(records: RecordDict, prefix: str, tree: dict[str, Any], where: str = "message") -> None:
    """Store ``tree`` in ``records`` under ``prefix`` (two records)."""
    arrays: dict[str, Array] = {}
    skeleton = _pack(tree, arrays, where)
    records[prefix + _ARRAYS] = ArrayRecord(arrays)
    records[prefix + _TREE] = ConfigRecord({"json": json.dumps(skeleton)})


def get_tree(records: RecordDict, prefix: str, device: torch.device) -> Any:
    """The tree ``put_tree`` stored under ``prefix``."""
    skeleton = json.loads(records[prefix + _TREE]["json"])
    return _unpack(skeleton, records[prefix + _ARRAYS], device)


def drop_tree(records: RecordDict, prefix: str) -> None:
    for key in (prefix + _ARRAYS, prefix + _TREE):
        if key in records:
            del records[key]


def has_tree(records: RecordDict, prefix: str) -> bool:
    return prefix + _TREE in records


def encode_message(msg: Message | Reply, meta: dict[str, Any]) -> RecordDict:
    """A Message or Reply plus routing facts (``meta``: kind, client id, round ...) as a RecordDict."""
    records = RecordDict({"meta": ConfigRecord({"json": json.dumps(meta)})})
    tree = {"weights": msg.weights, "payload": msg.payload}
    if isinstance(msg, Reply):
        tree.update(num_samples=msg.num_samples, metrics=msg.metrics)
    put_tree(records, "", tree)
    return records


def decode_meta(records: RecordDict) -> dict[str, Any]:
    return json.loads(records["meta"]["json"])


def decode_message(records: RecordDict, device: torch.device) -> Message:
    tree = get_tree(records, "", device)
    return Message(weights=tree["weights"], payload=tree["payload"])


def decode_reply(records: RecordDict, device: torch.device) -> Reply:
    tree = get_tree(records, "", device)
    return Reply(weights=tree["weights"], num_samples=tree["num_samples"], payload=tree["payload"],
                 metrics=tree["metrics"])
