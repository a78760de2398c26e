"""CINIC-10: CIFAR-10's classes with extra ImageNet images, shipped as folders of 32x32 PNGs.

Layout: ``ROOT/{train,valid,test}/<class name>/*.png``. Labels follow the sorted class
folder names, which must be the same in every split used, or labels would silently mean
different classes in train and test. ``valid/`` is the dataset's own validation split
(``data.val_from=dataset``), read only when a validation set is drawn from it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedlt.data.dataset import DatasetPair, ImageDataset
from fedlt.data.sources.cifar import CIFAR10
from fedlt.data.sources.common import decode_all, read_rgb, require_dir, to_chw, unextracted
from fedlt.errors import DataError

DATASET = "cinic10"
#: CIFAR-10's classes, whose names (already sorted) are CINIC's class folders
CLASSES = list(CIFAR10.classes)
MEAN = (0.4789, 0.4723, 0.4305)
STD = (0.2421, 0.2383, 0.2587)
_SIDE = 32
_FIX = (
    "download CINIC-10 from https://datashare.ed.ac.uk/handle/10283/3192, extract it "
    "and pass data.root=DIR (the folder holding train/ and test/)"
)


def load_cinic10(root: Path, include_valid: bool = False) -> DatasetPair:
    """Read ``root/train`` and ``root/test``; ``include_valid`` adds ``root/valid`` to the training split.

    The default keeps the published 90k/90k train/test protocol.
    """
    root = require_dir(DATASET, Path(root), _FIX)
    train_splits = ["train", "valid"] if include_valid else ["train"]
    missing = [split for split in [*train_splits, "test"] if not (root / split).is_dir()]
    if missing:
        raise DataError(f"{DATASET}: no {', '.join(s + '/' for s in missing)} folder in {root}; "
                        f"{unextracted([root], ['CINIC-10.tar.gz']) or _FIX}")
    classes = _class_names(root / "train")
    if classes != CLASSES:  # labels follow the sorted folder names: another set would shift them silently
        missing, extra = sorted(set(CLASSES) - set(classes)), sorted(set(classes) - set(CLASSES))
        what = "; ".join(part for part in (f"missing {', '.join(missing)}" if missing else "",
                                          f"unknown {', '.join(extra)}" if extra else "") if part)
        raise DataError(f"{DATASET}: the class folders of {root / 'train'} are not CINIC-10's ten ({what}); {_FIX}")
    for split in [*train_splits[1:], "test"]:
        _check_same_classes(root, split, classes)
    train = [_read_split(root / split, classes) for split in train_splits]
    test_images, test_labels = _read_split(root / "test", classes)
    return DatasetPair(
        ImageDataset(torch.cat([x for x, _ in train]), torch.cat([y for _, y in train]), classes, MEAN, STD),
        ImageDataset(test_images, test_labels, list(classes), MEAN, STD),
    )


def load_cinic10_val(root: Path) -> ImageDataset:
    """``root/valid``: CINIC-10's own validation split (``data.val_from=dataset``), labelled as ``train/`` is."""
    root = require_dir(DATASET, Path(root), _FIX)
    if not (root / "valid").is_dir():
        raise DataError(f"{DATASET}: no valid/ folder in {root}, so CINIC-10's own validation split is missing; "
                        f"extract valid/ from CINIC-10.tar.gz there or use data.val_from=train or test")
    _check_same_classes(root, "valid", CLASSES)
    images, labels = _read_split(root / "valid", CLASSES)
    return ImageDataset(images, labels, list(CLASSES), MEAN, STD)


def _check_same_classes(root: Path, split: str, classes: list[str]) -> None:
    other = _class_names(root / split)
    if other != classes:
        raise DataError(
            f"{DATASET}: class folders of {root / split} ({', '.join(other)}) differ from those of "
            f"{root / 'train'} ({', '.join(classes)}); every split needs the same class folders, {_FIX}"
        )


def _class_names(split: Path) -> list[str]:
    names = sorted(entry.name for entry in split.iterdir() if entry.is_dir() and not entry.name.startswith("."))
    if not names:
        raise DataError(f"{DATASET}: {split} has no class folders; {_FIX}")
    return names


def _read_split(split: Path, classes: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    paths: list[Path] = []
    labels: list[int] = []
    for label, name in enumerate(classes):
        files = sorted(p for p in (split / name).iterdir()  # not a dot-file: macOS's ._ metadata, for one
                       if p.suffix.lower() == ".png" and not p.name.startswith(".") and p.is_file())
        if not files:
            raise DataError(f"{DATASET}: class folder {split / name} holds no .png files; {_FIX}")
        paths.extend(files)
        labels.extend([label] * len(files))
    images = decode_all(paths, _decode, (3, _SIDE, _SIDE), "cinic10")
    return images, torch.tensor(labels, dtype=torch.int64)


def _decode(path: Path) -> np.ndarray:
    image = read_rgb(DATASET, path, _FIX)
    if image.size != (_SIDE, _SIDE):
        raise DataError(f"{DATASET}: image {path} is {image.size[0]}x{image.size[1]}, expected 32x32; {_FIX}")
    return to_chw(image)
