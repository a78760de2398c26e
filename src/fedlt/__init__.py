"""fedlt: federated learning on long-tailed data.

``run``, ``resume``, ``Config`` and ``load_config`` are imported on first use: the command line
imports this package before it can catch a Ctrl-C, and torch (which runs need) takes seconds to load,
pydantic (the config) a fraction of one, a window in which Ctrl-C ended in a traceback and ``--help``
waited."""

from typing import Any

from fedlt._version import __version__

__all__ = ["Config", "load_config", "resume", "run", "__version__"]


def __getattr__(name: str) -> Any:
    """``fedlt.run``, ``fedlt.resume``, ``fedlt.Config``, ``fedlt.load_config``, and a subpackage reached
    as an attribute (``fedlt.api``), as when importing the package imported them."""
    import importlib

    if name in ("run", "resume"):
        return getattr(importlib.import_module("fedlt.api"), name)
    if name in ("Config", "load_config"):
        return getattr(importlib.import_module("fedlt.config"), name)
    try:
        return importlib.import_module(f"fedlt.{name}")
    except ModuleNotFoundError as err:
        if err.name != f"fedlt.{name}":
            raise
    raise AttributeError(f"module 'fedlt' has no attribute {name!r}")
