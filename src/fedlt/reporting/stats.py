"""Statistics over seeds: the spread of one row, and the paired difference between two rows.

A seed fixes the partition and the clients sampled each round, so two rows run with the same
seed share most of their noise. Their difference is therefore measured seed by seed (a paired
t-test): that is what can tell a real gap from seed noise with 3 seeds, where comparing two
overlapping mean ± std cells cannot.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from scipy import stats

ALPHA = 0.05  # a difference is resolved when its (adjusted) p-value is below this
LEVEL = 1 - ALPHA
#: a spread (or a mean difference) this small, relative to the values, is float rounding, not noise
ROUNDING = 1e-9


@dataclass(frozen=True)
class SeedStats:
    n: int
    mean: float
    std: float | None  # sample std (n - 1); None for one value
    ci: tuple[float, float] | None  # 95% t-interval of the mean; None for fewer than 2 values


@dataclass(frozen=True)
class PairedDiff:
    n: int  # seeds both rows have
    mean: float | None  # mean over those seeds of (row - reference); None without pairs
    std: float | None  # sample std of the differences; None for fewer than 2 pairs
    ci: tuple[float, float] | None  # 95% t-interval of the mean difference; None for fewer than 2 pairs
    p: float | None  # two-sided paired t-test (sign test at zero variance); None for fewer than 2 pairs
    resolved: bool  # p < 0.05: the interval excludes 0 (at zero variance, the sign test's p alone)

    @property
    def half_width(self) -> float | None:
        """Half the 95% interval: the smallest difference these pairs could have resolved."""
        return None if self.ci is None else (self.ci[1] - self.ci[0]) / 2


def _interval(mean: float, std: float, n: int) -> tuple[float, float]:
    """mean ± t_{0.975, n-1} · s / √n, written out so that s = 0 gives the point (scipy: nan)."""
    half = float(stats.t.ppf(0.5 + LEVEL / 2, n - 1)) * std / math.sqrt(n)
    return mean - half, mean + half


def summarize(values: list[float]) -> SeedStats:
    """Mean, sample std and the 95% t-interval of the mean of one row's per-seed values."""
    if not values:
        raise ValueError("summarize needs at least one value")
    n, mean = len(values), statistics.fmean(values)
    if n < 2:
        return SeedStats(n, mean, None, None)
    std = statistics.stdev(values)
    return SeedStats(n, mean, std, _interval(mean, std, n))


def paired_difference(row: dict[int, float], ref: dict[int, float]) -> PairedDiff | None:
    """``row - ref`` over the seeds both have (values keyed by seed); None when they share none.

    With fewer than 2 pairs there is no interval and nothing is resolved. When every difference is
    the same, up to float rounding (zero variance: accuracies are counts of test samples, so two rows
    can differ by the same few samples on every seed), the t-test has nothing to measure noise with:
    the interval is that point, and the p-value is the exact two-sided sign test's (2 · 0.5^n for n
    differences of one sign; 1 for none), so 3 seeds alike resolve nothing and 6 do.
    """
    seeds = sorted(set(row) & set(ref))
    if not seeds:
        return None
    diffs = [row[s] - ref[s] for s in seeds]
    n, mean = len(diffs), statistics.fmean(diffs)
    if n < 2:
        return PairedDiff(n, mean, None, None, None, False)
    std = statistics.stdev(diffs)
    if std <= ROUNDING * max(1.0, abs(mean)):
        p = 1.0 if abs(mean) <= ROUNDING else min(1.0, 2 * 0.5 ** n)
        return PairedDiff(n, mean, 0.0, (mean, mean), p, p < ALPHA)
    lo, hi = _interval(mean, std, n)
    p = float(stats.ttest_rel([row[s] for s in seeds], [ref[s] for s in seeds]).pvalue)
    return PairedDiff(n, mean, std, (lo, hi), p, lo > 0 or hi < 0)


def holm(p: list[float]) -> list[float]:
    """Holm's step-down adjusted p-values, which control the chance of any false verdict in the family:
    the k-th smallest p times (m - k + 1), never below the adjusted p before it, at most 1."""
    adjusted, running = [0.0] * len(p), 0.0
    for rank, i in enumerate(sorted(range(len(p)), key=lambda i: p[i])):
        running = max(running, min(1.0, (len(p) - rank) * p[i]))
        adjusted[i] = running
    return adjusted


def benjamini_hochberg(p: list[float]) -> list[float]:
    """Benjamini-Hochberg adjusted p-values, which control the expected share of false verdicts among
    the resolved ones (scipy's ``false_discovery_control``)."""
    return [float(x) for x in stats.false_discovery_control(p, method="bh")] if p else []
