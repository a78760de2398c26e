"""On-disk cache for tensors that are slow to rebuild from their source files (decoded JPEGs).

An entry's file name hashes the source files' paths and the build parameters (which data)
and their sizes and modification times (which content; also those of the files a source names,
such as a list file's images), so editing a source file makes the old entry unreachable; storing
the new one deletes it. Entries are written to a temporary file and renamed, so a crash or a
parallel run never leaves a half-written entry behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from fedlt.errors import interrupt_kept

# Bump when the decoding changes, so entries written by older code are not reused.
_FORMAT = 1


def cache_root() -> Path:
    """``$FEDLT_CACHE``, or ``~/.cache/fedlt`` when it is unset or empty."""
    return Path(os.environ.get("FEDLT_CACHE") or "~/.cache/fedlt").expanduser()


def entry_path(tag: str, sources: Sequence[Path], params: Mapping[str, object],
               watched: Sequence[Path] = ()) -> Path:
    """The cache file for data named ``tag`` built from ``sources`` with ``params``. ``watched`` are
    files the sources name (a list file's images): their sizes and modification times are part of
    the content, without resolving each path again (one is absent: the entry misses)."""
    resolved = [str(Path(p).resolve()) for p in sources]
    which = json.dumps([_FORMAT, tag, resolved, sorted(params.items())], default=str)
    stats = [_size_and_time(p) for p in (*resolved, *watched)]
    content = json.dumps(stats[:len(resolved)]) + (f"+{_digest(json.dumps(stats[len(resolved):]))}" if watched else "")
    return cache_root() / f"{tag}-{_digest(which)}-{_digest(content)}.pt"


def _size_and_time(path: str | Path) -> tuple[int, int] | None:
    try:
        stat = os.stat(path)
    except (OSError, ValueError):  # absent, a symlink loop, a name too long or with a NUL byte: the entry
        return None  # misses, and the reader names the file
    return stat.st_size, stat.st_mtime_ns


def load(path: Path) -> dict[str, torch.Tensor] | None:
    """The tensors stored at ``path``, or ``None`` when there is no usable entry."""
    if not path.is_file():
        return None
    try:
        content = torch.load(path, map_location="cpu", weights_only=True)
    except Exception:  # a damaged entry is only a cache miss: it gets rebuilt and overwritten
        return None
    if not isinstance(content, dict) or not all(isinstance(v, torch.Tensor) for v in content.values()):
        return None
    return content


def store(path: Path, tensors: Mapping[str, torch.Tensor]) -> None:
    """Write ``tensors`` to ``path`` atomically and drop stale entries for the same data.

    A cache that cannot be written only costs time, so a failure is one warning line on stderr.
    """
    temp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with interrupt_kept(), tempfile.NamedTemporaryFile(dir=path.parent, prefix=f".{path.name}.",
                                                           delete=False) as handle:
            temp = Path(handle.name)
            torch.save(dict(tensors), handle)
        os.replace(temp, path)
        temp = None
        same_data = path.name.rsplit("-", 1)[0]
        for stale in path.parent.glob(f"{same_data}-*.pt"):
            if stale != path:
                stale.unlink(missing_ok=True)
    except OSError as exc:
        print(f"fedlt: warning: could not write the data cache {path} ({exc.strerror or exc}); set FEDLT_CACHE to a "
              "writable folder", file=sys.stderr, flush=True)
    finally:
        if temp is not None:
            temp.unlink(missing_ok=True)


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]
