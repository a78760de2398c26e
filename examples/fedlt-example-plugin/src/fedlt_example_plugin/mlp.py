"""Model ``mlp``: a two-layer perceptron on the flattened image, as a fedlt model.

A model is a :class:`fedlt.models.FedModel`: an ``encoder`` from images (B, C, H, W) to flat
features (B, feature_dim) and a linear ``head`` to the logits. The builder takes the dataset's
``num_classes``, ``in_channels`` and ``image_size``; the entry point names a ``ModelEntry``: the
builder, its line in ``fedlt models``, and the images it takes.
"""

from __future__ import annotations

from torch import nn

from fedlt.models import FedModel
from fedlt.models.registry import ModelEntry, ModelInput


def mlp(num_classes: int, in_channels: int = 3, image_size: int = 32, hidden: int = 256) -> FedModel:
    encoder = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size * image_size, hidden), nn.ReLU())
    return FedModel(encoder, feature_dim=hidden, num_classes=num_classes)


ENTRY = ModelEntry(mlp, "two-layer perceptron on the flattened image, 256-d feature", ModelInput(min_image_size=1))
