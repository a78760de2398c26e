"""The small CNN: fedlt's CPU default.

Two 3x3 conv/pool stages and a 128-d fully connected feature layer (about 150k parameters)
train in seconds per round on two CPU cores. An adaptive pool to 4x4 before the FC layer
makes the parameter count independent of the image size, so MNIST-like 28x28 and CIFAR-like
32x32 inputs share one architecture.
"""

from __future__ import annotations

from torch import nn

from fedlt.models.base import FedModel

FEATURE_DIM = 128


class CNNEncoder(nn.Sequential):
    """conv 32 -> pool -> conv 64 -> pool -> adaptive pool 4x4 -> FC 128 (ReLU)."""

    def __init__(self, in_channels: int, feature_dim: int = FEATURE_DIM) -> None:
        super().__init__(
            nn.Conv2d(in_channels, 32, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.Conv2d(32, 64, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(2),
            nn.AdaptiveAvgPool2d(4),
            nn.Flatten(),
            nn.Linear(64 * 4 * 4, feature_dim),
            nn.ReLU(inplace=True),
        )


def cnn(num_classes: int, in_channels: int = 3, image_size: int = 32) -> FedModel:
    """Small CNN with a 128-d feature; ``image_size`` only shares the builder signature."""
    return FedModel(CNNEncoder(in_channels), FEATURE_DIM, num_classes)
