"""A seeded federation written out as one data folder per node, for a real federation.

The federation is drawn exactly as a run draws it (:func:`~fedlt.data.federated.build_federated_data`
with the same config and seed) and written as image folders that each SuperNode reads as its own
data (``flower.node_data``; format and row order in :mod:`fedlt.data.sources.imagefolder`)::

    OUT/nodes/client-<k>/train/<class>/<NNNNNN>.png  client k's rows, in client_indices(k) order
    OUT/nodes/client-<k>/test/<class>/<NNNNNN>.png   client k's local test set (no test/ when empty)
    OUT/server/test/<class>/<NNNNNN>.png              the balanced test set
    OUT/server/val/<class>/<NNNNNN>.png               the validation set (only with data.val_per_class)
    OUT/federation.yaml                               the resolved config to deploy with

``<k>`` is zero-padded to the width of K-1, so sorted node names are client order. ``NNNNNN`` is
the row's position in its split (at least six digits, one width per split), so loading a folder
gives the rows back in order; PNG is lossless, so the pixels come back bit-identical.
``federation.yaml`` has ``data.classes`` filled in, ``flower.node_data: true`` and ``flower.min_nodes`` set to
the number of sites.

The export is written into a hidden ``.OUT.partial-*`` folder beside OUT and renamed to OUT at the
end (into a hidden ``OUT/.partial-*`` folder whose entries are moved up, when OUT is an existing
empty folder: a mount point or a shell's working directory stays the same folder), so an
interrupted export never leaves a half-written OUT.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
from collections.abc import Callable
from concurrent.futures import Executor, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
import yaml
from PIL import Image

from fedlt.config import Config, build_config
from fedlt.data.dataset import ImageDataset
from fedlt.data.declaration import declared_dataset
from fedlt.data.federated import FederatedData, build_federated_data
from fedlt.data.sources.imagefolder import MODES, TEST, TRAIN, class_folder_name
from fedlt.errors import ConfigError, DataError

NODES, SERVER, VAL = "nodes", "server", "val"
FEDERATION_FILE = "federation.yaml"
_MIN_DIGITS = 6
_CHUNK = 256  # images one pool task writes


def client_name(cid: int, num_clients: int) -> str:
    """``client-<cid>``, zero-padded to the width of ``num_clients - 1`` so names sort in client order."""
    return f"client-{cid:0{len(str(num_clients - 1))}d}"


def export_federation(cfg: Config, out: Path | str, progress: Callable[[str], None] | None = None) -> Path:
    """Draw ``cfg``'s federation and write it to the new or empty folder ``out`` (layout above).

    ``progress`` receives a line every tenth of the nodes and when the server's sets are written.
    Returns ``out``.

    Raises
    ------
    DataError
        ``out`` is a file or not empty, a client holds no training rows, the data cannot be
        loaded or written
    ConfigError
        ``data.classes`` does not fit the dataset
    """
    out = Path(out).expanduser().absolute()  # "." has a name and a parent to stage beside
    check_export_folder(out)
    if cfg.data.classes is not None:
        declared_dataset(cfg.data)  # a bad data.classes fails before the data is loaded
    data = build_federated_data(cfg.data, cfg.seed, "cpu")
    classes = _classes(cfg, data)
    federation = _federation_config(cfg, classes)
    empty = [k for k in range(data.num_clients) if len(data.partition.client_indices[k]) == 0]
    if empty:
        raise DataError(f"client {empty[0]} holds no training rows in this federation, so its node would have no "
                        "data; set data.min_client_size=1 or use fewer clients (data.num_clients)")
    if data.train.in_channels not in MODES:
        raise DataError(f"{cfg.data.dataset} has {data.train.in_channels}-channel images, which PNG files cannot "
                        "hold losslessly here; export a dataset of 1 or 3 channels")
    # An existing (empty) folder is kept and filled: renaming a staging folder over it would fail on a
    # mount point (EBUSY, after all the writing) and would leave a shell whose working directory it is
    # in a deleted folder. The staging folder then lies inside it, on the file system the export goes to.
    inside = out.is_dir()
    tag = f".partial-{os.getpid()}-{secrets.token_hex(4)}"
    staging = out / tag if inside else out.parent / f".{out.name}{tag}"
    moved: list[Path] = []
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging.mkdir()
        with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
            _write_nodes(data, classes, staging / NODES, pool, progress)
            _write_server(data, classes, staging / SERVER, pool, progress)
        (staging / FEDERATION_FILE).write_text(yaml.safe_dump(federation, sort_keys=False, allow_unicode=True))
        if inside:  # federation.yaml last: a folder holding it is a complete export
            for name in (NODES, SERVER, FEDERATION_FILE):
                moved.append(out / name)  # before: an interrupt right after the rename still removes it
                os.replace(staging / name, out / name)
        else:
            os.replace(staging, out)
        moved = []
    except OSError as err:
        raise DataError(f"cannot write the export to {out} ({err.strerror or err}); choose a writable, new or "
                        "empty folder with enough space") from err
    finally:
        shutil.rmtree(staging, ignore_errors=True)
        for path in moved:  # a failure between the moves: OUT goes back to empty
            shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
    return out


def check_export_folder(out: Path) -> None:
    """Refuse an export folder that is a file or holds anything, before any work starts; the staging
    folder an export killed outright (SIGKILL, power loss) left in it is removed, not held against it."""
    if out.exists() and not out.is_dir():
        raise DataError(f"export folder {out} is a file; give a new or empty folder")
    if not out.is_dir():
        return
    entries = list(out.iterdir())
    stale = [e for e in entries if _left_by_a_dead_export(e)]
    if len(stale) < len(entries):
        raise DataError(f"export folder {out} is not empty; give a new or empty folder")
    for entry in stale:
        shutil.rmtree(entry, ignore_errors=True)


def _left_by_a_dead_export(entry: Path) -> bool:
    """Whether ``entry`` is the staging folder (``.partial-PID-HEX``) of an export whose process is gone."""
    match = re.fullmatch(r"\.partial-(\d+)-[0-9a-f]{8}", entry.name)
    if match is None or not entry.is_dir() or entry.is_symlink():
        return False
    try:
        os.kill(int(match[1]), 0)
    except (ProcessLookupError, OverflowError):  # no such process (or a pid none can have)
        return True
    except PermissionError:  # another user's live process
        return False
    return False


def _classes(cfg: Config, data: FederatedData) -> list[str]:
    """``data.classes`` where given, else the names the dataset's files gave, checked like a deployment checks them."""
    classes = list(cfg.data.classes or data.train.classes)
    if len(classes) != data.num_classes:
        raise ConfigError(f"data.classes lists {len(classes)} names but {cfg.data.dataset} has {data.num_classes} "
                          f"classes; list {data.num_classes} names in label order or drop data.classes")
    declared = declared_dataset(cfg.data.model_copy(update={"classes": classes}))
    return declared.classes


def _federation_config(cfg: Config, classes: list[str]) -> dict:
    """The config the federation is deployed with: this one, its class names written out, node data on
    Flower, and every site awaited (a server that started with fewer would train without the rest)."""
    tree = cfg.dump()
    tree["data"]["classes"] = classes
    tree["flower"]["node_data"] = True
    tree["flower"]["min_nodes"] = cfg.data.num_clients
    tree["engine"] = "flower"
    tree["data"]["val_per_class"] = 0  # the server reads its validation set from server/val (eval.val_data)
    build_config(tree)  # a config fedlt would refuse to read back must not be written
    return tree


def _write_nodes(data: FederatedData, classes: list[str], folder: Path, pool: Executor,
                 progress: Callable[[str], None] | None) -> None:
    count, written = data.num_clients, 0
    step = max(1, count // 10)
    for k in range(count):
        node = folder / client_name(k, count)
        rows = data.client_indices(k)
        written += _write_split(data.train.subset(rows), classes, node / TRAIN, pool)
        local = torch.as_tensor(data.local_test[k], dtype=torch.int64)
        if len(local):
            written += _write_split(data.test.subset(local), classes, node / TEST, pool)
        if progress is not None and ((k + 1) % step == 0 or k + 1 == count):
            progress(f"nodes {k + 1}/{count} written ({written} images)")


def _write_server(data: FederatedData, classes: list[str], folder: Path, pool: Executor,
                  progress: Callable[[str], None] | None) -> None:
    parts = [f"test {_write_split(data.test, classes, folder / TEST, pool)}"]
    if data.val is not None:
        parts.append(f"validation {_write_split(data.val, classes, folder / VAL, pool)}")
    if progress is not None:
        progress(f"server written ({', '.join(parts)} images)")


def _write_split(split: ImageDataset, classes: list[str], folder: Path, pool: Executor) -> int:
    """``split``'s rows as ``folder/<class>/<position>.png``; returns the number of images."""
    count = len(split)
    digits = max(_MIN_DIGITS, len(str(count - 1)))
    labels = split.labels.tolist()
    class_folders = {label: folder / class_folder_name(classes[label]) for label in set(labels)}
    for path in class_folders.values():
        path.mkdir(parents=True)
    pixels = split.images.cpu().permute(0, 2, 3, 1).contiguous().numpy()  # (N, H, W, C), as PIL wants it
    if pixels.shape[-1] == 1:
        pixels = pixels[..., 0]
    paths = [class_folders[label] / f"{row:0{digits}d}.png" for row, label in enumerate(labels)]
    jobs = [pool.submit(_save_pngs, pixels, paths, start, min(start + _CHUNK, count))
            for start in range(0, count, _CHUNK)]
    try:
        for job in jobs:
            job.result()
    except BaseException:  # an interrupt or a failed write: stop queued writes, the staging folder goes
        for job in jobs:
            job.cancel()
        raise
    return count


def _save_pngs(pixels: np.ndarray, paths: list[Path], start: int, stop: int) -> None:
    for row in range(start, stop):
        Image.fromarray(pixels[row]).save(paths[row], format="PNG")
