"""Fashion-MNIST from its IDX files (plain or gzipped).

IDX is a big-endian header (magic number, then one uint32 per dimension) followed by raw
uint8 data. The header is checked against the file length so a truncated download fails
with a message naming the file instead of a reshape error.
"""

from __future__ import annotations

import gzip
import math
import struct
import zlib
from pathlib import Path

import numpy as np
import torch

from fedlt.data.dataset import DatasetPair, ImageDataset
from fedlt.data.sources.common import check_labels, require_dir
from fedlt.errors import DataError

DATASET = "fmnist"
DEFAULT_ROOT = Path("/usr/share/datasets/fashion-mnist")
CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot"]
# Statistics of the 60000 training images on the [0, 1] scale.
MEAN = (0.2860,)
STD = (0.3530,)

_IMAGES_MAGIC = 2051  # 0x00000803: unsigned bytes, 3 dimensions
_LABELS_MAGIC = 2049  # 0x00000801: unsigned bytes, 1 dimension
_SIDE = 28
_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_INSTALL = "install Debian's package dataset-fashion-mnist or pass data.root=DIR"
_REFETCH = (
    "re-download the files from https://github.com/zalandoresearch/fashion-mnist "
    "(or reinstall dataset-fashion-mnist)"
)


def load_fashion_mnist(root: Path = DEFAULT_ROOT) -> DatasetPair:
    """Read the four Fashion-MNIST IDX files in ``root`` (each ``NAME`` or ``NAME.gz``)."""
    root = require_dir(DATASET, Path(root), _INSTALL)
    names = [name for pair in _FILES.values() for name in pair]
    found = {name: _find(root, name) for name in names}
    if not any(found.values()):
        expected = ", ".join(f"{name}[.gz]" for name in names)
        raise DataError(f"{DATASET}: no Fashion-MNIST IDX files in {root} (expected {expected}); {_INSTALL}")
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise DataError(
            f"{DATASET}: missing {', '.join(m + '[.gz]' for m in missing)} in {root}; "
            f"copy all four Fashion-MNIST files there or {_INSTALL}"
        )
    splits = {}
    for split, (image_name, label_name) in _FILES.items():
        images = _read_images(found[image_name])
        labels = _read_labels(found[label_name])
        if labels.shape[0] != images.shape[0]:
            raise DataError(
                f"{DATASET}: {found[label_name]} holds {labels.shape[0]} labels but {found[image_name]} holds "
                f"{images.shape[0]} images; the two files do not belong together, {_REFETCH}"
            )
        splits[split] = ImageDataset(images, labels, list(CLASSES), MEAN, STD)
    return DatasetPair(splits["train"], splits["test"])


def _find(root: Path, name: str) -> Path | None:
    for candidate in (root / name, root / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    return None


#: the first two bytes of every gzip file; an IDX file starts with two zero bytes
GZIP_MAGIC = b"\x1f\x8b"


def _read(path: Path) -> bytes:
    try:
        data = path.read_bytes()
        return gzip.decompress(data) if data[:2] == GZIP_MAGIC else data  # by content: a renamed .gz too
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{DATASET}: cannot read {path} ({exc}); {_REFETCH}") from exc


def _header(path: Path, data: bytes, magic: int, ndim: int) -> tuple[int, ...]:
    """The dimensions stored in the header, after checking magic number and total length."""
    size = 4 * (1 + ndim)
    if len(data) < size:
        raise DataError(f"{DATASET}: {path} is truncated ({len(data)} bytes, header alone needs {size}); {_REFETCH}")
    found, *dims = struct.unpack(f">{1 + ndim}I", data[:size])
    if found != magic:
        raise DataError(
            f"{DATASET}: {path} has magic number {found}, expected {magic}; "
            f"it is not an IDX {'image' if ndim == 3 else 'label'} file, {_REFETCH}"
        )
    expected = size + math.prod(dims)
    if len(data) != expected:
        raise DataError(
            f"{DATASET}: {path} is {len(data)} bytes but its header {tuple(dims)} needs {expected} "
            f"(truncated or corrupt); {_REFETCH}"
        )
    return tuple(dims)


def _read_images(path: Path) -> torch.Tensor:
    data = _read(path)
    count, rows, cols = _header(path, data, _IMAGES_MAGIC, 3)
    if (rows, cols) != (_SIDE, _SIDE):
        raise DataError(f"{DATASET}: {path} holds {rows}x{cols} images, expected {_SIDE}x{_SIDE}; {_REFETCH}")
    pixels = np.frombuffer(data, dtype=np.uint8, offset=16).reshape(count, 1, rows, cols)
    return torch.from_numpy(pixels.copy())


def _read_labels(path: Path) -> torch.Tensor:
    data = _read(path)
    _header(path, data, _LABELS_MAGIC, 1)
    labels = torch.from_numpy(np.frombuffer(data, dtype=np.uint8, offset=8).astype(np.int64))
    check_labels(DATASET, path, labels, len(CLASSES), _REFETCH)
    return labels
