"""The Python API: ``fedlt.run(config) -> RunResult``."""

from __future__ import annotations

import copy
import shlex
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from fedlt.config import Config, apply_overrides, build_config, load_config, override_list
from fedlt.engine.simulation import RESUME_MAY_CHANGE, RunResult, Simulation, check_resumable
from fedlt.environment import keyed_compile_cache
from fedlt.errors import ConfigError
from fedlt.methods.registry import METHODS
from fedlt.engine.checkpoint import CHECKPOINT_FILE
from fedlt.results import CONFIG_FILE, RUN_FILES, new_run_dir, write_atomic, writing
from fedlt.run_parts import check_config, check_new_config, method_notes, setup_parts, unread_settings


def prepare(cfg: Config) -> Simulation:
    """Validate everything that can fail on user input — method, loss, data, model — before any
    file is written, so a bad config leaves no half-written run directory."""
    sim = Simulation(cfg, *setup_parts(cfg))
    if cfg.run.compile:
        keyed_compile_cache()
        sim.worker.compile()
    return sim


def run(config: Config | dict[str, Any] | str | Path | None = None, *, overrides: list[str] | None = None,
        quiet: bool = False) -> RunResult:
    """Run one experiment. ``config`` is a Config, a nested dict, or a YAML path; ``overrides`` are
    ``key=value`` strings applied on top."""
    if config is not None and not isinstance(config, (Config, dict, str, Path)):
        raise ConfigError(f"config must be a fedlt Config, a dict or a YAML file's path, not an object of type {type(config).__name__}"
                          "; key=value strings go in overrides=[...]")
    if isinstance(config, (Config, dict)):
        tree = config.dump() if isinstance(config, Config) else copy.deepcopy(config)
        cfg = build_config(apply_overrides(tree, overrides or []))
    else:
        cfg = load_config(config, overrides)
    if cfg.engine == "flower":
        return _run_flower(cfg, quiet)
    check_new_config(cfg)
    _note_unread(cfg, quiet)
    sim = prepare(cfg)
    run_dir = new_run_dir(cfg)
    return sim.run(run_dir, quiet=quiet)


def _run_flower(cfg: Config, quiet: bool, resume: Path | None = None) -> RunResult:
    """The config on Flower's simulation engine, or the run in ``resume`` from its checkpoint; checked
    first, so a bad config starts no Ray."""
    spec = check_config(cfg) if resume else check_new_config(cfg)
    if spec.pooled:
        raise ConfigError(f"method {cfg.method} trains on pooled data; run it with engine=inprocess")
    try:
        from fedlt.engine.flower_app import resumable_on_nodes, simulate
    except ImportError:
        raise ConfigError("engine=flower needs Flower: pip install 'fedlt[flower]'") from None
    if resume is None:
        _note_unread(cfg, quiet)
    elif resumable_on_nodes(cfg, resume)[0].get("deployed"):  # refused before Ray starts
        raise ConfigError(f"{resume} ran on a deployment's SuperNodes; resume it there, with fedlt deploy --resume "
                          f"{resume} and the deployment's options")
    return simulate(cfg, quiet=quiet, resume=resume)


def _note_unread(cfg: Config, quiet: bool) -> None:
    """A line per setting that the run records but never reads (the config stays as given), and per
    pairing of settings under which its method has failed."""
    if not quiet:
        for line in [*unread_settings(cfg), *method_notes(cfg)]:
            print(f"note: {line}", file=sys.stderr, flush=True)


def resume(run_dir: str | Path, *, overrides: list[str] | None = None, quiet: bool = False) -> RunResult:
    """Continue a run from its last checkpoint; the result equals an uninterrupted run's. ``overrides``
    may change only what a resume may (``run.*``, ``data.root``, ``eval.batch_size``: where the run's
    files and data are, how it is executed). A new ``data.root`` is written into the run's
    ``config.yaml``; the others hold for this resume, and the summary's ``segments`` record them."""
    if not isinstance(run_dir, (str, Path)):
        raise ConfigError(f"run_dir must be a run directory's path (str or Path), not an object of type {type(run_dir).__name__}")
    run_dir = Path(run_dir)
    if run_dir.is_file() and (run_dir.parent / CONFIG_FILE).is_file():
        raise ConfigError(f"{run_dir} is a file of a run; pass its directory, fedlt run --resume {run_dir.parent}")
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"{run_dir} is not a fedlt run directory (no {CONFIG_FILE}); pass the directory of a run")
    overrides = override_list(overrides)
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in ("run.name", "run.out_dir"):
            raise ConfigError(f"{key}: a resumed run stays in its folder {run_dir}; copy that folder to go on "
                              "elsewhere, and resume the copy")
        if not key.startswith(RESUME_MAY_CHANGE):
            raise ConfigError(f"{key}: a resumed run goes on with its saved config; only run.*, data.root and "
                              "eval.batch_size may change (where its files and data are, how it runs); for "
                              f"another {key}, start a new run with it")
    cfg = load_config(run_dir / CONFIG_FILE, overrides)
    if cfg.method not in METHODS:  # a plug-in's run, resumed where the plug-in is not installed
        raise ConfigError(f"{run_dir} ran method '{cfg.method}', which no installed method or plug-in provides; install "
                          "the plug-in that registers it (a finished run's summary.json names it under environment."
                          "outside_code), check with `fedlt methods`, then resume")
    if cfg.engine == "flower" and cfg.flower.node_data:
        raise ConfigError(f"{run_dir} ran on SuperNodes that hold their own data; resume it where they run, with "
                          f"fedlt deploy --resume {run_dir} --node-data DIR (and its other options)")
    for name in (*RUN_FILES, CHECKPOINT_FILE):  # found now, not after the training it would throw away
        for written in (name, name + ".tmp", "tmp-" + name):  # and the temporary files it is written through
            if (run_dir / written).exists() and not (run_dir / written).is_file():
                raise ConfigError(f"{run_dir / written} is not a file, where the run writes its {name}; move it out "
                                  "of the run directory, then resume")
    with resumable_when_stopped(run_dir):
        if cfg.engine == "flower":  # on Flower's simulation engine again; a second resume refused before Ray starts
            with writing(run_dir):
                return _run_flower(cfg, quiet, resume=run_dir)
        with writing(run_dir):  # held from here: a second resume is refused before it reads the data
            check_resumable(cfg, run_dir)  # before the data are read: the folder's own faults first
            sim = prepare(cfg)
            saved = load_config(run_dir / CONFIG_FILE)
            if saved.data.root != cfg.data.root:  # where the data are now, for later resumes too
                tree = saved.dump()
                tree["data"]["root"] = cfg.data.root
                write_atomic(run_dir / CONFIG_FILE, yaml.safe_dump(tree, sort_keys=False))
            return sim.run(run_dir, resume=True, quiet=quiet)


@contextmanager
def resumable_when_stopped(run_dir: Path) -> Iterator[None]:
    """A resume interrupted before its rounds (reading the data or the checkpoint, which can take
    minutes) left its folder as it was: its line says so, where the command's fallback said that there
    was nothing to resume. An interrupt in the rounds names the round of the checkpoint it goes on from."""
    try:
        yield
    except KeyboardInterrupt as stop:
        if not getattr(stop, "resume_hint", None) and (run_dir / CHECKPOINT_FILE).is_file():
            stop.resume_hint = f"`fedlt run --resume {shlex.quote(str(run_dir))}` goes on from its checkpoint"
        raise
