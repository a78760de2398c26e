"""Which code produced a table's numbers, from ``summary["environment"]`` of its runs.

A row's seeds are averaged and paired as one method, so they should come from one version of fedlt.
Each table names the versions behind it (:func:`fedlt.environment.code_version`: the source hash,
else the git commit of a run from before fedlt hashed its sources) with how many runs each, and
marks a row whose runs name more than one. A run resumed by other code than started it names both
(``A then B``), as its own version. A ``+dirty`` commit is that commit plus uncommitted changes: code
that cannot be identified afterwards.
"""

from __future__ import annotations

from fedlt.environment import code_version
from fedlt.reporting.collect import Row, Run

MIXED_MARK = "‡"
NOT_RECORDED = "not recorded"


def version(run: Run) -> str:
    """The run's code version; a run resumed by other code names each, in order (``A then B``)."""
    segments = run.summary.get("segments")
    envs = [s.get("environment") for s in segments if isinstance(s, dict)] if isinstance(segments, list) \
        else [run.summary.get("environment")]
    versions = [(code_version(env) if isinstance(env, dict) else None) or NOT_RECORDED for env in envs]
    return " then ".join(dict.fromkeys(versions)) or NOT_RECORDED


def by_version(runs: list[Run]) -> dict[str, list[Run]]:
    """The runs grouped by code version, in order of first appearance."""
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(version(run), []).append(run)
    return groups


def mixed(row: Row) -> bool:
    return len(by_version(row.runs)) > 1


def code_lines(runs: list[Run], rows: list[Row]) -> list[str]:
    """``Code:`` with each version and its number of runs, then one footnote per row of mixed code
    (variant rows share their method row's runs and its footnote)."""
    if not runs:
        return []
    listed = ", ".join(f"{v} ({len(g)} run{'s' * (len(g) > 1)})" for v, g in by_version(runs).items())
    lines = [f"Code: {listed}"]
    for row in rows:
        if row.variant is None and mixed(row):
            parts = [f"{v} (seed{'s' * (len(g) > 1)} {', '.join(str(r.seed) for r in g)})"
                     for v, g in by_version(row.runs).items()]
            lines += ["", f"> {MIXED_MARK} {row.label}: its seeds ran different code: {'; '.join(parts)}"]
    return lines
