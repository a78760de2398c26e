"""A paper's claims, checked as paired differences between two rows of a suite's table.

A claim says "row beats against on metric" (or, with a ``margin``, "row is within margin points
of against"). Its check is the seed-paired difference row - against with its 95% interval and
paired t-test p-value (:func:`fedlt.reporting.stats.paired_difference`) and a verdict that never
reads more into the numbers than the interval does:

* a directional claim **holds** when the interval lies above 0, **does not hold** when it lies
  below 0, and is **not resolved** when it contains 0 (the seeds cannot tell the sign);
* a claim whose rows share no finished seed is **not measured**;
* a closeness claim **holds** when the whole interval lies within ±margin, **does not hold** when
  it lies entirely outside, and is **not resolved** otherwise.

A report checks many claims at once, so each directional verdict is also given with the p-values
of all the report's directional claims adjusted together: by Holm (no false verdict in the family,
with 95% confidence) and by Benjamini-Hochberg (at most 5% of the resolved verdicts false, on
average). A closeness claim is an equivalence claim: its error is calling two rows close, which
the family's adjustment of "is there a difference" p-values does not bound, so it keeps its
interval verdict and gets no adjusted one. A claim's ``seeds``, stated in the suite before it is
measured, is shown beside the number of seeds it was measured on.

When the paper's own difference is given (``paper_diff``) and falls outside the interval, the
verdict says whether the measured effect is smaller or larger than the paper's.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedlt.reporting.collect import Collection, Setting
from fedlt.reporting.stats import ALPHA, PairedDiff, benjamini_hochberg, holm, paired_difference

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
    seeds: int | None = None  # the paired seeds stated in advance


@dataclass(frozen=True)
class ClaimCheck:
    spec: ClaimSpec
    setting: str
    diff: PairedDiff | None  # None: the two rows share no seed in this setting
    verdict: str
    remark: str  # e.g. "smaller than the paper's +8.6"; "" when nothing to add
    holm: str = ""  # the verdict on Holm-adjusted p; "" for a closeness claim
    bh: str = ""  # the verdict on Benjamini-Hochberg-adjusted p; "" for a closeness claim


def verdict(spec: ClaimSpec, diff: PairedDiff | None) -> tuple[str, str]:
    """The verdict on one claim from its paired difference, and a remark on the paper's size."""
    if diff is None:
        return UNMEASURED, "the two rows share no finished seed that measures it (an empty shot group measures none)"
    if diff.ci is None:
        return UNRESOLVED, f"{diff.n} paired seed{'s' * (diff.n != 1)}: no interval"
    lo, hi = diff.ci
    if spec.margin is not None:
        m = spec.margin
        result = HOLDS if -m <= lo and hi <= m else FAILS if lo > m or hi < -m else UNRESOLVED
        if diff.std == 0.0 and 2 * 0.5 ** diff.n >= ALPHA:  # the same difference on every seed: its interval is a
            result = UNRESOLVED                              # point, and the sign test decides, as in the tables
    else:
        result = (HOLDS if diff.mean > 0 else FAILS) if diff.resolved else UNRESOLVED
    remark = ""
    if spec.paper_diff is not None and not lo <= spec.paper_diff <= hi:
        side = "smaller" if spec.paper_diff > hi else "larger"
        remark = f"{side} than the paper's {spec.paper_diff:+.1f}"
    return result, remark


def _in_family(spec: ClaimSpec, diff: PairedDiff | None) -> bool:
    """A directional claim with a p-value: one of the tests the adjustment counts."""
    return spec.margin is None and diff is not None and diff.p is not None


def _adjusted(diff: PairedDiff, p: float) -> str:
    """A directional verdict on an adjusted p-value."""
    return UNRESOLVED if p >= ALPHA else HOLDS if diff.mean > 0 else FAILS


def check_claims(collection: Collection) -> list[ClaimCheck]:
    """Every claim in every setting that has both of its rows, with the family's adjusted verdicts."""
    found = []
    for spec in collection.claims:
        for setting in collection.settings:
            row, against = _row(setting, spec.row), _row(setting, spec.against)
            if row is not None and against is not None:
                found.append((spec, setting.name, paired_difference(row.by_seed(spec.metric),
                                                                    against.by_seed(spec.metric))))
    family = [k for k, (spec, _, diff) in enumerate(found) if _in_family(spec, diff)]
    p = [found[k][2].p for k in family]
    adjusted = {k: (_adjusted(found[k][2], by_holm), _adjusted(found[k][2], by_bh))
                for k, by_holm, by_bh in zip(family, holm(p), benjamini_hochberg(p))}
    checks = []
    for k, (spec, setting, diff) in enumerate(found):
        first, remark = verdict(spec, diff)  # without a p-value a directional claim keeps its verdict
        checks.append(ClaimCheck(spec, setting, diff, first, remark,
                                 *adjusted.get(k, (first, first) if spec.margin is None else ("", ""))))
    return checks


def _row(setting: Setting, label: str):
    return next((r for r in setting.rows if r.label == label), None)


def _measured(diff: PairedDiff | None) -> str:
    if diff is None:
        return "-"
    if diff.ci is None:
        return f"{diff.mean:+.2f}"
    return f"{diff.mean:+.2f} ±{diff.half_width:.2f} [{diff.ci[0]:.2f}, {diff.ci[1]:.2f}]"


def _p(diff: PairedDiff | None) -> str:
    if diff is None or diff.p is None:
        return "-"
    return "<0.001" if diff.p < 0.001 else f"{diff.p:.3g}"  # 3 digits: 0.0499 never reads as 0.05


def seeds_text(c: ClaimCheck) -> str:
    """Seeds measured on, against the count stated in advance: ``5``, ``5 = planned``, ``3 ≠ 5 planned``."""
    used = c.diff.n if c.diff is not None else 0
    if c.spec.seeds is None:
        return str(used)
    return f"{used} = planned" if used == c.spec.seeds else f"{used} ≠ {c.spec.seeds} planned"


def claims_section(checks: list[ClaimCheck], metric_names: dict[str, str]) -> list[str]:
    """The claims table, as Markdown lines (empty without claims)."""
    if not checks:
        return []
    several = len({c.setting for c in checks}) > 1
    family = sum(_in_family(c.spec, c.diff) for c in checks)
    lines = ["## Claims, checked", "",
             "Measured: the seed-paired difference (row - against) ± the half-width of its 95% interval, the "
             "interval, and p, the two-sided paired t-test. A claim holds when the interval lies on the claimed "
             "side of 0 (within ±margin for a closeness claim), does not hold when it lies on the other side, and "
             "is not resolved when it contains 0 (the seeds cannot tell the sign). Holm and BH: the verdict of "
             f"each directional claim when the p-values of all {family} directional claims measured here are "
             "adjusted together, by Holm (no false verdict among them, with 95% confidence) and by "
             "Benjamini-Hochberg (at most 5% of the resolved ones false, on average); closeness claims are "
             "equivalence claims and keep their interval verdict (-). Seeds: the paired seeds measured, "
             "against the count the suite states in advance (≠: measured on another count).", "",
             "| paper | claim | comparison | paper's figure | measured | p | seeds | verdict | Holm | BH |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        s = c.spec
        what = f"{s.row} - {s.against}, {metric_names.get(s.metric, s.metric)}"
        if s.margin is not None:
            what += f", within ±{s.margin:g}"
        if several:
            what += f" ({c.setting})"
        verdict_text = f"**{c.verdict}**" + (f"; {c.remark}" if c.remark else "")
        cells = [s.paper, s.claim, what, s.paper_figure or "-", _measured(c.diff), _p(c.diff), seeds_text(c),
                 verdict_text, c.holm or "-", c.bh or "-"]
        lines.append("| " + " | ".join(x.replace("|", "/") for x in cells) + " |")
    return lines
