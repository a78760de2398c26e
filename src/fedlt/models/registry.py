"""Model names a config may use, and the one place that builds a model from a name."""

from __future__ import annotations

import inspect
from collections import OrderedDict
from typing import Any, Callable

from fedlt.errors import ConfigError
from fedlt.models.base import FedModel
from fedlt.models.cnn import cnn
from fedlt.models.resnet import resnet8, resnet18, resnet32, resnet34, resnet50

ModelBuilder = Callable[..., FedModel]

MIN_IMAGE_SIZE = 8

MODELS: OrderedDict[str, tuple[ModelBuilder, str]] = OrderedDict(
    [
        ("cnn", (cnn, "small CNN, 2 conv + FC, 128-d feature (~150k params, CPU default)")),
        ("resnet8", (resnet8, "ResNet-8 of CReFF/FedYoYo, 256-d feature (~1.2M params)")),
        ("resnet18", (resnet18, "CIFAR-style ResNet-18, 512-d feature (~11.2M params)")),
        ("resnet32", (resnet32, "LDAM-style ResNet-32, 64-d feature (~0.47M params)")),
        ("resnet34", (resnet34, "CIFAR-style ResNet-34, 512-d feature (~21.3M params)")),
        ("resnet50", (resnet50, "bottleneck ResNet-50, 2048-d feature (~23.5M params)")),
    ]
)


def list_models() -> list[tuple[str, str]]:
    """``(name, description)`` pairs in registry order, for ``fedlt list`` style output."""
    return [(name, description) for name, (_, description) in MODELS.items()]


def create_model(
    name: str, num_classes: int, in_channels: int = 3, image_size: int = 32, **kwargs: Any
) -> FedModel:
    """Build the model registered as ``name``; bad input raises a one-line :class:`ConfigError`."""
    if name not in MODELS:
        valid = ", ".join(MODELS)
        raise ConfigError(f"unknown model {name!r}: use model.name=<one of {valid}>")
    if num_classes < 1:
        raise ConfigError(f"num_classes must be >= 1, got {num_classes}: check the dataset's classes")
    if in_channels < 1:
        raise ConfigError(f"in_channels must be >= 1, got {in_channels}: check the dataset's images")
    if image_size < MIN_IMAGE_SIZE:
        raise ConfigError(
            f"image_size must be >= {MIN_IMAGE_SIZE}, got {image_size}: resize the images to at least "
            f"{MIN_IMAGE_SIZE}x{MIN_IMAGE_SIZE}"
        )
    builder = MODELS[name][0]
    options = set(inspect.signature(builder).parameters) - {"num_classes", "in_channels", "image_size"}
    unknown = sorted(set(kwargs) - options)
    if unknown:
        accepted = ", ".join(sorted(options)) or "none"
        raise ConfigError(f"model {name!r} does not take option(s) {', '.join(unknown)}: accepted options are {accepted}")
    return builder(num_classes=num_classes, in_channels=in_channels, image_size=image_size, **kwargs)
