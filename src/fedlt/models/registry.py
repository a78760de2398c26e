"""Model names a config may use, the images each model takes, and the one place that builds a
model from a name.

Every entry declares its input (:class:`ModelInput`), so ``check_config`` can refuse a model x
dataset pair from the registries alone, before any data are read. A model from outside the package
declares its own, in a ``fedlt.models`` entry point that names a :class:`ModelEntry` (found by every
process: bench workers, ``run.backend=parallel``, Flower's nodes), or in code, for this process only::

    MODELS["mine"] = ModelEntry(builder, "my network, 512-d feature", ModelInput(min_image_size=32, channels=(3,)))

(a plain ``(builder, description)`` pair gets :data:`DEFAULT_INPUT`). Each time such a model is built,
before it trains, it runs on two blank images, so a broken encoder/head contract is one line, not a
shape error deep in training.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, Protocol

import torch

from fedlt.config import DataConfig
from fedlt.errors import ConfigError
from fedlt.plugins import PluginRegistry
from fedlt.models.base import FedModel
from fedlt.models.cnn import cnn
from fedlt.models.resnet import resnet8, resnet18, resnet32, resnet34, resnet50

ModelBuilder = Callable[..., FedModel]

#: fedlt's floor for an image side: the smallest its models are trained on in its tests
MIN_IMAGE_SIZE = 8


@dataclass(frozen=True)
class ModelInput:
    """The images a model takes.

    Attributes
    ----------
    min_image_size : smallest image side it trains and evaluates on with any batch, one sample
        included (a client may hold a single image)
    channels : the channel counts it accepts; None: any (its first layer is built for the data's)
    why : what sets ``min_image_size``, for the refusal
    """

    min_image_size: int = MIN_IMAGE_SIZE
    channels: tuple[int, ...] | None = None
    why: str = ""

    def refusal(self, channels: int, image_size: int) -> str | None:
        """What these images lack for the model, or None when it takes them."""
        if self.channels is not None and channels not in self.channels:
            return f"takes {' or '.join(map(str, self.channels))}-channel images only"
        if image_size < self.min_image_size:
            why = f" ({self.why})" if self.why else ""
            return f"needs images of at least {self.min_image_size}x{self.min_image_size}{why}"
        return None


#: what a model registered without a declaration is assumed to take
DEFAULT_INPUT = ModelInput(why="fedlt's smallest image side")


class ModelEntry(NamedTuple):
    """A registered model: how to build it, one line for ``fedlt models``, what images it takes."""

    builder: ModelBuilder
    description: str
    input: ModelInput = DEFAULT_INPUT


# Measured by training each model on 1..69 px inputs, 1 and 3 channels, batches of one and two
# samples: the CNN's two 2x2 max-pools need 4 px; BatchNorm cannot train a one-sample batch on a
# 1x1 map, which a ResNet's last stage reaches below 5 px (three stages) or 9 px (four stages;
# ResNet-50's ImageNet stem from 64 px quarters the side first, and still leaves 2x2). The
# three-stage networks and the CNN run below fedlt's floor of 8 px but are declared at it.
_FOUR_STAGES = ModelInput(9, why="four stride-2 stages leave a 1x1 map, on which BatchNorm cannot train "
                                 "a client's single image")

def model_from_plugin(name: str, loaded: object) -> ModelEntry:
    """What a ``fedlt.models`` entry point loads: a :class:`ModelEntry` (or a ``(builder, description)`` pair)."""
    if isinstance(loaded, tuple) and len(loaded) in (2, 3) and callable(loaded[0]) and isinstance(loaded[1], str):
        return ModelEntry(*loaded)
    raise TypeError(f"loads an object of type {type(loaded).__name__}, not a fedlt.models.registry.ModelEntry; point "
                    "the entry point at ModelEntry(builder, description, ModelInput(...))")


MODELS: PluginRegistry[ModelEntry] = PluginRegistry("fedlt.models", "model", OrderedDict(
    [
        ("cnn", ModelEntry(cnn, "small CNN, 2 conv + FC, 128-d feature (~150k params, CPU default)")),
        ("resnet8", ModelEntry(resnet8, "ResNet-8 of CReFF/FedYoYo, 256-d feature (~1.2M params)")),
        ("resnet18", ModelEntry(resnet18, "CIFAR-style ResNet-18, 512-d feature (~11.2M params)", _FOUR_STAGES)),
        ("resnet32", ModelEntry(resnet32, "LDAM-style ResNet-32, 64-d feature (~0.47M params)")),
        ("resnet34", ModelEntry(resnet34, "CIFAR-style ResNet-34, 512-d feature (~21.3M params)", _FOUR_STAGES)),
        ("resnet50", ModelEntry(resnet50, "bottleneck ResNet-50, 2048-d feature (~23.5M params)", _FOUR_STAGES)),
    ]
), model_from_plugin)


def list_models() -> list[tuple[str, str]]:
    """``(name, description)`` pairs in registry order, for ``fedlt models``; a plug-in's names its distribution."""
    return [(name, entry[1] + (f" [plug-in: {origin}]" if (origin := MODELS.origin(name)) else ""))
            for name, entry in MODELS.items()]


def model_input(name: str) -> ModelInput:
    """The declared input of registered model ``name`` (:data:`DEFAULT_INPUT` for a plain pair)."""
    entry = MODELS[name]
    return entry[2] if len(entry) > 2 else DEFAULT_INPUT


class ImageSource(Protocol):
    """What a dataset's registry entry says about its images (``fedlt.data.registry.DatasetInfo``)."""

    channels: int
    image_size: int
    resizable: bool


def dataset_images(info: ImageSource, requested: int | None) -> tuple[int, int]:
    """``(channels, side)`` of a dataset's images at ``data.image_size`` = ``requested``: the
    request where the dataset is resized, else its own side (its loader refuses another)."""
    return info.channels, (requested if info.resizable and requested is not None else info.image_size)


def input_refusal(model: str, dataset: str, info: ImageSource, requested: int | None = None) -> str | None:
    """Why ``model`` cannot take ``dataset``'s images (registry entry ``info``, ``data.image_size`` =
    ``requested``), with what would work; None when it can. Reads no data. A size the dataset
    does not come in is refused here too, as its loader would refuse it only once it reads."""
    channels, side = dataset_images(info, requested)
    if requested is not None and requested != side:
        return (f"{dataset}: images are {side}x{side} and are not resized, but data.image_size={requested}; "
                f"drop data.image_size or set it to {side}")
    declared = model_input(model)
    why = declared.refusal(channels, side)
    if why is None:
        return None
    fixes = []
    if info.resizable and (declared.channels is None or channels in declared.channels):
        fixes.append(f"data.image_size>={declared.min_image_size}")
    working = [name for name in MODELS if model_input(name).refusal(channels, side) is None]
    if working:
        fixes.append(f"model.name=<one of {', '.join(working)}>")
    fix = " or ".join(fixes) if fixes else "choose a model and dataset whose images match"
    return f"model {model} + dataset {dataset} ({channels}x{side}x{side} images): {model} {why}; use {fix}"


def check_model_input(model: str, data: DataConfig, info: ImageSource) -> None:
    """A one-line ConfigError when ``model`` cannot take the images of ``data.dataset`` (entry ``info``)."""
    refusal = input_refusal(model, data.dataset, info, data.image_size)
    if refusal:
        raise ConfigError(refusal)


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
    declared = model_input(name)
    if declared.channels is not None and in_channels not in declared.channels:
        raise ConfigError(f"model {name!r} {declared.refusal(in_channels, image_size)}, got {in_channels}: "
                          "use a model that takes the dataset's images")
    if image_size < declared.min_image_size:
        size = declared.min_image_size
        raise ConfigError(f"image_size must be >= {size} for model {name!r}, got {image_size}: resize the images to "
                          f"at least {size}x{size} or use a model that takes smaller ones")
    builder = MODELS[name][0]
    parameters = inspect.signature(builder).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    if missing := [k for k in ("num_classes", "in_channels", "image_size") if k not in parameters and not takes_any]:
        raise ConfigError(f"model {name!r}: its builder {getattr(builder, '__name__', builder)!r} takes no "
                          f"{', '.join(missing)}; a builder takes num_classes, in_channels and image_size as keywords")
    options = set(parameters) - {"num_classes", "in_channels", "image_size"}
    unknown = sorted(set(kwargs) - options)
    if unknown:
        accepted = ", ".join(sorted(options)) or "none"
        raise ConfigError(f"model {name!r} does not take option(s) {', '.join(unknown)}: accepted options are {accepted}")
    model = builder(num_classes=num_classes, in_channels=in_channels, image_size=image_size, **kwargs)
    if MODELS.provenance(name) is not None:  # not fedlt's own: its contract is checked once, before training
        check_contract(name, model, in_channels, image_size)
    return model


def check_contract(name: str, model: object, in_channels: int, image_size: int) -> None:
    """A model from outside fedlt is a FedModel whose encoder maps two blank images to (2, feature_dim)
    features and whose head maps those to (2, num_classes) logits; a one-line ConfigError otherwise."""
    if not isinstance(model, FedModel):
        raise ConfigError(f"model {name!r} builds a {type(model).__name__}, not a fedlt.models.FedModel; wrap its "
                          "layers as FedModel(encoder, feature_dim, num_classes)")
    was_training = model.training
    model.eval()  # no BatchNorm statistics move
    try:
        device = next(model.parameters(), torch.empty(0)).device
        with torch.no_grad():
            features = model.forward_features(torch.zeros(2, in_channels, image_size, image_size, device=device))
            shape = tuple(features.shape)
            if shape != (2, model.feature_dim):
                raise ConfigError(f"model {name!r}: its encoder maps 2 images to features of shape {shape}, not "
                                  f"(2, {model.feature_dim}) (feature_dim); flatten its output (e.g. end the encoder "
                                  "with nn.Flatten()) or give FedModel the encoder's width")
            logits = tuple(model.forward_head(features).shape)
    except (RuntimeError, ValueError, TypeError) as err:
        problem = (str(err).strip().splitlines() or [""])[0][:160]
        raise ConfigError(f"model {name!r} fails on 2 blank {in_channels}x{image_size}x{image_size} images "
                          f"({problem}); check its layers against the dataset's images") from None
    finally:
        model.train(was_training)
    if logits != (2, model.num_classes):
        raise ConfigError(f"model {name!r}: its head maps the features to logits of shape {logits}, not "
                          f"(2, {model.num_classes}) (num_classes)")
