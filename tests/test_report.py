"""The comparison table users paste into papers, and summaries that cannot be read."""

import json

import pytest
from typer.testing import CliRunner

from fedlt.cli import app
from fedlt.errors import FedltError
from fedlt.report import comparison_table
from fedlt.reporting import write_report
from fedlt.results import read_summary


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


# ---- unreadable summaries: one FedltError naming the file and the fix, never a traceback ----
BAD_SUMMARIES = {
    "cut_off": (json.dumps(summary(50.0), indent=2)[:60], "invalid JSON"),
    "empty": ("", "the file is empty"),
    "list": ("[1, 2]", "it holds an array, not a JSON object"),
    "empty_object": ("{}", "no keys 'method', 'final', 'best_round'"),
    "final_not_object": (json.dumps({**summary(50.0), "final": None}), "'final' is null, not an object"),
}


@pytest.mark.parametrize("case", list(BAD_SUMMARIES))
def test_an_unreadable_summary_is_one_error_naming_the_file_and_the_fix(tmp_path, case):
    text, reason = BAD_SUMMARIES[case]
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(text)
    with pytest.raises(FedltError, match="not a readable run summary") as err:
        read_summary(run)
    message = str(err.value)
    assert str(run / "summary.json") in message and reason in message
    assert f"fedlt run --resume {run}" in message and "delete that folder" in message
    with pytest.raises(FedltError, match="not a readable run summary"):
        write_report(run, with_plots=False)
    assert not (run / "report").exists()  # nothing half-written
    result = CliRunner().invoke(app, ["report", str(run), "--no-plots"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("fedlt: error: ") and reason in lines[0]


def test_a_good_summary_reads_back_and_a_folder_of_runs_names_its_bad_one(tmp_path):
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "summary.json").write_text(json.dumps(summary(50.0)))
    assert read_summary(tmp_path / "a") == summary(50.0)
    (tmp_path / "b" / "summary.json").write_text("{")
    with pytest.raises(FedltError, match=r"b/summary\.json is not a readable run summary \(invalid JSON"):
        write_report(tmp_path, with_plots=False)


@pytest.mark.parametrize("bad", [[1, 2], {}, {**summary(50.0), "best_round": [20]}])
def test_comparison_table_rejects_what_is_not_a_run_summary(bad):
    with pytest.raises(FedltError, match=r"broken/summary\.json is not a readable run summary"):
        comparison_table([("plain", summary(50.0)), ("broken", bad)])
