"""The comparison table users paste into papers, summaries that cannot be read, and the report tables' statistics:
95% intervals, paired differences to a reference row, marks only where the seeds resolve the order, and the
environment line."""

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

import fedlt
from fedlt.cli import app
from fedlt.errors import ConfigError, FedltError
from fedlt.reporting import write_report
from fedlt.reporting.collect import Row, Run, Setting
from fedlt.reporting.comparison import comparison_table
from fedlt.reporting.tables import build_table
from fedlt.results import read_summary


def summary(acc, variants=None, calibration=()):
    final = {"round": 25, "acc": acc, "many_acc": acc + 10, "medium_acc": acc - 10, "few_acc": acc - 20,
             "pm_acc": 80.0, "variants": variants}
    return {"method": "creff", "loss": "ce", "final": final, "best_round": {"round": 20, "acc": acc + 1,
                                                                            "selected_by": "val_acc"},
            "shot_rule": "count: many > 1000", "calibration": list(calibration)}


def test_one_row_per_run_and_per_variant_with_labels():
    variants = {"uncalibrated": {"acc": 60.0, "many_acc": 80.0, "medium_acc": 40.0, "few_acc": 30.5},
                "oracle": {"acc": 79.0, "many_acc": 85.0, "medium_acc": 70.0, "few_acc": 75.0}}
    text = comparison_table([("cal", summary(72.5, variants, ["creff", "oracle"])), ("plain", summary(50.0))])
    rows = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| run")]
    assert [r.split(" | ")[0] for r in rows] == ["| cal [creff]", "| cal [uncalibrated]", "| cal [oracle, not private]",
                                                 "| plain"]
    assert "| 72.50 | 82.50 | 62.50 | 52.50 | 80.00 | 73.50 (20, val_acc) |" in rows[0]
    assert rows[1].endswith("| 60.00 | 80.00 | 40.00 | 30.50 | - | - |")
    assert "Shot groups: count: many > 1000" in text


# ---- unreadable summaries: one FedltError naming the file and the fix, never a traceback ----
BAD_SUMMARIES = {
    "cut_off": (json.dumps(summary(50.0), indent=2)[:60], "invalid JSON"),
    "empty": ("", "the file is empty"),
    "list": ("[1, 2]", "it holds an array, not a JSON object"),
    "empty_object": ("{}", "no keys 'method', 'final', 'best_round'"),
    "final_not_object": (json.dumps({**summary(50.0), "final": None}), "'final' is null, not an object"),
    "final_without_round": (json.dumps({**summary(50.0), "final": {}}), "'final' has no 'round'"),
    "accuracy_not_a_number": (json.dumps({**summary(50.0), "final": {**summary(50.0)["final"], "acc": "n/a"}}),
                              "'final.acc' is a string, not a number"),
    "best_round_loss_not_a_number": (json.dumps({**summary(50.0), "best_round": {"round": 20, "loss": [1]}}),
                                     "'best_round.loss' is an array, not a number"),
    "variants_not_an_object": (json.dumps({**summary(50.0), "final": {**summary(50.0)["final"], "variants": ["x"]}}),
                               "'final.variants' is an array, not an object"),
    "variant_accuracy_not_a_number": (
        json.dumps({**summary(50.0), "final": {**summary(50.0)["final"], "variants": {"u": {"acc": "abc"}}}}),
        "'final.variants.u.acc' is a string, not a number"),
    "accuracy_nan": (json.dumps({**summary(50.0), "final": {**summary(50.0)["final"], "acc": float("nan")}}),
                     "'final.acc' is nan, not a finite accuracy"),
    "elapsed_not_a_number": (json.dumps({**summary(50.0), "elapsed_s": "abc"}), "'elapsed_s' is a string, not a number"),
    "per_class_of_other_classes": (json.dumps({**summary(50.0), "train_class_counts": [5, 3, 1],
                                               "final": {**summary(50.0)["final"], "per_class_acc": [1.0, 2.0]}}),
                                   "'final.per_class_acc' has 2 classes, 'train_class_counts' 3"),
    "round_not_a_whole_number": (json.dumps({**summary(50.0), "final": {**summary(50.0)["final"], "round": 2.5}}),
                                 "'final.round' is a number, not a whole number"),
    # what tables and plots label with: a TypeError, AttributeError or IndexError traceback before
    "shot_rule_not_a_string": (json.dumps({**summary(50.0), "shot_rule": None}), "'shot_rule' is null, not a string"),
    "calibration_not_a_list": (json.dumps({**summary(50.0), "calibration": 1}),
                               "'calibration' is not an array of strings"),
    "shot_groups_not_an_object": (json.dumps({**summary(50.0), "shot_groups": "x"}),
                                  "'shot_groups' is a string, not an object"),
    "shot_group_of_no_class": (json.dumps({**summary(50.0), "train_class_counts": [5, 3, 1],
                                           "shot_groups": {"many": [0], "medium": [1], "few": [7]}}),
                               "'shot_groups.few' is not an array of class indices"),
    "source_hash_not_a_string": (json.dumps({**summary(50.0), "environment": {"source_hash": 1}}),
                                 "'environment.source_hash' is a number, not a string"),
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


def test_a_run_config_or_suite_file_that_is_not_yaml_is_one_error_naming_it(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary(50.0)))
    (run / "config.yaml").write_text("seed: 0\nfl: [1\n")
    with pytest.raises(ConfigError, match=f"^run config {re.escape(str(run / 'config.yaml'))} is not valid YAML at "
                                          "line 3; fix the syntax$"):
        write_report(run, with_plots=False)
    assert not (run / "report").exists()  # nothing half-written
    (run / "config.yaml").write_bytes(b"seed: \xff\xfe\n")
    with pytest.raises(ConfigError, match="is not valid YAML"):
        write_report(run, with_plots=False)
    out = fake_suite(tmp_path / "suite")
    (out / "suite.yaml").write_text("name: [\n")
    with pytest.raises(ConfigError, match=f"^suite file {re.escape(str(out / 'suite.yaml'))} is not valid YAML"):
        write_report(out, with_plots=False)


def test_a_run_config_holding_a_value_no_run_takes_is_one_error_naming_it(tmp_path):
    """A run's config.yaml edited to a value no run takes (or cut down to a few keys) stopped the report of
    its run with a KeyError or ValueError traceback; it is one error naming the file and the key, and a key
    the file lacks reads as its default, as any config file's does."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary(50.0)))
    for text, key in (("fl: {rounds: 0}\n", "fl.rounds"), ("seed: abc\n", "seed")):
        (run / "config.yaml").write_text(text)
        with pytest.raises(ConfigError, match=f"^{re.escape(str(run / 'config.yaml'))}: invalid config value {key}: "):
            write_report(run, with_plots=False)
        assert not (run / "report").exists()  # nothing half-written
    (run / "config.yaml").write_text("seed: 3\ndata: {dataset: synthetic}\n")
    assert "synthetic-LT, IF=100, Dirichlet alpha=0.5, 20 clients, 50 rounds" in write_report(run, with_plots=False).markdown


def test_a_suite_cells_config_holding_a_value_no_run_takes_is_one_error_naming_it(tmp_path):
    """As a run's: a cell's config.yaml with a section that is no mapping stopped the suite's report in an
    AttributeError traceback, and one with a value no run takes passed for a config to compare."""
    from fedlt.bench.suite import cell_dir

    out = fake_suite(tmp_path / "suite")
    path = cell_dir(out, "default", "A", 1) / "config.yaml"
    for text, key in (("seed: 1\ndata: 5\n", "data"), ("seed: 1\nfl: {rounds: 0}\n", "fl.rounds")):
        path.write_text(text)
        with pytest.raises(ConfigError, match=f"^{re.escape(str(path))}: invalid config value {key}: "):
            write_report(out, with_plots=False)
        assert not (out / "report").exists()  # nothing half-written


@pytest.mark.parametrize("bad", [[1, 2], {}, {**summary(50.0), "best_round": [20]}])
def test_comparison_table_rejects_what_is_not_a_run_summary(bad):
    with pytest.raises(FedltError, match=r"broken/summary\.json is not a readable run summary"):
        comparison_table([("plain", summary(50.0)), ("broken", bad)])


# ---- tables: 95% CI, paired difference to a reference row, marks only where resolved ----------
ENV = {"fedlt": "0.1.0", "git_commit": "abc123", "torch": "2.13.0+cpu", "cpu": "AMD EPYC 7B13",
       "cpu_capability": "AVX2", "gpu": None, "threads": 2, "backend": "sequential", "os": "Linux", "python": "3.11.2"}
#: GM accuracy per seed (0, 1, 2); None: that seed did not finish. PM = GM + seed, shot groups GM + 10/-10/-20,
#: so every column has the paired differences of GM. FedAvg - A: 2, 3, 1 (within the noise); B - FedAvg:
#: 5, 5.5, 5.5 and B - A: 3, 2.5, 4.5 (both resolved); Oracle (unranked) is always 20 above FedAvg.
ROWS = {"FedAvg": [70.0, 71.0, 72.0], "A": [72.0, 74.0, 73.0], "B": [75.0, 76.5, 77.5], "C": [60.0, None, None],
        "Oracle": [90.0, 91.0, 92.0]}


def run_summary(acc, seed=0, env=ENV):
    final = {"round": 25, "acc": acc, "many_acc": acc + 10, "medium_acc": acc - 10, "few_acc": acc - 20,
             "pm_acc": acc + seed, "variants": None}
    return {"method": "fedavg", "final": final, "best_round": {"round": 25, "acc": acc},
            **({"environment": env} if env is not None else {})}


def fake_suite(root, rows=ROWS, **keys):
    """A `fedlt bench` output folder holding only what the report reads: suite.yaml and summaries."""
    from fedlt.bench.suite import cell_dir

    tree = {"name": "fake", "title": "Fake", "seeds": [0, 1, 2], "methods": [{"name": n} for n in rows],
            "unranked": [n for n in rows if n == "Oracle"], **keys}
    root.mkdir(parents=True, exist_ok=True)
    (root / "suite.yaml").write_text(yaml.safe_dump(tree))
    settings = [s["name"] for s in tree.get("settings", [{"name": "default"}])]
    for method in tree["methods"]:
        for setting in method.get("settings") or settings:
            for seed, acc in enumerate(rows[method["name"]]):
                if acc is not None:
                    d = cell_dir(root, setting, method["name"], seed)
                    d.mkdir(parents=True)
                    (d / "summary.json").write_text(json.dumps(run_summary(acc, seed)))
    return root


def test_damaged_metrics_or_saved_features_are_one_error_and_nothing_is_written(tmp_path):
    """A metrics row whose figure is no number, or a cut-off ``artifacts.pt``, is refused before any
    table or plot is written (the plots read both)."""
    from fedlt.bench.suite import cell_dir

    out = fake_suite(tmp_path / "metrics", rows={"FedAvg": [70.0, 71.0]})
    metrics = cell_dir(out, "default", "FedAvg", 1) / "metrics.jsonl"
    metrics.write_text(json.dumps({"round": 1, "acc": 50.0}) + "\n" + json.dumps({"round": 2, "acc": "x"}) + "\n")
    with pytest.raises(FedltError, match=re.escape(f"{metrics} is not a readable metrics file: 'round 2.acc' is a "
                                                   "string, not a number")):
        write_report(out)
    assert not (out / "report").exists()
    out = fake_suite(tmp_path / "features", rows={"FedAvg": [70.0, 71.0]})
    artifacts = cell_dir(out, "default", "FedAvg", 0) / "artifacts.pt"
    artifacts.write_bytes(b"PK\x03\x04 cut off")
    result = CliRunner().invoke(app, ["report", str(out)])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert f"{artifacts} is not a saved-features file" in result.stderr and "delete it" in result.stderr
    assert not (out / "report").exists()


def test_the_comparison_table_shows_a_figure_a_summary_lacks_as_a_dash():
    bare = {**summary(50.0), "final": {"round": 25, "acc": 50.0}, "best_round": {"round": 20}}
    row = [line for line in comparison_table([("bare", bare)]).splitlines() if line.startswith("| bare")][0]
    assert row.endswith("| 25 | 50.00 | - | - | - | - | - (20, -) |")  # a summary that does not say what chose it


def test_the_comparison_table_names_a_run_that_did_not_finish():
    diverged = {**summary(10.0), "status": "diverged", "rounds_done": 3}
    row = [line for line in comparison_table([("d", diverged)]).splitlines() if line.startswith("| d")][0]
    assert row.startswith("| d (diverged in round 4) |")


def test_table_names_bench_cells_by_as_many_parent_folders_as_tell_them_apart():
    from fedlt.cli import _distinct_names
    cells = [Path("runs/main/s/fedavg/seed0"), Path("runs/main/s/fedprox/seed0"), Path("runs/main/s/fedprox/seed1")]
    assert _distinct_names(cells) == ["fedavg/seed0", "fedprox/seed0", "fedprox/seed1"]
    assert _distinct_names([Path("a/r1"), Path("b/r2")]) == ["r1", "r2"]


def table_lines(markdown):
    """The detailed tables' lines (the glance section's summary table left out)."""
    detailed = re.sub(r"## At a glance.*?(?=\n## |\Z)", "", markdown, flags=re.S)
    return [line for line in detailed.splitlines() if line.startswith("| ")]


def glance_lines(markdown):
    return [line for line in markdown.split("## At a glance")[1].split("\n## ")[0].splitlines()
            if line.startswith("| ")]


def test_glance_leads_with_each_rows_paired_difference_its_verdict_in_words_shot_groups_and_time(tmp_path):
    root = fake_suite(tmp_path / "out")
    for seed, minutes in enumerate((1.0, 2.0, 3.0)):  # FedAvg's runs took 1, 2 and 3 minutes
        path = root / "default" / "fedavg" / f"seed{seed}" / "summary.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "elapsed_s": 60 * minutes}))
    report = write_report(root, with_plots=False)
    assert report.markdown.index("## At a glance") < report.markdown.index("## default")
    assert glance_lines(report.markdown) == [
        "| method | GM acc | Δ GM vs FedAvg [95% CI] | verdict | many / medium / few | minutes per run |",
        "| FedAvg | 71.00 | ref | reference | 81.0 / 61.0 / 51.0 | 2.0 |",
        "| A | 73.00 | +2.00 ±2.48 [-0.48, 4.48] | not resolved | 83.0 / 63.0 / 53.0 | - |",
        "| B | 76.33 | +5.33 ±0.72 [4.62, 6.05] | better | 86.3 / 66.3 / 56.3 | - |",
        "| C (1/3 seeds) | 60.00 | n/a (1 seed) | n/a (1 seed) | 70.0 / 50.0 / 40.0 | - |",
        # the same 20 points on each of 3 seeds: zero variance, judged by the sign test (p = 0.25)
        "| Oracle † | 91.00 | +20.00 ±0.00 [20.00, 20.00] | not resolved | 101.0 / 81.0 / 71.0 | - |",
    ]
    worse = write_report(fake_suite(tmp_path / "worse", {"FedAvg": [70.0, 71.0, 72.0], "D": [60.0, 62.0, 61.0]}),
                         with_plots=False)
    assert glance_lines(worse.markdown)[-1].split(" | ")[3] == "worse"


def test_suite_table_shows_interval_paired_difference_and_marks_only_a_resolved_order(tmp_path):
    report = write_report(fake_suite(tmp_path / "out"), with_plots=False)
    assert table_lines(report.markdown) == [
        "| method | GM acc | 95% CI | Δ GM vs FedAvg | many | medium | few | PM acc | Δ PM vs FedAvg |",
        "| FedAvg | 71.00 ± 1.00 | [68.52, 73.48] | ref | 81.00 ± 1.00 | 61.00 ± 1.00 | 51.00 ± 1.00 "
        "| 72.00 ± 2.00 | ref |",
        # A - FedAvg: 2, 3, 1: sd 1, half-width t(0.975, 2) / sqrt(3) = 2.48
        "| A | 73.00 ± 1.00 | [70.52, 75.48] | +2.00 ±2.48 [-0.48, 4.48] n.r. | 83.00 ± 1.00 | 63.00 ± 1.00 "
        "| 53.00 ± 1.00 | 74.00 ± 1.73 | +2.00 ±2.48 [-0.48, 4.48] n.r. |",
        # best: B - A is resolved; A is not underlined: A - FedAvg is not. Oracle † would be on top if it counted
        "| B | **76.33 ± 1.26** | [73.21, 79.46] | +5.33 ±0.72 [4.62, 6.05] * | **86.33 ± 1.26** | **66.33 ± 1.26** "
        "| **56.33 ± 1.26** | **77.33 ± 2.25** | +5.33 ±0.72 [4.62, 6.05] * |",
        "| C (1/3 seeds) | 60.00 | - | n/a (1 seed) | 70.00 | 50.00 | 40.00 | 60.00 | n/a (1 seed) |",
        "| Oracle † | 91.00 ± 1.00 | [88.52, 93.48] | +20.00 ±0.00 [20.00, 20.00] n.r. | 101.00 ± 1.00 "
        "| 81.00 ± 1.00 | 71.00 ± 1.00 | 92.00 ± 2.00 | +20.00 ±0.00 [20.00, 20.00] n.r. |",
    ]
    lines = report.markdown.splitlines()
    # the narrowest interval that measures noise: B's (Oracle's zero-variance one does not count)
    assert "Smallest 95% half-width of a paired difference achieved: Δ GM ±0.72 (B, 3 seeds); Δ PM ±0.72 (B, 3 seeds)" in lines
    assert "Measured on: AMD EPYC 7B13 (AVX2), 2 threads, torch 2.13.0+cpu, fedlt 0.1.0" in lines
    assert "Code: abc123 (13 runs)" in lines
    caption = report.markdown.split("## default")[0]
    assert "95% CI: the t-interval of the mean over seeds" in caption and "seed by seed" in caption
    assert "`*` marks a resolved difference (the interval excludes 0" in caption and "`n.r.` one not resolved" in caption
    assert "≈" not in report.markdown and "level" not in report.markdown and "within the noise" not in report.markdown
    assert "best is **bold** only if its lead over every other ranked row is resolved" in caption
    assert "Rows marked † are not ranked" in caption and "{" not in caption  # every placeholder filled in
    tex = (report.out / "tables.tex").read_text()
    # the Markdown table's columns: GM's interval and both paired differences too
    assert ("Method & GM & 95\\% CI & $\\Delta$ GM vs FedAvg & Many & Med. & Few & PM & $\\Delta$ PM vs FedAvg "
            "\\\\") in tex
    assert ("B & \\textbf{76.33 $\\pm$ 1.26} & [73.21, 79.46] & +5.33 $\\pm$0.72 [4.62, 6.05] * & "
            "\\textbf{86.33 $\\pm$ 1.26} & \\textbf{66.33 $\\pm$ 1.26} & \\textbf{56.33 $\\pm$ 1.26} & "
            "\\textbf{77.33 $\\pm$ 2.25} & +5.33 $\\pm$0.72 [4.62, 6.05] * \\\\") in tex
    assert "A & 73.00 $\\pm$ 1.00 & [70.52, 75.48] & +2.00 $\\pm$2.48 [-0.48, 4.48] n.r. & 83.00" in tex
    assert "Smallest 95\\% half-width of a paired difference achieved: $\\Delta$ GM $\\pm$0.72 (B, 3 seeds)" in tex
    assert "FedAvg & 71.00 $\\pm$ 1.00 & [68.52, 73.48] & ref &" in tex
    assert "$\\Delta$GM ($\\Delta$PM): GM (PM) minus FedAvg's, paired by seed" in tex
    assert "\\begin{tabular}{lcccccccc}" in tex  # a label and 8 columns


def test_csv_has_interval_difference_p_value_and_one_column_per_seed(tmp_path):
    import csv

    report = write_report(fake_suite(tmp_path / "out"), with_plots=False)
    rows = {r["row"]: r for r in csv.DictReader((report.out / "tables.csv").open())}
    header = next(csv.reader((report.out / "tables.csv").open()))
    assert header[:18] == ["setting", "row", "variant", "chosen", "ranked", "reference", "seeds", "code", "acc_mean",
                           "acc_std", "acc_ci_lo", "acc_ci_hi", "acc_diff", "acc_diff_half", "acc_diff_ci_lo",
                           "acc_diff_ci_hi", "acc_diff_p", "acc_resolved"]
    assert header[18:22] == ["acc_seed0", "acc_seed1", "acc_seed2", "many_acc_mean"]
    assert len(header) == 8 + 6 * 13  # 6 metrics, val_acc included
    a = rows["A"]
    assert [a[k] for k in ("reference", "seeds", "code", "acc_mean", "acc_std", "acc_ci_lo", "acc_ci_hi", "acc_diff",
                           "acc_diff_half", "acc_diff_ci_lo", "acc_diff_ci_hi", "acc_diff_p", "acc_resolved")] == \
        ["FedAvg", "3", "abc123", "73.0000", "1.0000", "70.5159", "75.4841", "2.0000", "2.4841", "-0.4841", "4.4841",
         "0.07418", "0"]
    assert [a[f"pm_acc_seed{s}"] for s in range(3)] == ["72.0000", "75.0000", "75.0000"]
    assert rows["B"]["acc_resolved"] == "1" and rows["B"]["acc_diff_p"] == "0.0009751"
    # a zero-variance difference: the sign test's p for 3 seeds alike
    assert rows["Oracle"]["acc_diff_p"] == "0.25" and rows["Oracle"]["acc_resolved"] == "0"
    assert rows["Oracle"]["ranked"] == "0"
    assert [rows["FedAvg"][k] for k in ("acc_diff", "acc_diff_p", "acc_resolved")] == ["", "", ""]  # the reference
    c = rows["C"]  # one shared seed: the difference, no interval, not resolved
    assert [c[k] for k in ("acc_std", "acc_ci_lo", "acc_diff", "acc_diff_ci_lo", "acc_diff_p", "acc_resolved",
                           "acc_seed0", "acc_seed1")] == ["", "", "-10.0000", "", "", "0", "60.0000", ""]


def _row(label, accs, ranked=True):
    runs = [Run(Path(label, f"seed{seed}"), seed, {"final": {"acc": a}}) for seed, a in enumerate(accs)]
    return Row(label, None, runs, ranked=ranked)


def test_the_glance_verdict_of_a_row_without_a_global_model_says_so_not_zero_seeds():
    from fedlt.reporting.tables import verdict
    no_gm = Row("FedPer", None, [Run(Path("FedPer", f"seed{s}"), s, {"final": {"pm_acc": 50.0}}) for s in range(2)])
    table = build_table(Setting("s", [_row("FedAvg", [50.0, 60.0]), no_gm]))
    assert verdict(table, 1) == "no GM accuracy"


def _acc_marks(*rows, reference=None):
    setting = Setting("s", list(rows), reference=reference)
    return {setting.rows[i].label: m for (i, metric), m in build_table(setting).marks.items() if metric == "acc"}


def test_marks_need_a_resolved_order_and_a_resolved_difference_to_the_reference():
    # both neighbours resolved: best and second (reference Z, first row)
    assert _acc_marks(_row("Z", [70, 71, 72]), _row("X", [80, 81.5, 82.5]), _row("Y", [75, 76, 77.5])) == \
        {"X": "best", "Y": "second"}
    # X - Z the same 10 points on every seed: the sign test of 3 seeds resolves nothing, so X is never marked
    assert _acc_marks(_row("Z", [70, 71, 72]), _row("X", [80, 81, 82]), _row("Y", [75, 76, 77.5])) == \
        {"Y": "second"}
    # Y - W is within the noise (-0.5, 1.5, 1.5): X stays best, Y loses its underline
    assert _acc_marks(_row("W", [75.5, 74.5, 76.0]), _row("X", [80, 81.5, 82.5]), _row("Y", [75, 76, 77.5])) == \
        {"X": "best"}
    # the top's lead is within the noise (2, -2, 3): no bold, and so no underline either
    assert _acc_marks(_row("R", [60, 61, 62]), _row("T", [74, 70, 75]), _row("S", [72, 72, 72])) == {}
    # T leads S clearly, but its difference to the noisy reference R (30, 7, 24) is not resolved: unmarked
    assert _acc_marks(_row("R", [50, 75, 60]), _row("T", [80, 82, 84]), _row("S", [70, 70.5, 71.2])) == {}
    assert _acc_marks(_row("R", [50, 75, 60], ranked=False), _row("T", [80, 82, 84]), _row("S", [70, 70.5, 71.2]),
                      reference="S") == {"T": "best", "S": "second"}
    # ranked, R stays a row T's lead over is not resolved (30, 7, 24): T is not best of all
    assert _acc_marks(_row("R", [50, 75, 60]), _row("T", [80, 82, 84]), _row("S", [70, 70.5, 71.2]),
                      reference="S") == {}
    # T's higher mean comes from a seed S lacks; on the seeds they share T is below S: not best
    assert _acc_marks(_row("S", [75, 76, 77.5]), _row("T", [70, 71, 72, 100]), reference="S") == {}
    # CCVR leads BSM by a resolved margin but not the noisier CReFF, third by mean: paired leads are not
    # transitive, so no bold (and BSM's lead over CReFF is not resolved either: no underline)
    assert _acc_marks(_row("CE", [10, 20, 30]), _row("CCVR", [50, 52, 54]), _row("BSM", [48, 50.5, 51]),
                      _row("CReFF", [60, 30, 58])) == {}
    # the second must lead every row below it: Y leads V by a resolved margin, not the noisy U
    assert _acc_marks(_row("Z", [70, 71, 72]), _row("X", [90, 91.5, 92.5]), _row("Y", [80, 81, 82.5]),
                      _row("V", [78, 79, 80]), _row("U", [79, 75, 81])) == {"X": "best"}
    # a row of one seed sorting second neither takes a mark nor blocks the others'
    assert _acc_marks(_row("Z", [70, 71, 72]), _row("X", [80, 81.5, 82.5]), _row("Y", [75, 76, 77.5]),
                      _row("P", [79])) == {"X": "best", "Y": "second"}
    # two rows resolved apart: the best is bold and the other, second of two, underlined
    assert _acc_marks(_row("Z", [70, 71, 72]), _row("X", [80, 81.5, 82.5])) == {"X": "best", "Z": "second"}
    # one seed, a single ranked row, or an equal pair (the same runs): nothing to resolve
    assert _acc_marks(_row("a", [70]), _row("b", [80]), _row("c", [75])) == {}
    assert _acc_marks(_row("a", [70, 71]), _row("up", [99, 98], ranked=False)) == {}
    assert _acc_marks(_row("a", [70, 71, 72]), _row("b", [70, 71, 72]), _row("c", [60, 61, 62])) == {}


def test_the_validation_column_is_never_marked():
    """Choices are made on validation accuracy; a bold there would read as a result."""
    seeds = {"A": [50, 51, 52], "B": [60, 61.5, 62.5], "C": [70, 70.5, 72.5]}  # resolved apart, not by constants
    rows = [Row(label, None, [Run(Path(label, f"seed{s}"), s, {"final": {"acc": a, "val_acc": a}})
                              for s, a in enumerate(accs)]) for label, accs in seeds.items()]
    marks = build_table(Setting("s", rows)).marks
    assert marks == {(2, "acc"): "best", (1, "acc"): "second"}

def test_reference_key_names_the_row_differences_are_taken_against(tmp_path):
    rows = {k: ROWS[k] for k in ("FedAvg", "A", "B")}
    tree = {"settings": [{"name": "s1"}, {"name": "s2"}],
            "methods": [{"name": "FedAvg"}, {"name": "A"}, {"name": "B", "settings": ["s2"]}]}
    report = write_report(fake_suite(tmp_path / "out", rows, reference="B", **tree), with_plots=False)
    s1, s2 = report.markdown.split("## s1")[1].split("## s2")
    assert table_lines(s2)[0].endswith("| Δ GM vs B | many | medium | few | PM acc | Δ PM vs B |")
    lines = {line.split(" | ")[0][2:]: line.split(" | ")[3] for line in table_lines(s2)[1:]}
    assert lines == {"FedAvg": "-5.33 ±0.72 [-6.05, -4.62] *", "A": "-3.33 ±2.59 [-5.92, -0.75] *", "B": "ref"}
    # B is not in s1: that table says so and takes its first row
    assert "Δ GM vs FedAvg" in table_lines(s1)[0]
    assert ("> note: the reference row 'B' is not in this setting; differences are against its first row 'FedAvg'"
            in s1)
    with pytest.raises(ConfigError, match=r"reference names 'Nope', which is no row; use one of: FedAvg, A, B$"):
        write_report(fake_suite(tmp_path / "bad", rows, reference="Nope"), with_plots=False)


def test_folder_of_runs_has_one_seed_per_row_and_names_its_environments(tmp_path):
    gpu = {**ENV, "torch": "2.13.0+cu128", "cpu_capability": "AVX512", "threads": 4, "gpu": "NVIDIA H100 80GB HBM3"}
    for name, acc, env in (("a", 70.0, ENV), ("b", 72.0, ENV)):
        (tmp_path / "same" / name).mkdir(parents=True)
        (tmp_path / "same" / name / "summary.json").write_text(json.dumps(run_summary(acc, env=env)))
    report = write_report(tmp_path / "same", with_plots=False)
    assert table_lines(report.markdown)[1:] == [
        "| a | 70.00 | - | ref | 80.00 | 60.00 | 50.00 | 70.00 | ref |",
        "| b | 72.00 | - | n/a (1 seed) | 82.00 | 62.00 | 52.00 | 72.00 | n/a (1 seed) |"]  # one seed: nothing marked
    assert "Measured on: AMD EPYC 7B13 (AVX2), 2 threads, torch 2.13.0+cpu, fedlt 0.1.0" in report.markdown
    for name, acc, env in (("a", 70.0, ENV), ("b", 72.0, gpu), ("c", 71.0, None)):
        (tmp_path / "mixed" / name).mkdir(parents=True)
        (tmp_path / "mixed" / name / "summary.json").write_text(json.dumps(run_summary(acc, env=env)))
    mixed = write_report(tmp_path / "mixed", with_plots=False).markdown
    assert ("> note: cells of this table were measured on 3 different environments: AMD EPYC 7B13 (AVX2), 2 threads, torch 2.13.0+cpu, fedlt 0.1.0 (1 run); "
            "NVIDIA H100 80GB HBM3, AMD EPYC 7B13 (AVX512), 4 threads, torch 2.13.0+cu128, fedlt 0.1.0 (1 run); "
            "not recorded (1 run)") in mixed.splitlines()
    assert "Measured on:" not in mixed
    (tmp_path / "mixed" / "b" / "summary.json").write_text(json.dumps(run_summary(72.0, env=None)))
    (tmp_path / "mixed" / "a" / "summary.json").write_text(json.dumps(run_summary(70.0, env=None)))
    assert "Measured on: not recorded" in write_report(tmp_path / "mixed", with_plots=False).markdown.splitlines()


def test_a_report_parses_each_runs_config_once(tmp_path, monkeypatch):
    """Parsing YAML is most of the time a report of many runs takes (validating a parsed config is over 40 times
    cheaper): each run's config.yaml is parsed once, whether it is reported alone or in a folder of runs."""
    import fedlt.config as config

    parsed, load = [], config.load_yaml
    monkeypatch.setattr(config, "load_yaml", lambda data: parsed.append(data) or load(data))
    for seed in range(3):
        (tmp_path / "runs" / f"s{seed}").mkdir(parents=True)
        (tmp_path / "runs" / f"s{seed}" / "summary.json").write_text(json.dumps(run_summary(70.0 + seed, seed)))
        (tmp_path / "runs" / f"s{seed}" / "config.yaml").write_text(f"seed: {seed}\n")
    assert "| s2 | 72.00 |" in write_report(tmp_path / "runs", with_plots=False).markdown
    assert len(parsed) == 3
    parsed.clear()
    write_report(tmp_path / "runs" / "s0", with_plots=False)
    assert len(parsed) == 1


def test_a_folder_of_runs_names_its_unfinished_ones(tmp_path):
    """A run without its summary (still training, or killed) is left out of the table, and the report
    says so; a folder of unfinished runs only is told how to finish one."""
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "config.yaml").write_text("seed: 0\n")
    from fedlt.errors import FedltError

    with pytest.raises(FedltError, match=re.escape(f"{tmp_path / 'runs'} holds only unfinished runs (no summary.json: "
                                                   f"a, b); finish one with fedlt run --resume {tmp_path / 'runs' / 'a'}")):
        write_report(tmp_path / "runs", with_plots=False)
    (tmp_path / "runs" / "a" / "config.yaml").unlink()  # a finished run's, from the tests' summaries alone
    (tmp_path / "runs" / "a" / "summary.json").write_text(json.dumps(run_summary(70.0)))
    markdown = write_report(tmp_path / "runs", with_plots=False).markdown
    assert ("> note: left out 1 unfinished run(s) without summary.json (b); finish them with fedlt run --resume DIR"
            in markdown.splitlines())


def test_a_report_names_damaged_metrics_lines_of_a_finished_run(tmp_path):
    """A kill mid-write tears the last line of metrics.jsonl, and the resume that finishes the run rewrites
    the file without it; so in a finished run (its summary is written last) any unreadable line is damage
    that costs the curves a round, which the report says instead of drawing them silently."""
    run = tmp_path / "runs" / "a"
    run.mkdir(parents=True)
    (run / "summary.json").write_text(json.dumps(run_summary(70.0)))
    rows = [json.dumps({"round": r, "acc": 50.0 + r}) for r in (1, 2, 3)]
    (run / "metrics.jsonl").write_text("\n".join(rows) + "\n")
    assert "unreadable" not in write_report(tmp_path / "runs", with_plots=False).markdown
    (run / "metrics.jsonl").write_text("garbage\n")  # a finished run's last line is no tear: its summary came after
    assert (f"> note: {run / 'metrics.jsonl'}: line(s) 1 unreadable; its curves lack those rounds (its final "
            "figures come from summary.json)") in write_report(run, with_plots=False).markdown.splitlines()
    (run / "metrics.jsonl").write_text("\n".join([rows[0], rows[1][:9], rows[2]]) + "\n")
    for folder in (tmp_path / "runs", run):  # a folder of runs, and the run itself
        assert (f"> note: {run / 'metrics.jsonl'}: line(s) 2 unreadable; its curves lack those rounds (its final "
                "figures come from summary.json)") in write_report(folder, with_plots=False).markdown.splitlines()


def test_a_folder_of_runs_of_other_settings_gives_one_table_each(tmp_path):
    """Runs of other data or rounds side by side in one folder (the quick start writes them so) are not
    one table: each setting gets its own, with its own reference row."""
    from fedlt.config import build_config

    for name, acc, overrides in (("a", 70.0, {}), ("b", 72.0, {"fl": {"rounds": 3}}), ("c", 71.0, {})):
        run = tmp_path / name
        run.mkdir()
        (run / "summary.json").write_text(json.dumps(run_summary(acc)))
        cfg = build_config({"data": {"dataset": "synthetic", "num_clients": 4}, "fl": {"rounds": 2}, **overrides})
        (run / "config.yaml").write_text(yaml.safe_dump(cfg.dump()))
    markdown = write_report(tmp_path, with_plots=False).markdown
    two, three = "synthetic-LT, IF=100, Dirichlet alpha=0.5, 4 clients, 2 rounds", "4 clients, 3 rounds"
    assert f"## {two}" in markdown and re.search(rf"## .*{three}", markdown)
    rows = table_lines(markdown)
    assert [r.split(" | ")[0] for r in rows if r.startswith(("| a ", "| b ", "| c "))] == ["| a", "| c", "| b"]
    assert "| b | 72.00 | - | ref | 82.00 | 62.00 | 52.00 | 72.00 | ref |" in rows


def test_each_table_names_the_code_behind_it_and_marks_a_row_of_mixed_code(tmp_path):
    from fedlt.bench.suite import cell_dir

    out = fake_suite(tmp_path / "out")
    for method, seed, env in (("A", 0, {**ENV, "source_hash": "0123456789abcdef"}),
                              ("A", 1, {**ENV, "source_hash": "0123456789abcdef"}),
                              ("A", 2, {**ENV, "source_hash": "0123456789abcdef"}),
                              ("B", 2, {**ENV, "git_commit": "def456+dirty"}), ("C", 0, None)):
        path = cell_dir(out, "default", method, seed) / "summary.json"
        path.write_text(json.dumps(run_summary(json.loads(path.read_text())["final"]["acc"], seed, env)))
    report = write_report(out, with_plots=False)
    lines = report.markdown.splitlines()
    assert "Code: abc123 (8 runs), 0123456789abcdef (3 runs), def456+dirty (1 run), not recorded (1 run)" in lines
    assert [line.split(" | ")[0] for line in table_lines(report.markdown)[1:]] == \
        ["| FedAvg", "| A", "| B ‡", "| C (1/3 seeds)", "| Oracle †"]  # C's one run is one version
    assert "> ‡ B: its seeds ran different code: abc123 (seeds 0, 1); def456+dirty (seed 2)" in lines
    import csv

    assert {r["row"]: r["code"] for r in csv.DictReader((report.out / "tables.csv").open())} == \
        {"FedAvg": "abc123", "A": "0123456789abcdef", "B": "abc123; def456+dirty", "C": "not recorded",
         "Oracle": "abc123"}
    tex = (report.out / "tables.tex").read_text()
    assert "\nB $^\\ddagger$ & " in tex and "$^\\ddagger$ seeds run on different code" in tex
    # the LaTeX file says, in comments above each table, the code and machine behind it, as tables.md does
    assert "\n% Code: abc123 (" in tex and "\n% ‡ B: its seeds ran different code: abc123 (seeds 0, 1)" in tex
    assert "\n% Measured on: " in tex or "\n% note: cells of this table were measured on" in tex


def claim(row, against, **more):
    return {"paper": "P", "claim": f"{row} vs {against}", "row": row, "against": against, **more}


def test_claims_section_gives_the_paired_difference_and_a_verdict_no_stronger_than_its_interval(tmp_path):
    claims = [claim("B", "FedAvg", paper_figure="80 vs 71.4 (Table 1)", paper_diff=8.6, seeds=3),  # 5, 5.5, 5.5
              claim("FedAvg", "B", seeds=5),  # the other side of the same interval, stated for 5 seeds
              claim("A", "FedAvg", metric="few_acc"),  # 2, 3, 1: [-0.48, 4.48]
              claim("A", "FedAvg", margin=5), claim("A", "FedAvg", margin=1), claim("B", "FedAvg", margin=1),
              claim("C", "FedAvg"), claim("E", "FedAvg"), claim("D", "FedAvg")]
    rows = {**ROWS, "D": [None, None, None], "E": [72.0, 74.0, 73.7]}  # E - FedAvg: 2, 3, 1.7
    report = write_report(fake_suite(tmp_path / "out", rows, claims=claims), with_plots=False)
    section = report.markdown.split("## Claims, checked")[1]
    # the family: the 4 directional claims with a p-value, p = 0.000975 (twice), 0.0296 (E), 0.0742 (A, few).
    # Holm: E is 3rd smallest, 2 x 0.0296 = 0.059 -> not resolved; BH: 4/3 x 0.0296 = 0.039 -> holds
    assert table_lines(section)[1:] == [
        "| P | B vs FedAvg | B - FedAvg, GM acc | 80 vs 71.4 (Table 1) | +5.33 ±0.72 [4.62, 6.05] | <0.001 "
        "| 3 = planned | **holds**; smaller than the paper's +8.6 | holds | holds |",
        "| P | FedAvg vs B | FedAvg - B, GM acc | - | -5.33 ±0.72 [-6.05, -4.62] | <0.001 | 3 ≠ 5 planned "
        "| **does not hold** | does not hold | does not hold |",
        "| P | A vs FedAvg | A - FedAvg, few | - | +2.00 ±2.48 [-0.48, 4.48] | 0.0742 | 3 | **not resolved** "
        "| not resolved | not resolved |",
        "| P | A vs FedAvg | A - FedAvg, GM acc, within ±5 | - | +2.00 ±2.48 [-0.48, 4.48] | 0.0742 | 3 | **holds** | - | - |",
        "| P | A vs FedAvg | A - FedAvg, GM acc, within ±1 | - | +2.00 ±2.48 [-0.48, 4.48] | 0.0742 | 3 "
        "| **not resolved** | - | - |",
        "| P | B vs FedAvg | B - FedAvg, GM acc, within ±1 | - | +5.33 ±0.72 [4.62, 6.05] | <0.001 | 3 "
        "| **does not hold** | - | - |",
        "| P | C vs FedAvg | C - FedAvg, GM acc | - | -10.00 | - | 1 | **not resolved**; 1 paired seed: no interval "
        "| not resolved | not resolved |",
        "| P | E vs FedAvg | E - FedAvg, GM acc | - | +2.23 ±1.69 [0.54, 3.92] | 0.0296 | 3 | **holds** "
        "| not resolved | holds |",
        "| P | D vs FedAvg | D - FedAvg, GM acc | - | - | - | 0 | **not measured**; the two rows share no finished seed "
        "that measures it (an empty shot group measures none) | not measured | not measured |",
    ]
    assert "the p-values of all 4 directional claims measured here are adjusted together" in section
    assert "## Claims, checked" not in write_report(fake_suite(tmp_path / "none"), with_plots=False).markdown


def test_a_claim_judged_on_the_same_difference_on_every_seed_is_no_stronger_than_the_tables_mark():
    """The tables judge a difference the same on every seed by the sign test (3 seeds: p = 0.25, n.r.);
    the claim's verdict read the point interval and said "holds" beside it."""
    from fedlt.reporting.claims import ClaimSpec, verdict
    from fedlt.reporting.stats import paired_difference

    three, six = (paired_difference({s: 11.0 for s in range(n)}, {s: 10.0 for s in range(n)}) for n in (3, 6))
    assert (three.ci, three.resolved, six.resolved) == ((1.0, 1.0), False, True)
    better, close = ClaimSpec("P", "B over A", "B", "A"), ClaimSpec("P", "B as A", "B", "A", margin=2.0)
    assert verdict(better, three)[0] == verdict(close, three)[0] == "not resolved"
    assert verdict(better, six)[0] == verdict(close, six)[0] == "holds"
    assert verdict(ClaimSpec("P", "A over B", "A", "B"), paired_difference({s: 10.0 for s in range(6)},
                                                          {s: 11.0 for s in range(6)}))[0] == "does not hold"


def test_a_claim_naming_no_row_is_refused_with_the_fix(tmp_path):
    with pytest.raises(ConfigError, match=r"claims\[0\]\.against names 'FedAvgg', which is no row; use a method"):
        write_report(fake_suite(tmp_path / "bad", claims=[claim("A", "FedAvgg")]), with_plots=False)
    # a row against itself differs by 0 on every seed: a closeness claim would hold whatever was measured
    with pytest.raises(ConfigError, match=r"claims\[0\] compares 'A' with itself; set against to the row the paper"):
        write_report(fake_suite(tmp_path / "self", claims=[claim("A", "A", margin=1.0)]), with_plots=False)


def test_rows_with_identical_curves_are_drawn_once_under_their_joined_labels(tmp_path):
    from fedlt.reporting.plots import _same_curves

    def row(label, accs):
        path = tmp_path / label
        path.mkdir()
        (path / "metrics.jsonl").write_text("".join(json.dumps({"round": r + 1, "acc": a, "few_acc": a - 30}) + "\n"
                                                    for r, a in enumerate(accs)))
        return Row(label, None, [Run(path, 0, {})])

    rows = [row("FedAvg", [50, 60]), row("BSM", [55, 70]), row("FedRoD", [55, 70]), row("LA", [55, 71])]
    assert [(label, r.label) for label, r in _same_curves(rows, ("acc", "few_acc"))] == [
        ("FedAvg", "FedAvg"), ("BSM = FedRoD", "BSM"), ("LA", "LA")]


def test_shot_bars_are_means_with_the_half_width_of_their_95_percent_interval():
    from fedlt.reporting.plots import shot_bars

    def run(seed, acc, few):
        return Run(Path("."), seed, {"final": {"acc": acc, "many_acc": acc, "medium_acc": None, "few_acc": few}})

    means, halves = shot_bars(Row("a", None, [run(0, 70.0, 10.0), run(1, 72.0, 20.0), run(2, 74.0, 30.0)]))
    # sd 2 and 10 over 3 seeds: half-widths t(0.975, 2) * sd / sqrt(3) = 4.303 * sd / 1.732
    assert means[:2] == [72.0, 72.0] and means[3] == 20.0 and np.isnan(means[2])
    assert halves == pytest.approx([4.9683, 4.9683, 0.0, 24.8414], abs=1e-3)
    assert shot_bars(Row("one", None, [run(0, 70.0, 10.0)]))[1] == [0.0, 0.0, 0.0, 0.0]


def test_a_row_of_its_own_seeds_says_how_many_it_averages(tmp_path):
    """The caption says "over seeds 0, 1, 2"; a row that lists its own (fewer) seeds averaged those alone and
    carried no mark, in Markdown and LaTeX alike."""
    root = fake_suite(tmp_path / "out", rows={"FedAvg": [70.0, 71.0, 72.0], "A": [72.0, 74.0, None]})
    tree = yaml.safe_load((root / "suite.yaml").read_text())
    tree["methods"][1]["seeds"] = [0, 1]
    (root / "suite.yaml").write_text(yaml.safe_dump(tree))
    report = write_report(root, with_plots=False)
    assert "mean ± sample std over seeds 0, 1, 2" in report.markdown
    assert [line.split(" | ")[0] for line in table_lines(report.markdown)[1:]] == ["| FedAvg", "| A (2 seeds)"]
    assert "A (2 seeds) &" in (report.out / "tables.tex").read_text()


def test_a_diverged_runs_note_names_the_loss_that_went_nan():
    from fedlt.reporting.collect import _diverged

    test_loss = {"status": "diverged", "diverged_round": 3, "reason": "training diverged in round 3: the global "
                 "model's test loss is nan though the clients' mean training loss was finite (...)"}
    assert _diverged(Run(Path("x"), 0, test_loss)).startswith(" diverged in round 3 (NaN test loss); ")
    train_loss = {**test_loss, "reason": "training diverged in round 3: the clients' mean training loss is nan"}
    assert _diverged(Run(Path("x"), 0, train_loss)).startswith(" diverged in round 3 (NaN training loss); ")
    assert _diverged(Run(Path("x"), 0, {"status": "aborted"})) == ""


def test_a_report_of_single_runs_names_a_diverged_one(tmp_path):
    """`fedlt report RUN_DIR` of a run that diverged showed it as an ordinary result of 10.00%."""
    from fedlt.reporting.collect import _run_rows

    diverged = Run(tmp_path, 0, {"status": "diverged", "diverged_round": 1, "final": {"acc": 10.0}})
    assert [row.label for row in _run_rows("fedavg", diverged)] == ["fedavg (diverged in round 1)"]
    assert [row.label for row in _run_rows("fedavg", Run(tmp_path, 0, {"final": {"acc": 60.0}}))] == ["fedavg"]


def test_a_model_at_chance_accuracy_is_named_in_suite_and_run_reports(tmp_path):
    """A finite model predicting one class scores 1/K, which read as a figure looks like a weak method: a
    report names each model whose class-mean accuracy is within 1.1/K, with the better round it left."""
    from fedlt.results import chance_models

    def at(per_class, best=None, **more):
        return {"final": {"round": 25, "acc": float(np.mean(per_class)), "per_class_acc": per_class, **more},
                "best_round": {"round": 20, "acc": best}}

    collapsed = at([100.0] + [0.0] * 9, best=40.0)
    assert chance_models(collapsed) == [
        "the global model scores chance accuracy (10.00% over 10 classes; predicting one class everywhere scores "
        "10.00%), though round 20 scored 40.00%, so it got worse afterwards; "
        "if its training loss fell, it has not yet learned past its largest classes: train longer (fl.rounds) "
        "or use a long-tail loss (loss.name=bsm); if it grew, or was already large in round 1 (the "
        "first steps too large), lower fl.lr, set fl.grad_clip, or bring a scaled loss (loss.ldam_scale, loss.tau) "
        "toward its default"]
    assert chance_models(at([11.0] * 10))[0].startswith("the global model scores chance accuracy (11.00% over 10 ")
    assert chance_models(at([11.1] * 10)) == []  # above 1.1 x 1/K: it learnt something
    assert chance_models({**collapsed, "status": "diverged"}) == []  # named as diverged
    untested = {"final": {"round": 1, "acc": 100.0, "per_class_acc": [100.0, 0.0]}}  # class 1 had no test image
    assert chance_models(untested) == []
    variants = {"nan": {"acc": 10.0, "loss": float("nan")}, "flat": {"acc": 10.5, "loss": 2.3},
                "learnt": {"acc": 30.0, "loss": 1.8}}
    assert chance_models(at([60.0] * 10, variants=variants)) == [  # the NaN one is named as non-finite
        "variant 'flat' scores chance accuracy (10.50% over 10 classes; predicting one class everywhere scores "
        "10.00%); if its training loss fell, it has not yet learned past its largest classes: train longer "
        "(fl.rounds) or use a long-tail loss (loss.name=bsm); if it grew, or was already large in round 1 "
        "(the first steps too large), lower fl.lr, set fl.grad_clip, or bring a scaled loss (loss.ldam_scale, "
        "loss.tau) toward its default"]

    root = fake_suite(tmp_path / "out")
    cell = root / "default" / "b" / "seed1" / "summary.json"
    cell.write_text(json.dumps({**json.loads(cell.read_text()), **at([100.0] + [0.0] * 9, best=40.0)}))
    assert ("> note: row 'B': seed 1: the global model scores chance accuracy (10.00% over 10 classes"
            in write_report(root, with_plots=False).markdown)
    assert "chance" not in write_report(fake_suite(tmp_path / "clean"), with_plots=False).markdown
    runs = tmp_path / "runs"
    for name, summary in (("learnt", at([60.0] * 10)), ("collapsed", collapsed)):
        (runs / name).mkdir(parents=True)
        (runs / name / "summary.json").write_text(json.dumps({"method": "fedavg", **summary}))
    assert "> note: collapsed: the global model scores chance" in write_report(runs, with_plots=False).markdown
    single = write_report(runs / "collapsed", with_plots=False).markdown
    assert "> note: the global model scores chance accuracy (10.00% over 10 classes" in single


def test_chance_at_many_classes_allows_for_the_test_sets_sampling_noise():
    """At 100 classes 1.1/K is 1.10%, one binomial deviation of a random guesser's accuracy on 10,000 test
    samples (0.0995 points): a model at 1.21% with near-constant logits was not named. The ceiling is
    1/K plus three deviations where the summary has its test samples (1.30% here), never below 1.1/K."""
    from fedlt.results import chance_ceiling, chance_models

    hundred = {"final": {"round": 15, "acc": 1.21, "per_class_acc": [1.21] * 100}, "test_samples": 10_000}
    assert chance_ceiling(100, 10_000) == pytest.approx(1 + 3 * 100 * math.sqrt(0.01 * 0.99 / 10_000))
    assert chance_models(hundred)[0].startswith("the global model scores chance accuracy (1.21% over 100 classes")
    learnt = {**hundred, "final": {**hundred["final"], "acc": 1.31, "per_class_acc": [1.31] * 100}}
    assert chance_models(learnt) == []  # past 3 deviations
    assert chance_models({**hundred, "test_samples": None}) == []  # an older summary: 1.1/K as before
    assert chance_ceiling(10, 10_000) == pytest.approx(11.0)  # 3 deviations (0.9) are under 1.1/K at 10 classes
    assert chance_ceiling(1000, 50_000) == pytest.approx(0.1 + 3 * 100 * math.sqrt(0.001 * 0.999 / 50_000))


def test_a_runs_summary_counts_its_test_samples(tmp_path):
    run = fedlt.run({"data": {"dataset": "synthetic", "num_clients": 3}, "fl": {"rounds": 1},
                     "run": {"out_dir": str(tmp_path), "threads": 1}}, quiet=True)
    assert run.summary["test_samples"] == 1000  # the synthetic source's test split
    assert "; 1000 balanced test samples" in run.summary["data"]


def test_runs_of_other_partitions_are_other_tables_in_a_report_of_runs():
    """Pathological splits of another classes_per_client, and Dirichlet splits re-cut to equal sizes,
    redrawn to a minimum client size or rounded otherwise, are other federations: they sat under one
    header, paired."""
    from fedlt.config import load_config
    from fedlt.reporting.collect import setting_label

    base = ["data.dataset=synthetic", "data.num_clients=4", "fl.rounds=2"]
    labels = [setting_label({}, load_config(None, base + more).dump()) for more in (
        [], ["data.equal_size=true"], ["data.min_client_size=5"], ["data.rounding=largest_remainder"],
        ["data.partition=pathological", "data.classes_per_client=2"],
        ["data.partition=pathological", "data.classes_per_client=3"])]
    assert labels[1] == labels[0] + ", equal-size clients" and labels[2] == labels[0] + ", min_client_size 5"
    assert labels[3] == labels[0] + ", largest-remainder rounding"
    assert labels[4] == "synthetic-LT, IF=100, pathological, 2 classes per client, 4 clients, 2 rounds"
    assert len(set(labels)) == 6


def test_runs_of_other_federations_or_shot_groups_are_other_tables_in_a_report_of_runs():
    """A folder of runs keyed its tables on dataset, IF, partition, clients and rounds only: runs on a
    fraction of the data, of another participation or image size, or with other shot groups or another
    accuracy, sat under the first run's header, paired with it."""
    from fedlt.config import load_config
    from fedlt.reporting.collect import setting_label

    base = ["data.dataset=synthetic", "data.num_clients=4", "fl.rounds=2"]
    labels = [setting_label({}, load_config(None, base + more).dump()) for more in (
        [], ["data.train_fraction=0.3"], ["eval.shot_rule=cumulative"], ["data.class_order=shuffled"],
        ["data.seed=3"], ["data.val_per_class=5"], ["eval.many_threshold=50"], ["fl.participation=0.5"],
        ["data.image_size=20"], ["eval.accuracy=top1"], ["run.threads=1"], ["fl.participation=0.4"])]
    assert labels[0] == "synthetic-LT, IF=100, Dirichlet alpha=0.5, 4 clients, 2 rounds"
    assert labels[1] == labels[0] + ", train_fraction 0.3" and labels[2] == labels[0] + ", shot rule cumulative"
    assert labels[6] == labels[0] + ", shot rule count, many_threshold 50"
    assert labels[7:10] == [labels[0] + more for more in (", participation 0.5", ", 20 px", ", top1 accuracy")]
    assert len(set(labels[:10])) == 10
    assert labels[10] == labels[11] == labels[0]  # where it ran, and the default participation: the same federation


def test_the_protocol_noise_script_reads_protocol_suites_and_refuses_other_folders_in_one_line(tiny_suite):
    """scripts/protocol_noise.py given a suite whose settings are not candidate protocols (ROUNDSxEPOCHS ...)
    ended in a ValueError traceback; it now says so in one line, exit 2, and reads a protocol suite's output."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}

    def noise(folder: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(root / "scripts" / "protocol_noise.py"), str(folder)],
                              capture_output=True, text=True, env=env, timeout=120)

    _, out, _ = tiny_suite
    refused = noise(out)
    assert refused.returncode == 2 and refused.stdout == "", refused.stderr
    assert refused.stderr == ("protocol_noise: error: setting 'IF=10, alpha=0.5' is not a candidate protocol (named "
                              "ROUNDSxEPOCHS ..., e.g. 50x2); pass the output folders of the protocol and "
                              "protocol-long suites\n")
    read = noise(root / "docs" / "results" / "protocol-main-5x1-avx512" / "runs")
    assert read.returncode == 0, read.stderr
    assert read.stdout.splitlines()[2].startswith("| 5x1 ")


def test_the_protocol_noise_script_answers_help_and_a_bare_classes_flag_without_a_traceback():
    """scripts/protocol_noise.py --help took --help for a folder and refused it, and --classes without a
    folder ended in an IndexError traceback; --help now prints the usage (exit 0) and a bare --classes
    is one line naming what it takes (exit 2)."""
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root / "src")}

    def noise(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(root / "scripts" / "protocol_noise.py"), *args],
                              capture_output=True, text=True, env=env, timeout=120)

    for flag in ("--help", "-h"):
        helped = noise(flag)
        assert helped.returncode == 0 and helped.stderr == "", helped.stderr
        assert "Usage: .venv/bin/python scripts/protocol_noise.py" in helped.stdout
    bare = noise("--classes")
    assert bare.returncode == 2 and bare.stdout == ""
    assert bare.stderr == ("protocol_noise: error: --classes takes one folder, the class-order suite's output "
                           "(e.g. runs/bench/class-order)\n")
