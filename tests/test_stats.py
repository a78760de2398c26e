"""Statistics over seeds against scipy and a hand computation: one row's mean, std and 95%
t-interval, the paired difference of two rows keyed by seed and its half-width, and the adjusted
p-values of a family of tests."""

from __future__ import annotations

import math
import statistics

import pytest
from scipy import stats

from fedlt.reporting.stats import PairedDiff, SeedStats, benjamini_hochberg, holm, paired_difference, summarize

T_975_2 = 4.302652729749462  # t_{0.975} with 2 degrees of freedom (tables: 4.303)


def test_summarize_matches_scipy_t_interval_and_sem():
    values = [71.3, 69.8, 72.9, 70.4]
    s = summarize(values)
    assert s.n == 4 and s.mean == pytest.approx(71.1)
    assert s.std == pytest.approx(stats.tstd(values))
    lo, hi = stats.t.interval(0.95, 3, loc=71.1, scale=stats.sem(values))
    assert s.ci == pytest.approx((lo, hi)) and s.ci == pytest.approx((68.9533, 73.2467), abs=1e-4)


def test_summarize_one_value_has_no_std_and_no_interval_and_constant_values_a_point():
    assert summarize([72.5]) == SeedStats(1, 72.5, None, None)
    assert summarize([3.0, 3.0, 3.0]) == SeedStats(3, 3.0, 0.0, (3.0, 3.0))  # scipy's t.interval gives nan here
    with pytest.raises(ValueError):
        summarize([])


def test_paired_difference_by_hand():
    d = paired_difference({0: 11.0, 1: 12.0, 2: 13.0}, {0: 10.0, 1: 10.0, 2: 10.0})  # differences 1, 2, 3
    assert d.n == 3 and d.mean == 2.0 and d.std == 1.0
    assert d.ci == pytest.approx((2 - T_975_2 / math.sqrt(3), 2 + T_975_2 / math.sqrt(3)))
    assert d.ci == pytest.approx((-0.4841, 4.4841), abs=1e-4) and not d.resolved
    assert d.half_width == pytest.approx(T_975_2 / math.sqrt(3)) and d.half_width == pytest.approx(2.4841, abs=1e-4)


def test_paired_difference_matches_scipy_ttest_rel():
    a = {0: 74.1, 1: 75.9, 2: 73.8, 3: 76.2, 4: 75.0}
    b = {0: 72.0, 1: 74.1, 2: 72.9, 3: 73.3, 4: 73.6}
    d = paired_difference(a, b)
    ref = stats.ttest_rel(list(a.values()), list(b.values()))
    assert d.n == 5 and d.mean == pytest.approx(1.82)
    assert d.p == pytest.approx(ref.pvalue) and d.p == pytest.approx(0.005675, abs=1e-6)
    assert d.ci == pytest.approx(tuple(ref.confidence_interval(0.95)))
    assert d.ci == pytest.approx((0.8850, 2.7550), abs=1e-4) and d.resolved
    assert paired_difference(b, a).ci == pytest.approx((-d.ci[1], -d.ci[0])) and paired_difference(b, a).resolved


def test_only_shared_seeds_are_paired():
    row = {0: 80.0, 1: 81.0, 2: 79.0, 7: 99.0}  # seed 7 has no partner: dropped, not averaged in
    ref = {0: 78.0, 1: 79.5, 2: 78.0, 5: 10.0}
    d = paired_difference(row, ref)
    ref_test = stats.ttest_rel([80.0, 81.0, 79.0], [78.0, 79.5, 78.0])
    assert d.n == 3 and d.mean == pytest.approx(1.5) and d.p == pytest.approx(ref_test.pvalue)
    assert d.ci == pytest.approx(tuple(ref_test.confidence_interval(0.95)))


def test_fewer_than_two_pairs_give_no_interval_and_nothing_resolved():
    assert paired_difference({0: 80.0, 1: 81.0}, {1: 70.0, 2: 71.0}) == PairedDiff(1, 11.0, None, None, None, False)
    assert paired_difference({0: 80.0, 1: 81.0}, {1: 70.0, 2: 71.0}).half_width is None
    assert paired_difference({0: 80.0}, {1: 70.0}) is None
    assert paired_difference({}, {0: 70.0}) is None


def test_zero_variance_differences_are_a_point_judged_by_the_sign_test():
    """scipy's paired t statistic is inf or nan there, and a difference of the same few test samples on
    every seed (accuracies are counts) was reported resolved with p = 0 however few the seeds. The exact
    sign test decides instead: 3 seeds alike resolve nothing, 6 do; float rounding is zero variance too."""
    shifted = paired_difference({0: 72.0, 1: 74.0, 2: 73.0}, {0: 70.0, 1: 72.0, 2: 71.0})
    assert shifted == PairedDiff(3, 2.0, 0.0, (2.0, 2.0), 0.25, False)
    six = paired_difference({s: 70.0 + s + 0.1 for s in range(6)}, {s: 70.0 + s for s in range(6)})
    assert six.std == 0.0 and six.p == pytest.approx(2 * 0.5 ** 6) and six.resolved  # 0.03125 < 0.05
    assert stats.binomtest(6, 6).pvalue == pytest.approx(six.p)  # the exact two-sided sign test
    rounded = paired_difference({0: 10.2, 1: 10.1, 2: 21.3}, {0: 10.1, 1: 10.0, 2: 21.2})  # 0.1 up to rounding
    assert statistics.stdev([10.2 - 10.1, 10.1 - 10.0, 21.3 - 21.2]) > 0 and rounded.std == 0.0
    assert rounded.p == 0.25 and not rounded.resolved
    same = paired_difference({0: 72.0, 1: 74.0}, {0: 72.0, 1: 74.0})
    assert same == PairedDiff(2, 0.0, 0.0, (0.0, 0.0), 1.0, False)
    assert math.isnan(stats.ttest_rel([72.0, 74.0], [72.0, 74.0]).pvalue)  # why it is handled explicitly


def test_holm_and_benjamini_hochberg_by_hand():
    p = [0.01, 0.04, 0.03, 0.005]
    # Holm, sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04 -> made monotone 0.06
    assert holm(p) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # BH, the same sorted p times 4/1, 4/2, 4/3, 4/4: 0.02, 0.02, 0.04, 0.04, each the minimum of those after it
    assert benjamini_hochberg(p) == pytest.approx([0.02, 0.04, 0.04, 0.02])
    assert holm([0.3, 0.6]) == pytest.approx([0.6, 0.6]) and holm([0.7, 0.9]) == [1.0, 1.0]  # capped at 1
    assert holm([]) == [] and benjamini_hochberg([]) == []
