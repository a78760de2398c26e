"""Choices made on validation data: a suite row's grid of candidate settings, and the one selected.

A row with ``grid: {method_args.gamma: [1, 4], fl.lr: [0.01, 0.05]}`` runs every combination (a
*candidate*, in its own folder) on every seed of every setting. The report then picks, per row,
the candidate with the highest mean validation metric (``select_on``, default ``val_acc``): the
mean over settings of each setting's mean over seeds, so that one choice must hold across the
suite's settings (``select_per_setting: true`` picks per setting instead). Only the selected
candidate's test accuracy enters the row's table and its paired statistics; the test set is read
once, for the choice already made.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass, field
from typing import Any

#: what a grid row may be selected on: the final round's metrics on the validation set
SELECT_METRICS = ("val_acc", "val_many_acc", "val_medium_acc", "val_few_acc", "val_pm_acc")
#: the candidate of a personal-reading selection (``select_personal``) that is the runs' own reading
AS_RUN = "as run"


def override_text(key: str, value: Any) -> str:
    """``key=value`` as the config's override parser reads it back (YAML scalars, JSON lists)."""
    return f"{key}={value if isinstance(value, str) else json.dumps(value)}"


def candidates(grid: dict[str, list[Any]]) -> list[tuple[str, list[str]]]:
    """``(description, overrides)`` of every combination of ``grid``, in the grid's order."""
    keys = list(grid)
    out = []
    for values in itertools.product(*(grid[k] for k in keys)):
        overrides = [override_text(k, v) for k, v in zip(keys, values)]
        out.append((", ".join(overrides), overrides))
    return out


def candidate_label(row: str, description: str) -> str:
    """The label (and so the folder) of one candidate of ``row``."""
    return f"{row} [{description}]"


@dataclass
class Selection:
    """What was chosen for one grid row, and on what evidence."""

    row: str
    metric: str
    #: candidate description -> setting -> seed -> final-round validation value
    scores: dict[str, dict[str, dict[int, float]]]
    #: setting -> the chosen candidate's description (the same in every setting unless per setting)
    chosen: dict[str, str]
    complete: bool  # every candidate has a value on every expected seed of every setting
    settings: list[str]
    per_setting: bool = False  # each setting chose its own candidate
    #: candidate -> the row label whose folders hold its cells, for candidates of rows that join
    #: this one's choice (``select_with``); the row's own candidates are ``candidate_label(row, c)``
    folders: dict[str, str] = field(default_factory=dict)

    #: candidate -> the cells (``setting / seed S``) where it diverged: a default must never diverge,
    #: so such a candidate is passed over while any other has no diverged cell
    diverged: dict[str, list[str]] = field(default_factory=dict)
    #: candidate -> the variant of its runs it is read through (``select_variants``); absent: the
    #: runs' own global model
    variants: dict[str, str] = field(default_factory=dict)

    def folder(self, candidate: str) -> str:
        """The label (and so the folder) of ``candidate``'s cells."""
        return self.folders.get(candidate, candidate_label(self.row, candidate))

    def mean(self, candidate: str, setting: str) -> float | None:
        values = list(self.scores.get(candidate, {}).get(setting, {}).values())
        return sum(values) / len(values) if values else None

    def overall(self, candidate: str, settings: list[str]) -> float | None:
        means = [self.mean(candidate, s) for s in settings]
        return sum(means) / len(means) if means and all(m is not None for m in means) else None


def select(row: str, metric: str, scores: dict[str, dict[str, dict[int, float]]], settings: list[str],
           expected_seeds: list[int], per_setting: bool, folders: dict[str, str] | None = None,
           diverged: dict[str, list[str]] | None = None, variants: dict[str, str] | None = None) -> Selection:
    """The candidate with the highest mean ``metric`` (ties: the earlier candidate in grid order),
    over all ``settings`` together or per setting. Candidates lacking a value in a setting are
    passed over there; ``complete`` says whether any was. Candidates that ``diverged`` in some cell
    are passed over unless every candidate did (then the mean decides, chance-level cells included)."""
    diverged = diverged or {}
    stable = [c for c in scores if c not in diverged]
    order = stable or list(scores)
    complete = all(set(expected_seeds) <= set(scores[c].get(s, {})) for c in scores for s in settings)
    tmp = Selection(row, metric, scores, {}, complete, settings, per_setting, dict(folders or {}), dict(diverged),
                    dict(variants or {}))

    def best(score) -> str | None:
        scored = [(score(c), -i, c) for i, c in enumerate(order) if score(c) is not None]
        return max(scored)[2] if scored else None

    if per_setting:
        chosen = {s: best(lambda c, s=s: tmp.mean(c, s)) for s in settings}
    else:
        winner = best(lambda c: tmp.overall(c, settings))
        chosen = {s: winner for s in settings}
    tmp.chosen = {s: c for s, c in chosen.items() if c is not None}
    return tmp
