"""A node's own data folder: class folders of PNG or JPEG images, torchvision ImageFolder style.

Layout: ``ROOT/train/<class folder>/<image>`` and, optionally, ``ROOT/test/<class folder>/<image>``
(``.png``, ``.jpg`` or ``.jpeg``, any case; names starting with ``.`` are ignored). A class folder
is named after a class of the federation's declared list (``data.classes``), with the characters a
file system cannot hold escaped (:func:`class_folder_name`: ``T-shirt/top`` -> ``T-shirt%2Ftop``).
Labels are the class's index in that list, so a node lacking some classes keeps the global labels.

Row order: a split's rows are its files in file-name order (Python string order) across all its
class folders, ties broken by class index. Within one class folder this is sorted name order;
across folders it lets a file name carry the row's position: ``fedlt data export`` names the
files ``000000.png``, ``000001.png``, ... over a split's class folders, so row i of the loaded split
is row i of what was exported (the client's i-th training row).

Images are never resized or converted: each must already have the declared size and channels
(mode L for one channel, RGB for three). Standardisation constants come from the declaration,
never from the node's pixels.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fedlt.data.dataset import ImageDataset
from fedlt.data.declaration import DeclaredDataset
from fedlt.data.sources.common import DECODE_ERRORS, decode_all, require_dir
from fedlt.errors import DataError

_PREFIX = "node data"  # how every error message starts
TRAIN, TEST = "train", "test"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
#: the PIL mode an image of 1 or 3 channels must have
MODES = {1: "L", 3: "RGB"}
# Path separators, the escape character itself, and what Windows or macOS refuse in a name.
_UNSAFE = set('%/\\:*?"<>|')
_LISTED = 12  # class folder names shown in an error message


@dataclass
class NodeData:
    """What one node holds: its training rows and, where it has one, its local test set."""

    train: ImageDataset
    test: ImageDataset | None


def class_folder_name(name: str) -> str:
    """The folder of class ``name``: ``%XX`` for ``%``, path separators, ``:*?"<>|``, control
    characters and a leading ``.`` (hidden names are skipped), every other character as is."""
    escaped = "".join(f"%{ord(c):02X}" if c in _UNSAFE or ord(c) < 32 else c for c in name)
    return "%2E" + escaped[1:] if escaped.startswith(".") else escaped


def load_node_data(root: Path, declared: DeclaredDataset) -> NodeData:
    """``root/train`` and, where present, ``root/test`` of one node's folder.

    Raises
    ------
    DataError
        one line naming the folder or file: no ``train/``, an unknown class folder, an empty
        class folder or split, a file that is no image, an unreadable image, an image of the
        wrong size or channel count
    """
    root = require_dir(_PREFIX, Path(root).expanduser(), "pass the node's data folder (holding train/<class>/...)")
    train = load_image_folder(root, TRAIN, declared)
    return NodeData(train, load_image_folder(root, TEST, declared) if (root / TEST).exists() else None)


def load_image_folder(root: Path, split: str, declared: DeclaredDataset) -> ImageDataset:
    """``root/split/<class folder>/*`` as one dataset in the module's row order (see above): a node's
    split, or the server's test or validation set (``eval.test_data``, ``fedlt data export``'s ``server/``)."""
    folder = Path(root).expanduser() / split
    channels, side = declared.channels, declared.image_size
    if channels not in MODES:
        raise DataError(f"{_PREFIX}: images of {channels} channels cannot be read from image files; use 1 or 3")
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise DataError(f"{_PREFIX}: {folder} {what}; put the {split} images in {folder}/<class>/ "
                        "(one folder per class)")
    labels_of = {class_folder_name(name): label for label, name in enumerate(declared.classes)}
    entries: list[tuple[str, int, Path]] = []
    for entry in _visible(folder):
        if not entry.is_dir():
            raise DataError(f"{_PREFIX}: {entry} is a file where class folders are expected; move it into a class "
                            "folder or remove it")
        label = labels_of.get(entry.name)
        if label is None:
            raise DataError(f"{_PREFIX}: unknown class folder {entry}; name class folders after data.classes: "
                            f"{_listing(list(labels_of))}")
        entries.extend((image.name, label, image) for image in _images(entry))
    if not entries:
        raise DataError(f"{_PREFIX}: {folder} holds no images; put them in {folder}/<class>/ (one folder per class)")
    entries.sort(key=lambda e: (e[0], e[1]))
    images = decode_all([path for _, _, path in entries], lambda path: _decode(path, channels, side),
                        (channels, side, side), f"{_PREFIX}: {folder}")
    labels = torch.tensor([label for _, label, _ in entries], dtype=torch.int64)
    return ImageDataset(images, labels, list(declared.classes), tuple(declared.mean), tuple(declared.std))


def _visible(folder: Path) -> list[Path]:
    return sorted(entry for entry in folder.iterdir() if not entry.name.startswith("."))


def _images(class_folder: Path) -> list[Path]:
    files = _visible(class_folder)
    for path in files:
        if not (path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()):
            raise DataError(f"{_PREFIX}: {path} is not a {'/'.join(IMAGE_SUFFIXES)} image; convert or remove it")
    if not files:
        raise DataError(f"{_PREFIX}: class folder {class_folder} holds no images; add images or remove the folder")
    return files


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown if len(names) <= _LISTED else f"{shown}, ... ({len(names)} in all)"


def _decode(path: Path, channels: int, side: int) -> np.ndarray:
    """One image as (channels, side, side) uint8, refused unless it already is that."""
    mode = MODES[channels]
    try:
        with Image.open(path) as image:
            if image.size != (side, side):
                raise DataError(f"{_PREFIX}: image {path} is {image.size[0]}x{image.size[1]}, expected {side}x{side}; "
                                "images are not resized, resize it before it goes in the node folder")
            if image.mode != mode:
                raise DataError(f"{_PREFIX}: image {path} has {len(image.getbands())} channel(s) (mode {image.mode}), "
                                f"expected {channels} (mode {mode}); save it as a {mode} image")
            pixels = np.asarray(image, dtype=np.uint8)
    except FileNotFoundError as exc:
        raise DataError(f"{_PREFIX}: image {path} vanished while it was read; keep the node folder unchanged") from exc
    except DECODE_ERRORS as exc:
        problem = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise DataError(f"{_PREFIX}: cannot decode image {path} ({problem}); "
                        "replace it with a valid PNG or JPEG") from exc
    return pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)
