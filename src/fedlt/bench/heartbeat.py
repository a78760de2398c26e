"""What a bench's running cells have reached, once a minute: cells train without progress lines of
their own (those of parallel cells would interleave), and a cell of the reference protocol takes
minutes, so without this a bench says nothing between the ends of its cells."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from fedlt.engine.checkpoint import CHECKPOINT_FILE
from fedlt.results import CONFIG_FILE, METRICS_FILE, counted

#: seconds between two lines (tests shorten it)
HEARTBEAT_S = 60.0


def cell_progress(run_dir: Path, since: float, validation: bool = False) -> str | None:
    """``round 12/50, acc 61.20``: the last evaluated round of a cell whose files changed after
    ``since`` (epoch seconds), from its metrics.jsonl (rows are written when a round is evaluated);
    ``started, 50 rounds`` before its first; None for a cell not running since then (or gone).
    ``validation``: a grid's candidate, whose validation accuracy is shown (``val acc``), never its test's."""
    metrics = run_dir / METRICS_FILE
    try:
        changed = [p.stat().st_mtime for p in (metrics, run_dir / CONFIG_FILE, run_dir / CHECKPOINT_FILE)
                   if p.is_file()]
        if not changed or max(changed) < since:
            return None
        total = ((yaml.safe_load((run_dir / CONFIG_FILE).read_text()) or {}).get("fl") or {}).get("rounds", "?")
        rows = []
        for line in (metrics.read_text().splitlines() if metrics.is_file() else []):
            try:  # written meanwhile: a cut-off last line is skipped
                rows.append(json.loads(line))
            except ValueError:
                continue
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    rounds = [r for r in rows if isinstance(r, dict) and isinstance(r.get("round"), int)]
    if not rounds:
        return f"started, {counted(total, 'round')}"
    key = "val_acc" if validation else "acc"
    accs = [r[key] for r in rounds if isinstance(r.get(key), (int, float))]
    return f"round {rounds[-1]['round']}/{total}" + (f", {key.replace('_', ' ')} {accs[-1]:.2f}" if accs else "")


@contextmanager
def heartbeat(running: Callable[[], Iterable], echo: Callable[[str], None], prefix: str) -> Iterator[None]:
    """Every HEARTBEAT_S seconds, one line naming each of ``running()``'s cells (``.label``, ``.run_dir``,
    ``.is_candidate``) that has written a round since this began."""
    stop, since = threading.Event(), time.time()

    def beat() -> None:
        while not stop.wait(HEARTBEAT_S):
            parts = [f"{cell.label}: {where}" for cell in running()
                     if (where := cell_progress(cell.run_dir, since, cell.is_candidate))]
            if parts:
                echo(f"{prefix} running | " + " | ".join(parts))

    thread = threading.Thread(target=beat, name="bench-heartbeat", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
