"""CIFAR-10 and CIFAR-100 from the "python version" archives, or the "binary version" ones.

Each python batch file is a pickled dict with bytes keys: ``b"data"`` is (N, 3072) uint8 holding
the red, green then blue 32x32 planes of every image, so a plain reshape gives (N, 3, 32, 32).
A batch read with ``encoding="latin1"`` and pickled again by Python 3 has text keys instead; both are read.
Pickles can run code while loading, so only the few globals a numpy array needs are allowed.
A binary batch is fixed-size records: the label byte(s) (CIFAR-100: coarse, then fine), then the
same 3072 pixel bytes; its class names are a text file, one per line.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedlt.data.dataset import DatasetPair, ImageDataset
from fedlt.data.sources.common import check_labels, require_dir, unextracted
from fedlt.errors import DataError


@dataclass(frozen=True)
class _Layout:
    """Where one CIFAR variant keeps its files and what it calls its keys."""

    dataset: str
    folder: str
    train: tuple[str, ...]
    test: str
    meta: str
    names_key: bytes
    labels_key: bytes
    num_classes: int
    #: the published class names in label order (what the meta file lists): a federation's
    #: declaration without the files (:mod:`fedlt.data.declaration`)
    classes: tuple[str, ...]
    archive: str
    mean: tuple[float, float, float]
    std: tuple[float, float, float]
    #: the binary version: its folder, train and test files, names file, label bytes per record
    #: and which of them is the label used
    binary: tuple[str, tuple[str, ...], str, str, int, int]


CIFAR10 = _Layout(
    dataset="cifar10",
    folder="cifar-10-batches-py",
    train=tuple(f"data_batch_{i}" for i in range(1, 6)),
    test="test_batch",
    meta="batches.meta",
    names_key=b"label_names",
    labels_key=b"labels",
    num_classes=10,
    classes=("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"),
    archive="cifar-10-python.tar.gz",
    mean=(0.4914, 0.4822, 0.4465),
    std=(0.2470, 0.2435, 0.2616),
    binary=("cifar-10-batches-bin", tuple(f"data_batch_{i}.bin" for i in range(1, 6)), "test_batch.bin",
            "batches.meta.txt", 1, 0),
)
CIFAR100 = _Layout(
    dataset="cifar100",
    folder="cifar-100-python",
    train=("train",),
    test="test",
    meta="meta",
    names_key=b"fine_label_names",
    labels_key=b"fine_labels",
    num_classes=100,
    classes=(
        "apple", "aquarium_fish", "baby", "bear", "beaver", "bed", "bee", "beetle", "bicycle", "bottle", "bowl", "boy",
        "bridge", "bus", "butterfly", "camel", "can", "castle", "caterpillar", "cattle", "chair", "chimpanzee", "clock",
        "cloud", "cockroach", "couch", "crab", "crocodile", "cup", "dinosaur", "dolphin", "elephant", "flatfish",
        "forest", "fox", "girl", "hamster", "house", "kangaroo", "keyboard", "lamp", "lawn_mower", "leopard", "lion",
        "lizard", "lobster", "man", "maple_tree", "motorcycle", "mountain", "mouse", "mushroom", "oak_tree", "orange",
        "orchid", "otter", "palm_tree", "pear", "pickup_truck", "pine_tree", "plain", "plate", "poppy", "porcupine",
        "possum", "rabbit", "raccoon", "ray", "road", "rocket", "rose", "sea", "seal", "shark", "shrew", "skunk",
        "skyscraper", "snail", "snake", "spider", "squirrel", "streetcar", "sunflower", "sweet_pepper", "table", "tank",
        "telephone", "television", "tiger", "tractor", "train", "trout", "tulip", "turtle", "wardrobe", "whale",
        "willow_tree", "wolf", "woman", "worm",
    ),
    archive="cifar-100-python.tar.gz",
    mean=(0.5071, 0.4865, 0.4409),
    std=(0.2673, 0.2564, 0.2762),
    binary=("cifar-100-binary", ("train.bin",), "test.bin", "fine_label_names.txt", 2, 1),
)

_SIDE = 32
# (module, name) pairs a pickled numpy array may reference; anything else is refused.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # how Python 3 writes bytes at pickle protocol 2
    ("numpy.core.numeric", "_frombuffer"),  # an array at pickle protocol 5
    ("numpy._core.numeric", "_frombuffer"),
    ("numpy.core.multiarray", "scalar"),  # a numpy integer in a list of labels
    ("numpy._core.multiarray", "scalar"),
}


def load_cifar10(root: Path) -> DatasetPair:
    """CIFAR-10 from ``root`` = ``cifar-10-batches-py/`` or the folder that holds it."""
    return _load(CIFAR10, Path(root))


def load_cifar100(root: Path) -> DatasetPair:
    """CIFAR-100 (fine labels) from ``root`` = ``cifar-100-python/`` or the folder that holds it."""
    return _load(CIFAR100, Path(root))


def _fix(layout: _Layout) -> str:
    return (
        f"download {layout.archive} (or the binary version) from https://www.cs.toronto.edu/~kriz/cifar.html, "
        "extract it and pass data.root=DIR"
    )


def _load(layout: _Layout, root: Path) -> DatasetPair:
    root = require_dir(layout.dataset, root, _fix(layout))
    binary = next((d for d in (root, root / layout.binary[0])
                   if (d / layout.binary[3]).is_file() or (d / layout.binary[2]).is_file()), None)
    if binary is not None and not (root / layout.meta).is_file() and not (root / layout.folder).is_dir():
        return _load_binary(layout, binary)
    folder = root if (root / layout.meta).is_file() or root.name == layout.folder else root / layout.folder
    names = [*layout.train, layout.test, layout.meta]
    if folder == root and not any((root / name).is_file() for name in names):  # the dataset's own folder, empty
        nested = root / layout.folder  # the archive extracted into a folder of its own name
        fix = (f"the files are one level down, in {nested}: pass data.root={nested}" if (nested / layout.meta).is_file()
               else unextracted([root.parent], [layout.archive]) or _fix(layout))
        raise DataError(f"{layout.dataset}: {root} holds none of {', '.join(names)}; {fix}")
    if not folder.is_dir():
        raise DataError(
            f"{layout.dataset}: no {layout.folder}/ in {root} and no {layout.meta} in it either "
            f"(expected {', '.join(names)}); "
            f"{unextracted([root], [layout.archive, layout.archive.replace('-python', '-binary')]) or _fix(layout)}"
        )
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise DataError(f"{layout.dataset}: missing {', '.join(missing)} in {folder}; {_fix(layout)}")
    classes = _read_names(layout, folder / layout.meta)
    parts = [_read_batch(layout, folder / name) for name in layout.train]
    train_images = torch.cat([images for images, _ in parts])
    train_labels = torch.cat([labels for _, labels in parts])
    test_images, test_labels = _read_batch(layout, folder / layout.test)
    return DatasetPair(
        ImageDataset(train_images, train_labels, classes, layout.mean, layout.std),
        ImageDataset(test_images, test_labels, list(classes), layout.mean, layout.std),
    )


def _load_binary(layout: _Layout, folder: Path) -> DatasetPair:
    """The binary version in ``folder``: fixed-size records, class names one per line."""
    _, train, test, names_file, label_bytes, label_at = layout.binary
    missing = [name for name in (*train, test, names_file) if not (folder / name).is_file()]
    if missing:
        raise DataError(f"{layout.dataset}: missing {', '.join(missing)} in {folder}; {_fix(layout)}")
    names = [line.strip() for line in (folder / names_file).read_text(errors="replace").splitlines() if line.strip()]
    if len(names) != layout.num_classes:
        raise DataError(f"{layout.dataset}: {folder / names_file} lists {len(names)} class names, expected "
                        f"{layout.num_classes}; {_fix(layout)}")
    record = label_bytes + 3 * _SIDE**2
    records: dict[str, int] = {}

    def split(files: tuple[str, ...]) -> ImageDataset:
        rows = []
        for name in files:
            data = np.fromfile(folder / name, dtype=np.uint8)
            if data.size == 0 or data.size % record:
                raise DataError(f"{layout.dataset}: {folder / name} holds {data.size} bytes, not a whole number of "
                                f"{record}-byte records; {_fix(layout)}")
            rows.append(data.reshape(-1, record))
            records[name] = len(rows[-1])
            check_labels(layout.dataset, folder / name, torch.from_numpy(rows[-1][:, label_at].astype(np.int64)),
                         layout.num_classes, _fix(layout))
        table = np.concatenate(rows)
        labels = torch.from_numpy(table[:, label_at].astype(np.int64))
        images = torch.from_numpy(np.ascontiguousarray(table[:, label_bytes:]).reshape(-1, 3, _SIDE, _SIDE))
        return ImageDataset(images, labels, list(names), layout.mean, layout.std)

    pair = DatasetPair(split(train), split((test,)))
    batches = {name: records[name] for name in train}  # the release's train batches are equal (CIFAR-10: 10,000
    if len(set(batches.values())) > 1:  # each); its test file may hold another count
        short = min(batches, key=batches.get)
        raise DataError(f"{layout.dataset}: {folder / short} holds {batches[short]} records and the other batches "
                        f"{max(batches.values())}, so it is cut off; {_fix(layout)}")
    return pair


class _ArrayUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")
        return super().find_class(module, name)


def _unpickle(layout: _Layout, path: Path) -> dict:
    try:
        with path.open("rb") as handle:
            content = _ArrayUnpickler(handle, encoding="bytes").load()
    except Exception as exc:  # unpickling garbage can raise almost anything
        problem = f"{type(exc).__name__}: {exc}"
        raise DataError(f"{layout.dataset}: cannot unpickle {path} ({problem}); {_fix(layout)}") from exc
    if not isinstance(content, dict):
        raise DataError(f"{layout.dataset}: {path} holds a {type(content).__name__}, not a CIFAR dict; {_fix(layout)}")
    return content


def _field(layout: _Layout, path: Path, content: dict, key: bytes) -> Any:
    for name in (key, key.decode()):  # the release's bytes key, or the text key of a batch pickled again
        if name in content:
            return content[name]
    raise DataError(
        f"{layout.dataset}: {path} has no {key!r} entry; it is not a {layout.dataset} file, {_fix(layout)}"
    )


def _read_names(layout: _Layout, path: Path) -> list[str]:
    raw = _field(layout, path, _unpickle(layout, path), layout.names_key)
    if not isinstance(raw, (list, tuple, np.ndarray)) or not all(isinstance(n, (bytes, str, np.str_)) for n in raw):
        raise DataError(f"{layout.dataset}: {layout.names_key!r} in {path} is not a list of class names; {_fix(layout)}")
    names = [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in raw]
    if len(names) != layout.num_classes:
        raise DataError(
            f"{layout.dataset}: {path} lists {len(names)} class names, expected {layout.num_classes}; {_fix(layout)}"
        )
    return names


def _read_batch(layout: _Layout, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    content = _unpickle(layout, path)
    data = _field(layout, path, content, b"data")
    raw_labels = _field(layout, path, content, layout.labels_key)
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 or data.shape[1] != 3 * _SIDE**2:
        found = f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray) else type(data).__name__
        raise DataError(f"{layout.dataset}: b'data' in {path} is {found}, expected uint8 (N, 3072); {_fix(layout)}")
    try:
        values = np.asarray(raw_labels).reshape(-1)
        if values.size and values.dtype.kind not in "iu":  # a float label would be truncated to another class
            raise TypeError(values.dtype)
        labels = torch.as_tensor(values.astype(np.int64))
    except (TypeError, ValueError) as exc:
        raise DataError(
            f"{layout.dataset}: {layout.labels_key!r} in {path} is not a list of integers; {_fix(layout)}"
        ) from exc
    if labels.shape[0] != data.shape[0]:
        raise DataError(
            f"{layout.dataset}: {path} holds {data.shape[0]} images but {labels.shape[0]} labels; {_fix(layout)}"
        )
    check_labels(layout.dataset, path, labels, layout.num_classes, _fix(layout))
    images = torch.from_numpy(np.ascontiguousarray(data).reshape(-1, 3, _SIDE, _SIDE).copy())
    return images, labels
