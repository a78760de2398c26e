"""Class folders of PNG or JPEG images, torchvision ImageFolder style: a node's own data folder, and
a user's own dataset (``data.dataset=imagefolder``, :func:`load_folder_dataset`), read by the same rules.

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

A user's own dataset (``data.dataset=imagefolder``, ``data.root=DIR``) is ``DIR/train/<class>/``,
``DIR/test/<class>/`` and optionally ``DIR/val/<class>/`` (the dataset's own validation split) of RGB
images of side ``data.image_size`` (default 32). Its classes are ``DIR/train``'s folders in sorted
order, named as the folders are (on a federation's nodes, whose folders fedlt names, they are
escaped as above); ``imagefolder_lt`` keeps the training split's own long tail. It is standardised with ImageNet's RGB statistics, declared in
advance like every dataset's, so the same folders serve a simulation and, split by node, a federation
whose nodes hold their data (``data.classes`` lists the classes there).
"""

from __future__ import annotations

from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fedlt.data.dataset import DatasetPair, ImageDataset
from fedlt.data.declaration import DeclaredDataset
from fedlt.data.sources.common import DECODE_ERRORS, decode_all, require_dir, unreadable
from fedlt.data.sources.listfile import IMAGENET_LT
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


#: ``data.dataset=imagefolder``: its name, standardisation (ImageNet's RGB statistics) and the fix of its errors
FOLDER_DATASET = "imagefolder"
FOLDER_MEAN, FOLDER_STD = IMAGENET_LT.mean, IMAGENET_LT.std
_FOLDER_FIX = "pass data.root=DIR, the folder holding train/<class>/ and test/<class>/ (images of data.image_size)"


def load_folder_dataset(root: Path, image_size: int) -> DatasetPair:
    """A user's own dataset: ``root/train`` and ``root/test`` (see the module docstring).

    Raises
    ------
    DataError
        one line naming the folder or file: no ``train/`` or ``test/``, no class folders, an image of
        another size or mode, or any fault :func:`load_image_folder` finds
    """
    root = require_dir(FOLDER_DATASET, Path(root).expanduser(), _FOLDER_FIX)
    missing = [split for split in (TRAIN, TEST) if not (root / split).is_dir()]
    if missing:
        raise DataError(f"{FOLDER_DATASET}: no {' or '.join(s + '/' for s in missing)} in {root}; {_FOLDER_FIX}")
    folders = [entry.name for entry in _visible(root / TRAIN) if entry.is_dir()]
    if not folders:
        raise DataError(f"{FOLDER_DATASET}: {root / TRAIN} holds no class folders; {_FOLDER_FIX}")
    declared = _folder_declaration(folders, image_size)
    return DatasetPair(*(load_image_folder(root, split, declared, FOLDER_DATASET, str) for split in (TRAIN, TEST)))


def load_folder_val(root: Path, image_size: int, classes: list[str]) -> ImageDataset:
    """``root/val``: a user's dataset's own validation split (``data.val_from=dataset``)."""
    if not (Path(root) / "val").is_dir():
        raise DataError(f"{FOLDER_DATASET}: no val/ in {root}, so it has no validation split of its own; add "
                        "val/<class>/ or use data.val_from=train or test (or auto)")
    return load_image_folder(root, "val", _folder_declaration(classes, image_size), FOLDER_DATASET, str)


def _folder_declaration(classes: list[str], image_size: int) -> DeclaredDataset:
    return DeclaredDataset(classes, 3, image_size, FOLDER_MEAN, FOLDER_STD)


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


def load_image_folder(root: Path, split: str, declared: DeclaredDataset, prefix: str = _PREFIX,
                      folder_of: Callable[[str], str] = class_folder_name) -> ImageDataset:
    """``root/split/<class folder>/*`` as one dataset in the module's row order (see above): a node's
    split, the server's test or validation set (``eval.test_data``, ``fedlt data export``'s ``server/``),
    or a split of a user's dataset; ``prefix`` starts its errors (``node data``, ``eval.test_data``,
    ``imagefolder``), ``folder_of`` names a class's folder (a user's own folders are their class names)."""
    folder = Path(root).expanduser() / split
    channels, side = declared.channels, declared.image_size
    if channels not in MODES:
        raise DataError(f"{prefix}: images of {channels} channels cannot be read from image files; use 1 or 3")
    if not folder.is_dir():
        what = "is not a folder" if folder.exists() else "does not exist"
        raise DataError(f"{prefix}: {folder} {what}; put the {split} images in {folder}/<class>/ "
                        "(one folder per class)")
    labels_of = {folder_of(name): label for label, name in enumerate(declared.classes)}
    entries: list[tuple[str, int, Path]] = []
    for entry in _visible(folder):
        if not entry.is_dir():
            raise DataError(f"{prefix}: {entry} is a file where class folders are expected; move it into a class "
                            "folder or remove it")
        label = labels_of.get(entry.name)
        if label is None:
            rule = f"every split has {TRAIN}/'s" if prefix == FOLDER_DATASET else "name class folders after data.classes"
            raise DataError(f"{prefix}: unknown class folder {entry}; {rule}: {_listing(list(labels_of))}")
        entries.extend((image.name, label, image) for image in _images(entry, prefix))
    if not entries:
        raise DataError(f"{prefix}: {folder} holds no images; put them in {folder}/<class>/ (one folder per class)")
    entries.sort(key=lambda e: (e[0], e[1]))
    images = decode_all([path for _, _, path in entries], lambda path: _decode(path, channels, side, prefix),
                        (channels, side, side), f"{prefix}: {folder}")
    labels = torch.tensor([label for _, label, _ in entries], dtype=torch.int64)
    return ImageDataset(images, labels, list(declared.classes), tuple(declared.mean), tuple(declared.std))


def _visible(folder: Path) -> list[Path]:
    return sorted(entry for entry in folder.iterdir() if not entry.name.startswith("."))


def _images(class_folder: Path, prefix: str) -> list[Path]:
    files = _visible(class_folder)
    for path in files:
        if not (path.suffix.lower() in IMAGE_SUFFIXES and path.is_file()):
            raise DataError(f"{prefix}: {path} is not a {'/'.join(IMAGE_SUFFIXES)} image; convert or remove it")
    if not files:
        raise DataError(f"{prefix}: class folder {class_folder} holds no images; add images or remove the folder")
    return files


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_LISTED])
    return shown if len(names) <= _LISTED else f"{shown}, ... ({len(names)} in all)"


def _decode(path: Path, channels: int, side: int, prefix: str) -> np.ndarray:
    """One image as (channels, side, side) uint8, refused unless it already is that."""
    mode = MODES[channels]
    try:
        with Image.open(path) as image:
            if image.size != (side, side):
                where = {_PREFIX: "before it goes in the node folder",
                         FOLDER_DATASET: "or give data.image_size the side every image has"}.get(prefix, "first")
                raise DataError(f"{prefix}: image {path} is {image.size[0]}x{image.size[1]}, expected {side}x{side}; "
                                f"images are not resized, resize it {where}")
            if image.mode != mode:
                kind = " (a palette image)" if image.mode in ("P", "PA") else ""
                raise DataError(f"{prefix}: image {path} has {len(image.getbands())} channel(s) (mode {image.mode})"
                                f"{kind}, expected {channels} (mode {mode}); save it as {'an' if mode in ('RGB', 'L') else 'a'} "
                                f"{mode} image")
            pixels = np.asarray(image, dtype=np.uint8)
    except FileNotFoundError as exc:
        raise DataError(f"{prefix}: image {path} vanished while it was read; keep the folder unchanged") from exc
    except PermissionError as exc:
        raise unreadable(prefix, path, exc) from None
    except DECODE_ERRORS as exc:
        problem = " ".join(f"{type(exc).__name__}: {exc}".split())
        raise DataError(f"{prefix}: cannot decode image {path} ({problem}); "
                        "replace it with a valid PNG or JPEG") from exc
    return pixels[None] if channels == 1 else pixels.transpose(2, 0, 1)
