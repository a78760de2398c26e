"""What a federation declares about its data without holding any: class names, channels, image
size and standardisation constants.

In a real federation (``flower.node_data``) the server reads no training data, yet it builds the
model (channels, classes, image size) and every node must standardise its pixels exactly as the
others do. So all of it comes from the registry and the config, never from a node's images: a
node's pixel statistics would differ from its peers' and would leak what it holds. The constants
are the ones the dataset's loader uses (one definition, in its source module).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache, partial
from typing import NamedTuple

from fedlt.config import DataConfig
from fedlt.data.registry import load_dataset, resolve_image_size
from fedlt.data.sources import cifar, cinic, idx, listfile, svhn, synthetic
from fedlt.errors import ConfigError

Stats = tuple[float, ...]


class DeclaredDataset(NamedTuple):
    """A federation's data as every party knows it in advance."""

    classes: list[str]
    channels: int
    image_size: int
    mean: Stats
    std: Stats


@lru_cache(maxsize=8)
def _synthetic(image_size: int, name: str = "synthetic") -> tuple[list[str], Stats, Stats]:
    """A synthetic dataset's statistics are those of its generated training split, so generate it."""
    train = load_dataset(name, image_size=image_size).train
    return list(train.classes), train.mean, train.std


#: dataset -> (image side -> (class names or None where files name them, mean, std))
_CONSTANTS: dict[str, Callable[[int], tuple[list[str] | None, Stats, Stats]]] = {
    "fmnist": lambda size: (list(idx.CLASSES), idx.MEAN, idx.STD),
    "cifar10": lambda size: (list(cifar.CIFAR10.classes), cifar.CIFAR10.mean, cifar.CIFAR10.std),
    "cifar100": lambda size: (list(cifar.CIFAR100.classes), cifar.CIFAR100.mean, cifar.CIFAR100.std),
    "svhn": lambda size: (list(svhn.CLASSES), svhn.MEAN, svhn.STD),
    "cinic10": lambda size: (list(cinic.CLASSES), cinic.MEAN, cinic.STD),
    "imagenet_lt": lambda size: (None, listfile.IMAGENET_LT.mean, listfile.IMAGENET_LT.std),
    "inat": lambda size: (None, listfile.INAT2018.mean, listfile.INAT2018.std),
    **dict.fromkeys(("imagefolder", "imagefolder_lt"),  # imagefolder.FOLDER_MEAN, FOLDER_STD
                    lambda size: (None, listfile.IMAGENET_LT.mean, listfile.IMAGENET_LT.std)),
    "synthetic": _synthetic,
    **{name: partial(_synthetic, name=name) for name in synthetic.STAND_INS},
}


def declared_dataset(cfg: DataConfig) -> DeclaredDataset:
    """The declaration of ``cfg.dataset`` at ``cfg.image_size``, named by ``cfg.classes`` where given.

    Raises
    ------
    DataError
        unknown dataset, an image size the dataset does not come in
    ConfigError
        ``data.classes`` missing where the dataset's files name the classes (imagenet_lt, inat),
        of the wrong length, or with an empty or repeated name
    """
    size = resolve_image_size(cfg.dataset, cfg.image_size)  # also rejects an unknown dataset
    known, mean, std = _CONSTANTS[cfg.dataset](size)
    return DeclaredDataset(class_names(cfg, known), len(mean), size, tuple(mean), tuple(std))


def class_names(cfg: DataConfig, known: list[str] | None) -> list[str]:
    """``cfg.classes`` checked against the ``known`` names (the dataset's own, None where only its
    files name them), or ``known`` when ``cfg.classes`` is not given."""
    if cfg.classes is None:
        if known is None:
            raise ConfigError(
                f"data.classes is required for {cfg.dataset}: its class names come from its files, which a "
                "federation's server does not hold; list every class name in label order (e.g. from "
                "`fedlt data export`'s federation.yaml)"
            )
        return known
    names = list(cfg.classes)
    if known is not None and len(names) != len(known):
        raise ConfigError(
            f"data.classes lists {len(names)} names but {cfg.dataset} has {len(known)} classes; "
            f"list {len(known)} names in label order or drop data.classes"
        )
    if not names:
        raise ConfigError("data.classes is empty; list every class name in label order or drop data.classes")
    if any(not name.strip() for name in names):
        position = next(i for i, name in enumerate(names) if not name.strip())
        raise ConfigError(f"data.classes[{position}] is an empty name; give every class a non-empty name")
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ConfigError(f"data.classes names '{name}' twice; every class needs its own name")
        seen.add(name)
    return names
