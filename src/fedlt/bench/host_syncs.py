"""Host synchronisations: the calls that make a GPU's queue drain because the host waits for a
value (``.item()``, ``float(t)``, ``if t.any():``) or for a copy from host memory.

A local epoch on a GPU stays fast only if the host never waits inside it: it queues kernels and
moves on. :class:`HostSyncs` counts such calls by name and call site while code runs, on any device,
so a CPU test can prove that a method's training step has none (the same code synchronises on a
GPU). Calls the mode cannot see (a ``.to(device)`` of a host tensor) show in ``fedlt bench profile``'s
GPU columns instead.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

#: calls that read a device value on the host, or whose output size depends on device values
#: (not ``numpy``: it refuses a device tensor, so it only ever reads the host's own data)
READS = frozenset({"item", "__float__", "__int__", "__bool__", "__index__", "tolist", "cpu", "nonzero",
                   "bincount", "unique", "unique_consecutive", "masked_select", "argwhere"})
#: factories that copy host data (a Python list, a NumPy array) to the ``device=`` they are given
COPIES = frozenset({"tensor", "as_tensor"})

_PACKAGE = str(Path(__file__).resolve().parents[1])
_HERE = str(Path(__file__).resolve())


class HostSyncs(TorchFunctionMode):
    """Counts host synchronisations of the code run under it (``with HostSyncs() as syncs:``):
    ``syncs.calls`` maps ``(call, "module.py:line")`` (the innermost fedlt frame) to a count."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str]] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if _synchronises(name, args, kwargs):
            self.calls[(name, _call_site())] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.calls.values())


def _synchronises(name: str, args: tuple, kwargs: dict) -> bool:
    if name in READS:
        return True
    if name in COPIES:
        return kwargs.get("device") is not None and bool(args) and not isinstance(args[0], torch.Tensor)
    if name == "__setitem__" and len(args) > 2 and isinstance(args[2], (bool, int, float)):
        return True  # t[i] = 5.0: the number becomes a host tensor, copied to t's device
    if name in ("__getitem__", "__setitem__") and len(args) > 1:
        return _boolean_mask(args[1])  # t[mask]: the result's size is the mask's count
    return False


def _boolean_mask(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(p, torch.Tensor) and p.dtype == torch.bool for p in parts)


def _call_site() -> str:
    """``file.py:line`` of the innermost frame in the fedlt package outside this module."""
    frame = sys._getframe(2)
    while frame is not None:
        path = frame.f_code.co_filename
        if path.startswith(_PACKAGE) and path != _HERE:
            return f"{Path(path).relative_to(_PACKAGE).as_posix()}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside fedlt"
