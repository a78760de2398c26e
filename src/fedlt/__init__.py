"""fedlt: federated learning on long-tailed data.

``run`` and ``resume`` are imported on first use: the command line imports this package before it
parses its arguments, and torch (which they need) takes seconds to load, a window in which Ctrl-C
ended in a traceback and ``--help`` waited."""

from typing import Any

from fedlt._version import __version__
from fedlt.config import Config, load_config

__all__ = ["Config", "load_config", "resume", "run", "__version__"]


def __getattr__(name: str) -> Any:
    if name in ("run", "resume"):
        from fedlt import api

        return getattr(api, name)
    raise AttributeError(f"module 'fedlt' has no attribute {name!r}")
