"""The encoder/head split shared by every model.

Federated long-tail methods act on the two halves separately: FedRep/FedPer keep the head
local, FedBABU freezes it, CReFF and CCVR re-train it on calibrated features, FedETF swaps it
for a fixed simplex. Every model in fedlt is therefore a :class:`FedModel`, whose
``state_dict`` keys start with ``encoder.`` or ``head.`` and nothing else.
"""

from __future__ import annotations

import torch
from torch import nn


class FedModel(nn.Module):
    """An image classifier split into a feature ``encoder`` and a classifier ``head``.

    Parameters
    ----------
    encoder : maps images (B, C, H, W) to flat features (B, feature_dim)
    feature_dim : width of the encoder output
    num_classes : number of logits the head produces
    head : maps features to logits; defaults to ``nn.Linear(feature_dim, num_classes)``
    """

    def __init__(self, encoder: nn.Module, feature_dim: int, num_classes: int, head: nn.Module | None = None) -> None:
        super().__init__()
        self.encoder = encoder
        self.head = head if head is not None else nn.Linear(feature_dim, num_classes)
        self.feature_dim = feature_dim
        self.num_classes = num_classes

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def forward_head(self, features: torch.Tensor) -> torch.Tensor:
        return self.head(features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))

    def head_parameter_names(self) -> list[str]:
        """``state_dict`` keys of the head (buffers included: methods exchange state dicts)."""
        return ["head." + key for key in self.head.state_dict()]

    def encoder_parameter_names(self) -> list[str]:
        """``state_dict`` keys of the encoder (buffers such as BN running stats included)."""
        return ["encoder." + key for key in self.encoder.state_dict()]

    def replace_head(self, new_head: nn.Module) -> nn.Module:
        """Install ``new_head`` and return the old one, so callers can swap heads back.

        The head stays registered under the name ``head``, so ``state_dict`` keys keep their
        prefix. The caller moves ``new_head`` to the model's device. A linear head of the
        wrong shape is rejected here rather than failing later inside a training step.
        """
        if isinstance(new_head, nn.Linear) and (new_head.in_features, new_head.out_features) != (
            self.feature_dim,
            self.num_classes,
        ):
            raise ValueError(
                f"head must map {self.feature_dim} features to {self.num_classes} classes, "
                f"got Linear({new_head.in_features}, {new_head.out_features})"
            )
        old_head = self.head
        self.head = new_head
        return old_head
