"""Registries that other packages extend through entry points.

A package declares ``[project.entry-points."fedlt.methods"]`` or ``"fedlt.calibrations"`` in its
pyproject.toml; a :class:`PluginRegistry` loads those entry points the first time it is used, once
per process. Discovery needs no import or flag, so the CLI, bench workers, ``run.backend=parallel``
workers and Flower SuperNodes each find the same plug-ins as long as the package is installed
where they run. A plug-in never replaces a name silently: a clash, an import failure or a wrong
type is one :class:`~fedlt.errors.ConfigError` naming the entry point, its distribution and the fix.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, MutableMapping
from importlib.metadata import EntryPoint, entry_points
from typing import Callable, Generic, TypeVar

from fedlt.errors import ConfigError

T = TypeVar("T")


def distribution(ep: EntryPoint) -> str:
    """The installed distribution that declares ``ep``, as ``name version``."""
    return f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else "an unknown distribution"


def _dist_name(ep: EntryPoint) -> str:
    return ep.dist.name if ep.dist is not None else "<the plug-in>"


class PluginRegistry(MutableMapping[str, T], Generic[T]):
    """Name -> entry: fedlt's built-ins, anything registered in code (``REGISTRY[name] = x``),
    and the plug-ins of entry-point ``group``, loaded on first use.

    ``check(name, loaded)`` turns what an entry point loads into an entry, or raises TypeError or
    ValueError with the problem and its fix (completed here with the entry point's identity)."""

    def __init__(self, group: str, kind: str, builtins: dict[str, T], check: Callable[[str, object], T]):
        self.group, self.kind = group, kind
        self._entries: dict[str, T] = dict(builtins)
        self._builtins = dict(builtins)
        self._check = check
        self._plugins: dict[str, tuple[T, EntryPoint]] = {}  # name -> (what it loaded, its entry point)
        self._discovered = False
        self._loader: int | None = None  # the thread loading the plug-ins, while it does
        self._lock = threading.Lock()

    # -- discovery ----------------------------------------------------------------------------
    def _discover(self) -> None:
        if self._discovered or self._loader == threading.get_ident():
            return  # the loader itself: a plug-in that reads the registry while it loads sees the rest
        with self._lock:  # another thread waits for the plug-ins rather than run without them
            if self._discovered:
                return
            self._loader = threading.get_ident()
            try:
                found = self._load_all()
            finally:
                self._loader = None
            self._entries.update({name: entry for name, (entry, _) in found.items()})
            self._plugins.update(found)
            self._discovered = True

    def _load_all(self) -> dict[str, tuple[T, EntryPoint]]:
        """Every entry point of the group, loaded and checked; nothing is registered unless all are."""
        found: dict[str, tuple[T, EntryPoint]] = {}
        for ep in sorted(entry_points(group=self.group), key=lambda e: (e.name, distribution(e))):
            where = f"plug-in {self.kind} '{ep.name}' (entry point {ep.name} = {ep.value} in {distribution(ep)})"
            uninstall = f"pip uninstall {_dist_name(ep)}"
            if ep.name in found:
                other = found[ep.name][1]
                raise ConfigError(f"{where} has the name of the one in {distribution(other)}; rename one entry point "
                                  f'under [project.entry-points."{self.group}"] or {uninstall}')
            if ep.name in self._entries:
                owner = "fedlt's built-in" if ep.name in self._builtins else "the one registered in code as"
                raise ConfigError(f"{where} has the name of {owner} {self.kind} '{ep.name}'; rename the entry point "
                                  f'under [project.entry-points."{self.group}"] or {uninstall}')
            try:
                loaded = ep.load()
            except Exception as err:
                reason = (str(err).strip().splitlines() or [""])[0]
                raise ConfigError(f"{where} failed to load ({type(err).__name__}: {reason}); fix its module or "
                                  f"{uninstall}") from err
            try:
                found[ep.name] = (self._check(ep.name, loaded), ep)
            except (TypeError, ValueError) as err:
                raise ConfigError(f"{where} {err}") from None
        return found

    def forget_plugins(self) -> None:
        """Drop the plug-ins found so far; the next use looks for entry points again (for tests
        that change ``sys.path``; a process otherwise discovers once)."""
        with self._lock:
            for name, (entry, _) in self._plugins.items():
                if self._entries.get(name) is entry:  # not replaced in code since
                    del self._entries[name]
            self._plugins.clear()
            self._discovered = False

    def origin(self, name: str) -> str | None:
        """``distribution version`` of the plug-in ``name``; None for a built-in or one registered in code."""
        self._discover()
        entry, ep = self._plugins.get(name, (None, None))
        return distribution(ep) if ep is not None and self._entries.get(name) is entry else None

    def provenance(self, name: str) -> str | None:
        """Where the code of ``name`` comes from when it is not fedlt's own: ``plug-in DIST VERSION`` or
        ``registered in code``; None for a built-in (fedlt's source hash names it)."""
        if (origin := self.origin(name)) is not None:
            return f"plug-in {origin}"
        return "registered in code" if self.in_code_only(name) else None

    def in_code_only(self, name: str) -> bool:
        """Whether ``name`` is registered in this process's code (``REGISTRY[name] = ...``), neither a built-in
        nor an entry point: a new process (a worker, a Flower node) that looks it up by name does not find
        it, or finds another."""
        self._discover()
        entry = self._entries.get(name)
        return entry is not None and entry is not self._builtins.get(name) \
            and entry is not self._plugins.get(name, (None, None))[0]

    # -- the mapping --------------------------------------------------------------------------
    def __getitem__(self, name: str) -> T:
        self._discover()
        return self._entries[name]

    def __setitem__(self, name: str, entry: T) -> None:
        self._entries[name] = entry

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __contains__(self, name: object) -> bool:
        self._discover()
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        self._discover()
        return iter(list(self._entries))

    def __len__(self) -> int:
        self._discover()
        return len(self._entries)

    def __repr__(self) -> str:
        return f"PluginRegistry({self.group!r}, {list(self._entries)})"
