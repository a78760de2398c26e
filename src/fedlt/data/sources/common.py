"""Helpers shared by the format readers: file checks, label checks, image decoding."""

from __future__ import annotations

import os
import struct
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from fedlt.errors import DataError

# Below this many items a thread pool costs more than it saves.
_PARALLEL_MIN = 256
#: refused images named beside the first in a decoding error
_NAMED_REFUSALS = 3
#: what PIL raises for a broken image file, depending on the format and where it breaks
DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, Image.DecompressionBombError)


def require_dir(dataset: str, path: Path, fix: str) -> Path:
    """``path`` if it is an existing folder, else a :class:`DataError` ending with ``fix``."""
    if not path.is_dir():
        what = "is not a folder" if path.exists() else "does not exist"
        raise DataError(f"{dataset}: data folder {path} {what}; {fix}")
    return path


def unreadable(dataset: str, path: Path, exc: PermissionError) -> DataError:
    """A file the system will not let fedlt read: its permissions are the fix, not a fresh copy of it."""
    return DataError(f"{dataset}: cannot read {path} ({exc.strerror or exc}); give the account running fedlt read "
                     "access to it")


def check_labels(dataset: str, where: Path | str, labels: torch.Tensor, num_classes: int, fix: str) -> None:
    """Raise :class:`DataError` unless every label lies in ``[0, num_classes)``."""
    if labels.numel() == 0:
        return
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= num_classes:
        bad = low if low < 0 else high
        raise DataError(
            f"{dataset}: label {bad} in {where} is outside [0, {num_classes}) "
            f"for a dataset with {num_classes} classes; {fix}"
        )


def read_rgb(dataset: str, path: Path, fix: str, min_side: int | None = None) -> Image.Image:
    """Decode one image file as RGB, any failure becoming a :class:`DataError` naming ``path``.

    ``min_side`` lets JPEG decoding skip detail that a later downscale would throw away:
    the decoder picks the coarsest scale that still keeps both sides at least ``min_side``.
    """
    try:
        with Image.open(path) as image:
            if min_side is not None:
                image.draft("RGB", (min_side, min_side))
            if image.mode.startswith("I;16"):  # 16-bit greyscale: convert() would clip it at 255
                return Image.fromarray((np.asarray(image, dtype=np.uint16) >> 8).astype(np.uint8)).convert("RGB")
            if image.mode in ("I", "F"):  # 32-bit integer or float pixels: no one scale to 8 bits
                raise ValueError(f"mode {image.mode} (32-bit pixels) has no 8-bit scale; save it as 8-bit")
            return image.convert("RGB")
    except FileNotFoundError as exc:
        raise DataError(f"{dataset}: image {path} does not exist; {fix}") from exc
    except PermissionError as exc:
        raise unreadable(dataset, path, exc) from None
    except DECODE_ERRORS as exc:
        raise DataError(f"{dataset}: cannot decode image {path} ({type(exc).__name__}: {exc}); {fix}") from exc


def to_chw(image: Image.Image) -> np.ndarray:
    """An RGB PIL image as a (3, H, W) uint8 array."""
    return np.asarray(image, dtype=np.uint8).transpose(2, 0, 1)


#: where a container's memory limit, use and statistics are read (cgroup v2, then v1), and the statistic
#: of the use that is reclaimable page cache; a limit of "max" or a huge number: none
CGROUP_MEMORY = (
    (Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current"), Path("/sys/fs/cgroup/memory.stat"),
     "inactive_file"),
    (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes"),
     Path("/sys/fs/cgroup/memory/memory.stat"), "total_inactive_file"),
)


def _container_headroom() -> int | None:
    """Bytes left under the process's cgroup memory limit: a container's limit is invisible in
    ``MemAvailable``, and crossing it gets the process killed instead of an error. The use counts
    page cache the kernel reclaims when needed; its inactive part is not counted, as container tools do."""
    for limit_file, usage_file, stat_file, reclaimable in CGROUP_MEMORY:
        try:
            limit = limit_file.read_text().strip()
            if limit == "max" or int(limit) >= 1 << 60:
                return None
            used = int(usage_file.read_text().strip())
        except (OSError, ValueError):
            continue
        try:
            stats = dict(line.split() for line in stat_file.read_text().splitlines() if len(line.split()) == 2)
            used -= int(stats.get(reclaimable, 0))
        except (OSError, ValueError):
            pass
        return max(int(limit) - used, 0)
    return None


def available_memory() -> int | None:
    """Bytes of memory the process can get without swapping: Linux's ``MemAvailable``, or less where a
    container's memory limit leaves less; None where neither is known."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    headroom = _container_headroom()
    return free if headroom is None else headroom if free is None else min(free, headroom)


def unextracted(folders: Sequence[Path], archives: Sequence[str]) -> str | None:
    """How to extract the first of ``archives`` found in ``folders``: a release downloaded but not
    unpacked, which an error about the missing files alone would leave the user puzzling over."""
    for folder in folders:
        for name in archives:
            if (folder / name).is_file():
                return f"{folder / name} is there but not extracted: run `tar -xzf {name}` in {folder}"
    return None


def check_memory(dataset: str, images: int, shape: tuple[int, int, int], bytes_per_value: int = 1) -> None:
    """Refuse, before allocating, images that need more memory than the system has available: at a
    large ``data.image_size`` they would fail mid-allocation, or be killed by the system later."""
    need, free = images * int(np.prod(shape)) * bytes_per_value, available_memory()
    if free is not None and need > free:
        raise DataError(f"{dataset}: {images} images at {shape[-2]}x{shape[-1]} px need about {need / 1e9:.1f} GB of "
                        f"memory, more than the {free / 1e9:.1f} GB available; use a smaller data.image_size")


def decode_all(
    paths: Sequence[Path], decode: Callable[[Path], np.ndarray], shape: tuple[int, int, int], dataset: str
) -> torch.Tensor:
    """Decode ``paths`` into one uint8 tensor of shape ``(len(paths), *shape)``.

    Threads are enough: PIL releases the GIL while it decodes, and threads keep the
    exceptions ``decode`` raises (a :class:`DataError` naming the file) intact. Every image is
    tried: the error names the first refused one and counts the others, with a few of their names,
    so a folder of many bad images is not fixed one run at a time.
    """
    check_memory(dataset, len(paths), shape)
    out = np.empty((len(paths), *shape), dtype=np.uint8)
    refused: dict[int, DataError] = {}

    def fill(start: int, stop: int) -> None:
        for i in range(start, stop):
            try:
                out[i] = decode(paths[i])
            except DataError as err:
                refused[i] = err

    if len(paths) < _PARALLEL_MIN:
        fill(0, len(paths))
    else:
        workers = min(32, os.cpu_count() or 1)
        step = max(64, len(paths) // (workers * 8))
        with ThreadPoolExecutor(max_workers=workers) as pool:
            jobs = [pool.submit(fill, i, min(i + step, len(paths))) for i in range(0, len(paths), step)]
            try:
                for job in jobs:
                    job.result()
            except BaseException:
                for job in jobs:
                    job.cancel()
                raise
    if refused:
        first, *others = sorted(refused)
        if not others:
            raise refused[first]
        named = ", ".join(f"{paths[i].parent.name}/{paths[i].name}" for i in others[:_NAMED_REFUSALS])
        rest = len(others) - _NAMED_REFUSALS
        raise DataError(f"{refused[first]} ({len(others)} more image(s) are refused too: {named}"
                        + (f" and {rest} more)" if rest > 0 else ")")) from refused[first]
    return torch.from_numpy(out)
