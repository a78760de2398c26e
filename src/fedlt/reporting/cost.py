"""What a suite cost, as its own ``bench-log.jsonl`` measured it (never a figure typed into a file).

Each finished cell appends one record with its end time, wall and CPU seconds; a cell run again
(failed, interrupted) appends another, and the last ``ok`` record of a cell counts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path


@dataclass
class SuiteCost:
    cells: int
    cpu_s: float  # sum over cells (a cell's process and its finished children)
    cell_wall_s: float  # sum over cells of their own wall time
    span_s: float  # first cell's start to last cell's end (pauses between invocations included)

    def sentence(self) -> str:
        return (f"Measured by this run (bench-log.jsonl): {self.cells} cells, {self.cpu_s / 60:.1f} CPU-minutes, "
                f"{_minutes(self.span_s)} wall from the first cell's start to the last cell's end, pauses "
                f"between bench calls included ({_minutes(self.cell_wall_s)} of cell time summed over cells; "
                "failed cells count none).")


def _minutes(seconds: float) -> str:
    minutes, sec = divmod(int(round(seconds)), 60)
    return f"{minutes // 60} h {minutes % 60} min" if minutes >= 60 else f"{minutes} min {sec} s"


def finished_records(log: Path) -> list[dict]:
    """The last ``ok`` record of each cell (by its place in the suite: setting/row/seed folders, so
    a folder named absolutely in one run and relatively in another is one cell; else by cell
    label) whose folder is still beside the log: a cell deleted to be run again, or dropped from
    the suite, no longer counts. Empty without a log."""
    if not log.is_file():
        return []
    last: dict[str, dict] = {}
    for line in log.read_bytes().splitlines():
        try:
            record = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError):  # a line cut by a killed run
            continue
        if _well_formed(record) and record.get("status") == "ok":
            where = record.get("run_dir")
            last["/".join(Path(where).parts[-3:]) if where else record.get("cell")] = record
    return [r for place, r in last.items() if not r.get("run_dir") or (log.parent / place).is_dir()]


def _well_formed(record: object) -> bool:
    """A record as the bench writes it: a naive local ISO time, numeric seconds, a string folder."""
    if not isinstance(record, dict) or not isinstance(record.get("time"), str):
        return False
    try:
        naive = datetime.fromisoformat(record["time"]).tzinfo is None
        float(record.get("wall_s", 0)), float(record.get("cpu_s", 0))
    except (TypeError, ValueError):
        return False
    return naive and isinstance(record.get("run_dir", ""), (str, type(None)))


def suite_cost(log: Path) -> SuiteCost | None:
    """The cost of the cells that finished, or None without a log (or without a finished cell)."""
    records = finished_records(log)
    if not records:
        return None
    ends = [datetime.fromisoformat(r["time"]) for r in records]
    starts = [end - timedelta(seconds=float(r.get("wall_s", 0))) for end, r in zip(ends, records)]
    return SuiteCost(len(records), sum(float(r.get("cpu_s", 0)) for r in records),
                     sum(float(r.get("wall_s", 0)) for r in records), (max(ends) - min(starts)).total_seconds())


def cpu_seconds_by_row(log: Path) -> dict[str, list[float]]:
    """CPU seconds of each finished cell, per row: the middle part of its label ``setting / row / seed S``."""
    rows: dict[str, list[float]] = {}
    for r in finished_records(log):
        row = str(r.get("cell", "")).rsplit(" / ", 1)[0].partition(" / ")[2]
        rows.setdefault(row, []).append(float(r.get("cpu_s", 0)))
    return rows
