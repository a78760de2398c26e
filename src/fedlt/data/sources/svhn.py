"""SVHN (format 2: cropped 32x32 digits) from ``train_32x32.mat`` and ``test_32x32.mat``.

The files are MATLAB v5: ``X`` is (32, 32, 3, N) uint8 (height, width, channel, image) and
``y`` is (N, 1) with the digit 0 stored as label 10, a MATLAB one-based habit undone here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import scipy.io
import torch

from fedlt.data.dataset import DatasetPair, ImageDataset
from fedlt.data.sources.common import require_dir
from fedlt.errors import DataError

DATASET = "svhn"
CLASSES = [str(digit) for digit in range(10)]
MEAN = (0.4377, 0.4438, 0.4728)
STD = (0.1980, 0.2010, 0.1970)
_FILES = {"train": "train_32x32.mat", "test": "test_32x32.mat"}
_SIDE = 32
_FIX = "download train_32x32.mat and test_32x32.mat from http://ufldl.stanford.edu/housenumbers/ and pass data.root=DIR"


def load_svhn(root: Path) -> DatasetPair:
    """Read ``train_32x32.mat`` and ``test_32x32.mat`` from ``root`` (``extra_32x32.mat`` is not used)."""
    root = require_dir(DATASET, Path(root), _FIX)
    missing = [name for name in _FILES.values() if not (root / name).is_file()]
    if missing:
        raise DataError(f"{DATASET}: missing {', '.join(missing)} in {root}; {_FIX}")
    train, test = (_read(root / name) for name in _FILES.values())
    return DatasetPair(
        ImageDataset(*train, list(CLASSES), MEAN, STD),
        ImageDataset(*test, list(CLASSES), MEAN, STD),
    )


def _read(path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    try:
        content = scipy.io.loadmat(path)
    except NotImplementedError as exc:
        raise DataError(f"{DATASET}: {path} is a MATLAB v7.3 file, SVHN ships v5 files; {_FIX}") from exc
    except Exception as exc:  # scipy reports corrupt files with many exception types
        head = b""
        if path.is_file():
            with open(path, "rb") as f:
                head = f.read(6)
        why = "it is no MATLAB file (it does not start with 'MATLAB')" if head != b"MATLAB" else \
            f"{type(exc).__name__}: {exc}"
        raise DataError(f"{DATASET}: cannot read {path} ({why}); {_FIX}") from exc
    for key in ("X", "y"):
        if key not in content:
            raise DataError(f"{DATASET}: {path} has no variable '{key}'; it is not an SVHN format-2 file, {_FIX}")
    x, y = content["X"], content["y"]
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (_SIDE, _SIDE, 3):
        raise DataError(f"{DATASET}: X in {path} is {x.dtype} {x.shape}, expected uint8 (32, 32, 3, N); {_FIX}")
    count = x.shape[3]
    if y.size != count:
        raise DataError(f"{DATASET}: {path} holds {count} images but {y.size} labels; {_FIX}")
    try:
        if y.dtype.kind in "cOV":  # complex, a cell array, a struct
            raise TypeError(y.dtype)
        digits = y.reshape(-1).astype(np.float64)
    except (TypeError, ValueError):
        raise DataError(f"{DATASET}: y in {path} is {y.dtype} {y.shape}, expected numeric labels 1..10 "
                        f"(10 = digit 0); {_FIX}") from None
    valid = (digits >= 1) & (digits <= 10) & (digits == np.round(digits))
    if not valid.all():
        bad = digits[~valid][0]
        raise DataError(f"{DATASET}: label {bad:g} in {path} is not one of 1..10 (10 = digit 0); {_FIX}")
    labels = torch.from_numpy((digits.astype(np.int64) % 10).copy())
    images = torch.from_numpy(np.ascontiguousarray(x.transpose(3, 2, 0, 1)))
    return images, labels
