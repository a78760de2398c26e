"""The only things that cross the network between server and clients.

Methods exchange plain values — named tensors, scalars and small config values — so the same
algorithm runs in-process and over Flower. Traffic is measured from these objects.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from fedlt.errors import PluginError

Payload = dict[str, Any]


def payload_nbytes(payload: Payload) -> int:
    """Bytes a payload takes on the wire: tensor data, 8 bytes per scalar, UTF-8 for strings.

    Anything else (a module, an optimiser, a callable) could not cross a real network, so it is
    refused here — every in-process message is measured — rather than later under Flower.
    """
    total = 0
    for value in payload.values():
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, np.ndarray):
            total += value.nbytes
        elif isinstance(value, dict):
            total += payload_nbytes(value)
        elif isinstance(value, (list, tuple)):
            total += payload_nbytes(dict(enumerate(value)))
        elif isinstance(value, str):
            total += len(value.encode())
        elif isinstance(value, (bool, int, float)):
            total += 8
        elif value is not None:
            raise TypeError(f"a message cannot carry a {type(value).__name__}; send tensors, arrays, scalars or strings")
    return total


@dataclass
class Message:
    """Server -> client: model weights (possibly a subset of the state dict) and a method payload."""

    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    payload: Payload = field(default_factory=dict)

    def nbytes(self) -> tuple[int, int]:
        """(model-weight bytes, method-payload bytes)."""
        return payload_nbytes(self.weights), payload_nbytes(self.payload)


@dataclass
class Reply:
    """Client -> server: an update (weights), how many samples it is worth, a payload, metrics.

    ``metrics`` are diagnostics (training loss, ...) that a real deployment also reports; they are
    counted as payload traffic.
    """

    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    num_samples: int = 0
    payload: Payload = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def nbytes(self) -> tuple[int, int]:
        return payload_nbytes(self.weights), payload_nbytes(self.payload) + payload_nbytes(self.metrics) + 8


def check_reply(reply: Any, where: str) -> None:
    """A client hook's answer is a :class:`Reply`; anything else fails deep in the engine."""
    if not isinstance(reply, Reply):
        raise PluginError(f"{where} returned {type(reply).__name__}; a client hook returns a fedlt.messages.Reply")


@dataclass
class Query:
    """An extra round-trip a method asks for (statistics, gradients, priors ...).

    ``messages`` maps client id -> what that client receives; the clients answer through
    ``Client.query(name, ...)`` and the server gets the replies in ``Server.receive``.
    """

    name: str
    messages: dict[int, Message]


def describe_message(msg: Message | Reply) -> dict[str, Any]:
    """What one message carries, entry by entry: shape, dtype and bytes (for the results' record
    of what each method really sends)."""

    def entry(value: Any) -> dict[str, Any]:
        if isinstance(value, torch.Tensor):
            return {"shape": list(value.shape), "dtype": str(value.dtype).removeprefix("torch."),
                    "bytes": value.numel() * value.element_size()}
        shown = value if isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) <= 64) \
            else type(value).__name__  # long strings (keys, ciphertexts) by size only
        return {"value": shown, "bytes": payload_nbytes({"v": value})}

    model_bytes, payload_bytes = msg.nbytes()
    out: dict[str, Any] = {
        "model_bytes": model_bytes,
        "model_entries": len(msg.weights),
        "payload": {k: entry(v) for k, v in msg.payload.items()},
        "payload_bytes": payload_bytes,
    }
    if isinstance(msg, Reply):
        out["metrics"] = sorted(msg.metrics)
    return out
