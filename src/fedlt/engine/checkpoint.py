"""Resumable checkpoints: server state, per-client state and the engine's counters.

A checkpoint holds only tensors, numbers, strings, lists and dicts, and is read with
``torch.load(weights_only=True)``: resuming a run directory someone shared must not run code,
which unpickling arbitrary objects would. A resumed tensor lands where the uninterrupted run kept it:
state a method keeps on the host (per-class counts, a client's control variate) stays there, so a
resumed GPU run neither waits to read it back nor holds every client's state in device memory.
"""

from __future__ import annotations

import os
import pickle
import zipfile
from collections import Counter, OrderedDict
from pathlib import Path
from typing import Any

import torch

from fedlt.errors import FedltError, interrupt_kept
from fedlt.results import removed_unless_renamed, save_tensors

CHECKPOINT_FILE = "checkpoint.pt"
REFUSED = "written by an older fedlt or not a fedlt checkpoint; start the run again"


#: what ``torch.load(weights_only=True)`` rebuilds, by exact type (a numpy float64 is a float, but not one of these)
CHECKPOINT_LEAVES = (bool, int, float, complex, str, bytes, bytearray, type(None), torch.Size, torch.dtype,
                     torch.device, torch.layout)
CHECKPOINT_CONTAINERS = (dict, OrderedDict, Counter, list, tuple, set)
#: what also crosses a network to and from a Flower node (a client's state there): dicts with string or int keys
PORTABLE_LEAVES = (bool, int, float, str, type(None))
PORTABLE_CONTAINERS = (dict, OrderedDict, list, tuple)


def unsafe_entry(value: Any, path: str, portable: bool = False, _enclosing: tuple[int, ...] = ()) -> str | None:
    """The first entry of ``value`` a checkpoint (with ``portable``, also a Flower node's state) cannot
    keep, as ``path[key]... (its type)``; None if all can. A container inside itself is one: neither a
    Flower record nor a JSON-like state can hold a cycle, and walking it would never end."""
    leaves, containers = (PORTABLE_LEAVES, PORTABLE_CONTAINERS) if portable else \
        (CHECKPOINT_LEAVES, CHECKPOINT_CONTAINERS)
    if isinstance(value, torch.Tensor) or type(value) in leaves:
        return None
    if type(value) not in containers:
        return f"{path} (a {_type_name(value)})"
    if id(value) in _enclosing:
        return f"{path} (a {_type_name(value)} that contains itself)"
    _enclosing = (*_enclosing, id(value))
    if isinstance(value, dict):
        items = value.items()
    else:
        items = enumerate(value) if not isinstance(value, set) else ((None, v) for v in value)
    for key, item in items:
        if isinstance(value, dict) and (found := _unsafe_key(key, path, portable)) is not None:
            return found
        item_path = path if key is None else f"{path}[{key!r}]"
        if (found := unsafe_entry(item, item_path, portable, _enclosing)) is not None:
            return found
    return None


def _type_name(value: Any) -> str:
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _unsafe_key(key: Any, path: str, portable: bool) -> str | None:
    if portable and type(key) not in (str, int):
        return f"a key of {path} (a {_type_name(key)})"
    return unsafe_entry(key, f"a key of {path}", portable)


def save_checkpoint(run_dir: Path, state: dict[str, Any]) -> None:
    tmp = run_dir / (CHECKPOINT_FILE + ".tmp")
    with removed_unless_renamed(tmp):
        save_tensors(state, tmp)
        unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(tmp)  # reads the pickle only, not the tensors
        if unsafe:  # a method keeps another type in its state: fail at the first save, not at a resume
            raise TypeError(f"checkpoint state must be tensors, numbers, strings, lists and dicts (what "
                            f"torch.load(weights_only=True) reads); it holds {', '.join(unsafe)}")
        os.replace(tmp, run_dir / CHECKPOINT_FILE)


def load_checkpoint(run_dir: Path, device: torch.device | str = "cpu", mmap: bool = False) -> dict[str, Any]:
    """The checkpoint of ``run_dir``, its tensors on ``device`` (see the module's docstring), or with
    ``mmap`` mapped from the file instead of read (to look at a checkpoint without its cost)."""
    path = run_dir / CHECKPOINT_FILE
    if not path.is_file():
        raise FedltError(f"{run_dir} has no {CHECKPOINT_FILE}: the run stopped before its first checkpoint (saved "
                         "every run.checkpoint_every rounds and after the last), so there is nothing to resume; "
                         "start it again")
    if not zipfile.is_zipfile(path):  # torch.save's format; a bare pickle is never unpickled
        raise FedltError(f"{path} is not a complete torch checkpoint: cut off, damaged, {REFUSED}")
    device = torch.device(device)
    saved_on: set[str] = set()
    state = _read(path, _where_it_was(device, saved_on), mmap)
    if saved_on == {"cpu"} and device.type != "cpu":  # a CPU run resumed on a device: which of its host
        state = _read(path, device, mmap)             # tensors must move is unknown, so all of them do
    return state


def _read(path: Path, map_location, mmap: bool) -> dict[str, Any]:
    try:
        with interrupt_kept():  # a Ctrl-C while reading must not be taken for a damaged file
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:  # weights_only refused an object before building it
        raise FedltError(f"{path} holds Python objects that fedlt does not load (unpickling them could run code): "
                         f"{REFUSED}") from None
    except (torch.cuda.OutOfMemoryError, MemoryError):  # a sound checkpoint that does not fit: not the file's fault
        raise
    except Exception as err:  # a truncated or foreign file: tell the user which one
        raise FedltError(f"{path} is not a readable fedlt checkpoint ({type(err).__name__}); "
                         "delete it and start the run again") from None


def _where_it_was(device: torch.device, saved_on: set[str]):
    """``torch.load``'s ``map_location``: a host storage stays on the host, a device one goes to ``device``
    (the run's device now, whichever index or kind saved it); ``saved_on`` collects the places seen."""
    def place(storage, location: str):
        saved_on.add(location)
        return storage if location == "cpu" else torch.serialization.default_restore_location(storage, str(device))
    return place
