"""Models as data: what a server sends a node so that the node evaluates a model it cannot build
from the method alone.

A calibrated variant (CCVR's re-trained head, FedNCM's normalised class means, FedLoGe's other
global head) is the method's model with another head module swapped in. A node builds only the
method's own architecture, so the head travels as a description of its modules plus their
tensors: a linear layer, an L2 normalisation, a sequence of those, or a head of the model's own
kind. Anything else is refused with the head's type named, never silently evaluated as another.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn

from fedlt.calibration.calibrators import L2Normalize
from fedlt.errors import FedltError
from fedlt.models import FedModel

#: a head module described as data: {"kind": ..., "tensors": {...}} or {"kind": "sequence", "parts": [...]}
HeadData = dict[str, Any]


def encode_head(head: nn.Module, own: type[nn.Module]) -> HeadData:
    """``head`` as a kind and its tensors; ``own`` is the class of the method's own head."""
    if type(head) is own:
        return {"kind": "own", "tensors": _detached(head.state_dict())}
    if isinstance(head, nn.Linear):
        return {"kind": "linear", "tensors": _detached(head.state_dict())}
    if isinstance(head, L2Normalize):
        return {"kind": "l2normalize", "tensors": {}}
    if isinstance(head, nn.Sequential):
        return {"kind": "sequence", "parts": [encode_head(part, own) for part in head]}
    raise FedltError(f"a {type(head).__name__} head cannot be sent to the nodes for evaluation; give the server a "
                     "test set (eval.test_data=PATH) to evaluate this model there")


def decode_head(data: HeadData, own_head: nn.Module) -> nn.Module:
    """The head module described by ``data``; ``own_head`` is a fresh head of the method's own kind."""
    kind = data["kind"]
    if kind == "own":
        own_head.load_state_dict(data["tensors"])
        return own_head
    if kind == "linear":
        weight = data["tensors"]["weight"]
        head = nn.Linear(weight.shape[1], weight.shape[0], bias="bias" in data["tensors"]).to(weight.device)
        head.load_state_dict(data["tensors"])
        return head
    if kind == "l2normalize":
        return L2Normalize()
    if kind == "sequence":
        return nn.Sequential(*(decode_head(part, own_head) for part in data["parts"]))
    raise FedltError(f"unknown head kind '{kind}' in an evaluation message; the server and this node run "
                     "different fedlt versions: install the same one on both")


def encode_model(model: FedModel, own: type[nn.Module]) -> dict[str, Any]:
    """A model as its encoder's tensors and its head's description."""
    encoder = {k: v.detach() for k, v in model.state_dict().items() if k.startswith("encoder.")}
    return {"encoder": encoder, "head": encode_head(model.head, own)}


def decode_model(data: dict[str, Any], like: FedModel) -> FedModel:
    """The model described by ``data``, built on a copy of ``like`` (the method's own model)."""
    model = copy.deepcopy(like)
    model.load_state_dict(data["encoder"], strict=False)
    model.head = decode_head(data["head"], model.head)
    return model.to(next(like.parameters()).device)


def _detached(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in state.items()}
