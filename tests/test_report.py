"""The comparison table users paste into papers."""

from fedlt.report import comparison_table


def summary(acc, variants=None, calibration=()):
    final = {"round": 25, "acc": acc, "many_acc": acc + 10, "medium_acc": acc - 10, "few_acc": acc - 20,
             "pm_acc": 80.0, "variants": variants}
    return {"method": "creff", "loss": "ce", "final": final, "best_round": {"round": 20, "acc": acc + 1},
            "shot_rule": "count: many > 1000", "calibration": list(calibration)}


def test_one_row_per_run_and_per_variant_with_labels():
    variants = {"uncalibrated": {"acc": 60.0, "many_acc": 80.0, "medium_acc": 40.0, "few_acc": 30.5},
                "oracle": {"acc": 79.0, "many_acc": 85.0, "medium_acc": 70.0, "few_acc": 75.0}}
    text = comparison_table([("cal", summary(72.5, variants, ["creff", "oracle"])), ("plain", summary(50.0))])
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    assert [r.split(" | ")[0] for r in rows] == ["| cal [creff]", "| cal [uncalibrated]", "| cal [oracle, not private]",
                                                 "| plain"]
    assert "| 72.50 | 82.50 | 62.50 | 52.50 | 80.00 | 73.50 (20) |" in rows[0]
    assert rows[1].endswith("| 60.00 | 80.00 | 40.00 | 30.50 | - | - |")
    assert "Shot groups: count: many > 1000" in text
