"""Where a table's numbers were measured, from ``summary["environment"]`` of its runs.

Accuracy should not depend on the machine, but kernels, thread counts and torch versions do move
the last digits (and all timings): a table says what it was measured on, and says so loudly
when its cells come from different environments.
"""

from __future__ import annotations

from typing import Any

from fedlt.environment import describe as describe_environment
from fedlt.reporting.collect import Run

#: the keys that make two environments different for a table (not the commit or the OS patch level)
IDENTITY = ("torch", "cpu", "cpu_capability", "gpu", "threads")
NOT_RECORDED = "not recorded"


def describe(env: Any) -> str:
    """The run's machine and software in one line, without its commit; ``not recorded`` for runs from
    before fedlt recorded it."""
    if not isinstance(env, dict) or not any(env.get(k) is not None for k in IDENTITY):
        return NOT_RECORDED
    return describe_environment({**env, "git_commit": None})  # the table's code line names every version


def environment_lines(runs: list[Run]) -> list[str]:
    """One ``Measured on:`` line, or a note listing the environments when the runs differ."""
    groups: dict[tuple | None, list[Run]] = {}
    for run in runs:
        env = run.summary.get("environment")
        key = None if describe(env) == NOT_RECORDED else tuple(str(env.get(k)) for k in IDENTITY)
        groups.setdefault(key, []).append(run)
    if len(groups) <= 1:
        env = runs[0].summary.get("environment") if runs else None
        return [f"Measured on: {describe(env)}"]
    listed = "; ".join(f"{describe(g[0].summary.get('environment'))} ({len(g)} run{'s' * (len(g) > 1)})"
                       for g in groups.values())
    return [f"> note: cells of this table were measured on {len(groups)} different environments: {listed}"]
