"""A paper's claims, checked as paired differences between two rows of a suite's table.

A claim says "row beats against on metric" (or, with a ``margin``, "row is within margin points
of against"). Its check is the seed-paired difference row - against with its 95% interval
(:func:`fedlt.reporting.stats.paired_difference`) and a verdict that never reads more into the
numbers than the interval does:

* a directional claim **holds** when the interval lies above 0, **does not hold** when it lies
  below 0, and is **not resolved** when it contains 0 (the difference is inside the noise);
* a claim whose rows share no finished seed is **not measured**;
* a closeness claim **holds** when the whole interval lies within ±margin, **does not hold** when
  it lies entirely outside, and is **not resolved** otherwise.

When the paper's own difference is given (``paper_diff``) and falls outside the interval, the
verdict says whether the measured effect is smaller or larger than the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedlt.reporting.collect import Collection, Setting
from fedlt.reporting.stats import PairedDiff, paired_difference

HOLDS, FAILS, UNRESOLVED, UNMEASURED = "holds", "does not hold", "not resolved", "not measured"


@dataclass(frozen=True)
class ClaimSpec:
    paper: str  # who claims it, e.g. "CReFF (IJCAI 2022)"
    claim: str  # the claim in words
    row: str  # the row the paper says is better (or close)
    against: str
    metric: str = "acc"
    paper_figure: str = ""  # the paper's own comparison, in words (table, setting, values)
    paper_diff: float | None = None  # the paper's row - against, in points
    margin: float | None = None  # set: a closeness claim, |row - against| <= margin


@dataclass(frozen=True)
class ClaimCheck:
    spec: ClaimSpec
    setting: str
    diff: PairedDiff | None  # None: the two rows share no seed in this setting
    verdict: str
    remark: str  # e.g. "smaller than the paper's +8.6"; "" when nothing to add


def verdict(spec: ClaimSpec, diff: PairedDiff | None) -> tuple[str, str]:
    """The verdict on one claim from its paired difference, and a remark on the paper's size."""
    if diff is None:
        return UNMEASURED, "the two rows share no finished seed"
    if diff.ci is None:
        return UNRESOLVED, f"{diff.n} paired seed{'s' * (diff.n != 1)}: no interval"
    lo, hi = diff.ci
    if spec.margin is not None:
        m = spec.margin
        result = HOLDS if -m <= lo and hi <= m else FAILS if lo > m or hi < -m else UNRESOLVED
    else:
        result = HOLDS if lo > 0 else FAILS if hi < 0 else UNRESOLVED
    remark = ""
    if spec.paper_diff is not None and not lo <= spec.paper_diff <= hi:
        side = "smaller" if spec.paper_diff > hi else "larger"
        remark = f"{side} than the paper's {spec.paper_diff:+.1f}"
    return result, remark


def check_claims(collection: Collection) -> list[ClaimCheck]:
    """Every claim in every setting that has both of its rows."""
    checks = []
    for spec in collection.claims:
        for setting in collection.settings:
            row, against = _row(setting, spec.row), _row(setting, spec.against)
            if row is None or against is None:
                continue
            diff = paired_difference(row.by_seed(spec.metric), against.by_seed(spec.metric))
            checks.append(ClaimCheck(spec, setting.name, diff, *verdict(spec, diff)))
    return checks


def _row(setting: Setting, label: str):
    return next((r for r in setting.rows if r.label == label), None)


def _measured(diff: PairedDiff | None) -> str:
    if diff is None:
        return "-"
    if diff.ci is None:
        return f"{diff.mean:+.2f} (n={diff.n})"
    return f"{diff.mean:+.2f} [{diff.ci[0]:.2f}, {diff.ci[1]:.2f}] (n={diff.n})"


def claims_section(checks: list[ClaimCheck], metric_names: dict[str, str]) -> list[str]:
    """The claims table, as Markdown lines (empty without claims)."""
    if not checks:
        return []
    several = len({c.setting for c in checks}) > 1
    lines = ["## Claims, checked", "",
             "Measured: the seed-paired difference (row - against) with its 95% interval. A claim holds when "
             "the interval lies on the claimed side of 0 (within ±margin for a closeness claim), does not hold "
             "when it lies on the other side, and is not resolved when it contains 0 (inside the noise).", "",
             "| paper | claim | comparison | paper's figure | measured | verdict |", "|---|---|---|---|---|---|"]
    for c in checks:
        s = c.spec
        what = f"{s.row} - {s.against}, {metric_names.get(s.metric, s.metric)}"
        if s.margin is not None:
            what += f", within ±{s.margin:g}"
        if several:
            what += f" ({c.setting})"
        verdict_text = f"**{c.verdict}**" + (f"; {c.remark}" if c.remark else "")
        cells = [s.paper, s.claim, what, s.paper_figure or "-", _measured(c.diff), verdict_text]
        lines.append("| " + " | ".join(x.replace("|", "/") for x in cells) + " |")
    return lines
