"""Choices made on validation data: a row's grid of candidates and the one a suite selects."""

from __future__ import annotations

import pytest

from fedlt.bench.selection import candidate_label, candidates, override_text, select
from fedlt.config import load_config


def test_candidates_are_the_grid_product_in_order_and_parse_back():
    got = candidates({"method_args.gamma": [1, "auto"], "fl.lr": [0.01, 0.05], "method_args.x": [None]})
    assert [d for d, _ in got] == [
        "method_args.gamma=1, fl.lr=0.01, method_args.x=null", "method_args.gamma=1, fl.lr=0.05, method_args.x=null",
        "method_args.gamma=auto, fl.lr=0.01, method_args.x=null", "method_args.gamma=auto, fl.lr=0.05, method_args.x=null",
    ]
    cfg = load_config(None, got[1][1])
    assert cfg.method_args == {"gamma": 1, "x": None} and cfg.fl.lr == 0.05
    assert override_text("data.class_order", [2, 0, 1]) == "data.class_order=[2, 0, 1]"
    assert load_config(None, [override_text("data.class_order", [2, 0, 1])]).data.class_order == [2, 0, 1]
    assert candidate_label("FedLoGe", "method_args.gamma=4") == "FedLoGe [method_args.gamma=4]"


SCORES = {  # candidate -> setting -> seed -> val_acc
    "a": {"s1": {0: 80.0, 1: 82.0}, "s2": {0: 50.0, 1: 52.0}},  # means 81, 51 -> overall 66
    "b": {"s1": {0: 70.0, 1: 72.0}, "s2": {0: 70.0, 1: 70.0}},  # means 71, 70 -> overall 70.5
    "c": {"s1": {0: 84.0, 1: 84.0}, "s2": {0: 40.0}},           # means 84, 40 -> overall 62, s2 incomplete
}


def test_one_choice_across_settings_maximises_the_mean_of_setting_means():
    chosen = select("R", "val_acc", SCORES, ["s1", "s2"], [0, 1], per_setting=False)
    assert chosen.chosen == {"s1": "b", "s2": "b"}
    assert chosen.overall("a", ["s1", "s2"]) == pytest.approx(66.0)
    assert chosen.mean("c", "s2") == pytest.approx(40.0)
    assert not chosen.complete  # c lacks seed 1 in s2


def test_per_setting_choices_and_ties_go_to_the_earlier_candidate():
    chosen = select("R", "val_acc", SCORES, ["s1", "s2"], [0], per_setting=True)
    assert chosen.chosen == {"s1": "c", "s2": "b"} and chosen.complete
    tie = {"x": {"s": {0: 1.0}}, "y": {"s": {0: 1.0}}}
    assert select("R", "val_acc", tie, ["s"], [0], per_setting=False).chosen == {"s": "x"}


def test_no_scores_chooses_nothing():
    assert select("R", "val_acc", {"x": {}}, ["s"], [0], per_setting=False).chosen == {}


GRID_SUITE = {
    "name": "grid",
    # 2 epochs on every client: lr 0.05 learns (above 40% here), lr 0.001 stays at chance, so a selection
    # that read the wrong candidate or the wrong metric shows in the table
    "overrides": ["data.dataset=synthetic", "data.num_clients=4", "data.imbalance_factor=10", "fl.rounds=2",
                  "fl.local_epochs=2", "fl.participation=1.0", "eval.every=2", "run.threads=1",
                  "data.val_per_class=10"],
    "seeds": [0, 1],
    "settings": [{"name": "a", "overrides": ["data.alpha=0.5"]}, {"name": "b", "overrides": ["data.alpha=5"]}],
    "methods": [
        {"name": "FedAvg", "overrides": ["method=fedavg"]},
        {"name": "FedProx", "overrides": ["method=fedprox"], "grid": {"fl.lr": [0.001, 0.05]}},
    ],
}


def test_a_grid_row_runs_every_candidate_and_reports_the_one_validation_selects(tmp_path, monkeypatch):
    import json

    from conftest import write_suite
    from fedlt.bench import heartbeat
    from fedlt.bench.suite import load_suite, run_suite
    from fedlt.reporting import write_report

    # a busy machine runs the grid for over a minute: no heartbeat line among the cells' own
    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 3600.0)
    out, lines = tmp_path / "out", []
    result = run_suite(load_suite(write_suite(tmp_path / "grid.yaml", GRID_SUITE)), out, echo=lines.append)
    assert not result.failed and len(result.ran) == 2 * 2 * (1 + 2)  # settings x seeds x (reference + candidates)
    # a candidate's progress line and log record show its validation accuracy, never its test accuracy
    candidates = [line for line in lines if "/ FedProx [" in line]
    assert len(candidates) == 8 and all(": val acc " in line for line in candidates), lines
    logged = [json.loads(line) for line in (out / "bench-log.jsonl").read_text().splitlines()]
    assert all(("acc" in r) == ("FedProx [" not in r["cell"]) and r["val_acc"] is not None for r in logged)
    val = {}
    for lr in ("0.001", "0.05"):
        folder = "fedprox-fl-lr-" + lr.replace(".", "-")
        assert (out / "a" / folder / "seed1" / "summary.json").is_file()
        val[lr] = [json.loads((out / s / folder / f"seed{seed}" / "summary.json").read_text())["final"]["val_acc"]
                   for s in ("a", "b") for seed in (0, 1)]
    chosen = max(val, key=lambda lr: (sum(val[lr]), lr == "0.001"))  # mean of setting means = mean of all four here
    assert sum(val["0.05"]) > sum(val["0.001"]) + 4 * 20  # a clear choice: the candidate that learned
    text = write_report(out, with_plots=False).markdown
    assert "## Choices made on validation data" in text and f"**`fl.lr={chosen}`**" not in text
    assert f"| `fl.lr={chosen}` |" in text and text.count("**") >= 2
    acc = {lr: sum(json.loads((out / "a" / ("fedprox-fl-lr-" + lr.replace(".", "-")) / f"seed{seed}" / "summary.json")
                              .read_text())["final"]["acc"] for seed in (0, 1)) / 2 for lr in val}
    assert f"{acc['0.05']:.2f}" != f"{acc['0.001']:.2f}"
    assert f"| FedProx | {acc[chosen]:.2f} ± " in text  # the table's row is the selected candidate's test accuracy
    assert "val acc" in text
    import csv  # the CSV and LaTeX tables name the candidate too: a reader of either sees which reading it is

    rows = {(r["setting"], r["row"]): r for r in csv.DictReader((out / "report" / "tables.csv").open())}
    assert rows[("a", "FedProx")]["chosen"] == f"fl.lr={chosen}" and rows[("a", "FedAvg")]["chosen"] == ""
    assert f"FedProx: fl.lr={chosen}, chosen on validation data." in (out / "report" / "tables.tex").read_text()
    # the run above has validation and test agree; where they disagree, validation decides, never test accuracy
    for lr, val_acc in (("0.001", 90.0), ("0.05", 10.0)):
        for path in out.glob(f"*/fedprox-fl-lr-{lr.replace('.', '-')}/seed*/summary.json"):
            summary = json.loads(path.read_text())
            summary["final"]["val_acc"] = val_acc
            path.write_text(json.dumps(summary))
    assert acc["0.05"] > acc["0.001"]
    text = write_report(out, with_plots=False).markdown
    assert "| `fl.lr=0.001` |" in text and f"| FedProx | {acc['0.001']:.2f} ± " in text
    rows = {(r["setting"], r["row"]): r for r in csv.DictReader((out / "report" / "tables.csv").open())}
    assert rows[("a", "FedProx")]["chosen"] == "fl.lr=0.001"


def test_a_grid_row_without_a_validation_set_is_refused_before_anything_runs(tmp_path):
    from conftest import write_suite
    from fedlt.bench.suite import load_suite, run_suite
    from fedlt.errors import ConfigError

    tree = {**GRID_SUITE, "overrides": [o for o in GRID_SUITE["overrides"] if not o.startswith("data.val")]}
    with pytest.raises(ConfigError, match=r"row 'FedProx': its grid is selected on val_acc, but its cells have no "
                                          r"validation set; add data.val_per_class=N"):
        run_suite(load_suite(write_suite(tmp_path / "grid.yaml", tree)), tmp_path / "out", echo=lambda line: None)
    assert not (tmp_path / "out").exists()


def test_an_impossible_validation_split_in_a_suite_is_refused_before_anything_runs(tmp_path):
    from conftest import write_suite
    from fedlt.bench.suite import load_suite, run_suite
    from fedlt.errors import ConfigError

    tree = {**GRID_SUITE, "overrides": [*GRID_SUITE["overrides"], "data.val_per_class=100", "data.val_from=test"]}
    with pytest.raises(ConfigError, match=r"cell 'a / FedAvg / seed 0': data.val_per_class=100: class 0 has only 100 "
                                          r"images in the test split of synthetic"):
        run_suite(load_suite(write_suite(tmp_path / "grid.yaml", tree)), tmp_path / "out", echo=lambda line: None)
    assert not (tmp_path / "out").exists()


def test_a_row_that_joins_a_grid_rows_choice_competes_on_validation_and_can_win(tmp_path):
    """``select_with``: FedProx's table entry is the best on validation of its own grid and of the
    joined row's readings; the joined row keeps its own entry and its own choice."""
    import json

    from conftest import write_suite
    from fedlt.bench.suite import load_suite, run_suite
    from fedlt.reporting import write_report
    from fedlt.reporting.collect import collect

    tree = {**GRID_SUITE, "seeds": [0], "methods": [
        *GRID_SUITE["methods"],
        {"name": "FedProx (mu=0.1)", "overrides": ["method=fedprox", "method_args.mu=0.1"],
         "grid": {"fl.lr": [0.001, 0.05]}, "select_with": "FedProx"},
    ]}
    out = tmp_path / "out"
    result = run_suite(load_suite(write_suite(tmp_path / "grid.yaml", tree)), out, echo=lambda line: None)
    assert not result.failed and len(result.ran) == 2 * (1 + 2 + 2)
    folders = {"fl.lr=0.001": "fedprox-fl-lr-0-001", "fl.lr=0.05": "fedprox-fl-lr-0-05",
               "FedProx (mu=0.1) [fl.lr=0.001]": "fedprox-mu-0-1-fl-lr-0-001",
               "FedProx (mu=0.1) [fl.lr=0.05]": "fedprox-mu-0-1-fl-lr-0-05"}
    final = {c: {s: json.loads((out / s / f / "seed0" / "summary.json").read_text())["final"] for s in ("a", "b")}
             for c, f in folders.items()}
    val = {c: (final[c]["a"]["val_acc"] + final[c]["b"]["val_acc"]) / 2 for c in folders}
    best = max(folders, key=lambda c: (val[c], -list(folders).index(c)))
    selections = {s.row: s for s in collect(out).selections}
    assert set(selections["FedProx"].scores) == set(folders)
    assert selections["FedProx"].chosen == {"a": best, "b": best}
    assert set(selections["FedProx (mu=0.1)"].scores) == {"fl.lr=0.001", "fl.lr=0.05"}
    text = write_report(out, with_plots=False).markdown
    assert len({round(final[c]["a"]["acc"], 2) for c in folders}) > 1  # the winner's figure tells it apart
    assert f"| FedProx | {final[best]['a']['acc']:.2f}" in text  # the table shows the winner's test accuracy
    # where validation and test disagree, validation decides: the joined row's slow candidate wins on it alone
    winner = "FedProx (mu=0.1) [fl.lr=0.001]"
    for c, f in folders.items():
        for s in ("a", "b"):
            path = out / s / f / "seed0" / "summary.json"
            summary = json.loads(path.read_text())
            summary["final"]["val_acc"] = 90.0 if c == winner else 10.0
            path.write_text(json.dumps(summary))
    assert max(final[c]["a"]["acc"] for c in folders) > final[winner]["a"]["acc"] + 1
    assert {s.row: s for s in collect(out).selections}["FedProx"].chosen == {"a": winner, "b": winner}
    assert f"| FedProx | {final[winner]['a']['acc']:.2f}" in write_report(out, with_plots=False).markdown


@pytest.mark.parametrize("joined, message", [
    ({"select_with": "FedAvg"}, r"select_with names 'FedAvg', which is no other row with a grid"),
    ({"select_with": "FedProx", "seeds": [0]}, r"which runs other settings or seeds"),
    ({"select_variants": {"uncalibrated": "calibration=[]"}}, r"select_variants needs a selection to join"),
])
def test_select_with_must_name_a_grid_row_on_the_same_cells(tmp_path, joined, message):
    from conftest import write_suite
    from fedlt.bench.suite import load_suite
    from fedlt.errors import ConfigError

    tree = {**GRID_SUITE, "methods": [*GRID_SUITE["methods"], {"name": "X", "overrides": ["method=fedavg"], **joined}]}
    with pytest.raises(ConfigError, match=message):
        load_suite(write_suite(tmp_path / "grid.yaml", tree))


def test_variants_of_the_global_model_cannot_be_selected_on_personalized_accuracy(tmp_path):
    from conftest import write_suite
    from fedlt.bench.suite import load_suite
    from fedlt.errors import ConfigError

    row = {"name": "X", "overrides": ["method=fedavg", "calibration=[taunorm]"], "grid": {"fl.lr": [0.01, 0.05]},
           "select_variants": {"uncalibrated": "calibration=[]"}}
    tree = {**GRID_SUITE, "methods": [row]}
    assert load_suite(write_suite(tmp_path / "a.yaml", tree))  # on the global model's validation accuracy
    with pytest.raises(ConfigError, match=r"select_variants reads variants of the global model, which have no "
                                          r"val_pm_acc; select on a global-model metric"):
        load_suite(write_suite(tmp_path / "b.yaml", {**tree, "select_on": "val_pm_acc"}))


def test_a_candidate_that_diverged_anywhere_is_passed_over_unless_all_did():
    scores = {"fast": {"s": {0: 90.0, 1: 10.0}}, "slow": {"s": {0: 40.0, 1: 41.0}}}  # fast: mean 50 with a NaN seed
    chosen = select("R", "val_acc", scores, ["s"], [0, 1], per_setting=False, diverged={"fast": ["s / seed 1"]})
    assert chosen.chosen == {"s": "slow"} and chosen.diverged == {"fast": ["s / seed 1"]}
    everyone = {"fast": ["s / seed 1"], "slow": ["s / seed 0"]}
    assert select("R", "val_acc", scores, ["s"], [0, 1], per_setting=False, diverged=everyone).chosen == {"s": "fast"}


def test_a_diverged_cell_is_reported_and_its_candidate_not_selected(tmp_path):
    from conftest import write_suite
    from fedlt.bench.suite import load_suite, run_suite
    from fedlt.reporting import write_report
    from fedlt.reporting.collect import collect

    tree = {**GRID_SUITE, "seeds": [0], "settings": [GRID_SUITE["settings"][0]], "methods": [
        GRID_SUITE["methods"][0], {"name": "FedProx", "overrides": ["method=fedprox"], "grid": {"fl.lr": [1e8, 0.001]}},
        {"name": "Boom", "overrides": ["method=fedavg", "fl.lr=1e8"]}]}
    out = tmp_path / "out"
    result = run_suite(load_suite(write_suite(tmp_path / "grid.yaml", tree)), out, echo=lambda line: None)
    assert [f[0].method for f in result.failed] == ["FedProx [fl.lr=100000000.0]", "Boom"]  # listed, summaries kept
    selection = collect(out).selections[0]
    assert selection.diverged == {"fl.lr=100000000.0": ["a / seed 0"]}
    assert selection.chosen == {"a": "fl.lr=0.001"}  # whatever the scores: the stable candidate
    text = write_report(out, with_plots=False).markdown
    assert ("> `fl.lr=100000000.0` diverged (NaN training loss) in 1 cell(s): a / seed 0; passed over: a default "
            "must not diverge") in text
    assert ("> note: row 'Boom': seed 0 diverged in round 1 (NaN training loss); its cell counts with the NaN "
            "model's accuracy") in text
    assert "| Boom | 10.00" in text  # in the table, never dropped


def test_a_variant_reading_competes_without_training_again_and_the_table_reads_it(tmp_path):
    """``select_variants``: each candidate is also scored through a variant of its own runs (here the
    uncalibrated backbone beside tau-norm), and a chosen variant reading is what the table shows."""
    import json

    from conftest import write_suite
    from fedlt.bench.suite import load_suite, run_suite
    from fedlt.reporting import write_report
    from fedlt.reporting.collect import collect

    tree = {**GRID_SUITE, "seeds": [0], "methods": [GRID_SUITE["methods"][0], {
        "name": "FedAvg+tau", "overrides": ["method=fedavg", "calibration=[taunorm]"], "grid": {"fl.lr": [0.001, 0.05]},
        "select_variants": {"uncalibrated": "calibration=[]"}}]}
    out = tmp_path / "out"
    result = run_suite(load_suite(write_suite(tmp_path / "grid.yaml", tree)), out, echo=lambda line: None)
    assert len(result.ran) == 2 * 3  # the variant readings train nothing
    finals = {lr: {s: json.loads((out / s / f"fedavg-tau-fl-lr-{lr.replace('.', '-')}" / "seed0" / "summary.json")
                                 .read_text())["final"] for s in ("a", "b")} for lr in ("0.001", "0.05")}
    selection = collect(out).selections[0]
    for lr in ("0.001", "0.05"):
        read = selection.scores[f"fl.lr={lr}, calibration=[]"]
        assert read == {s: {0: finals[lr][s]["variants"]["uncalibrated"]["val_acc"]} for s in ("a", "b")}
        assert selection.scores[f"fl.lr={lr}"] == {s: {0: finals[lr][s]["val_acc"]} for s in ("a", "b")}
    chosen = selection.chosen["a"]
    lr = chosen.split(",")[0].removeprefix("fl.lr=")
    shown = finals[lr]["a"]["variants"]["uncalibrated"] if selection.variants.get(chosen) else finals[lr]["a"]
    assert f"| FedAvg+tau | {shown['acc']:.2f}" in write_report(out, with_plots=False).markdown


PERSONAL_READINGS = {"released_realignment": "method_args.personal_head=realigned_plus_phi, method_args.la_fr_psi=raw",
                     "psi_plus_phi": "method_args.personal_head=psi_plus_phi"}


def test_a_personal_reading_is_chosen_on_local_validation_and_the_pm_column_reads_it(tmp_path):
    """``select_personal``: the row's personalized model is chosen among its runs' own and their other
    readings (``pm_variants``) on ``val_pm_acc``, and the PM column shows the chosen one's test figure."""
    import json

    from conftest import write_suite
    from fedlt.bench.selection import AS_RUN
    from fedlt.bench.suite import load_suite, run_suite
    from fedlt.reporting import write_report
    from fedlt.reporting.collect import collect

    tree = {**GRID_SUITE, "seeds": [0], "methods": [{
        "name": "FedLoGe", "overrides": ["method=fedloge", "method_args.sse_steps=20", "method_args.personal_head=realigned"],
        "select_personal": PERSONAL_READINGS}]}
    out = tmp_path / "out"
    result = run_suite(load_suite(write_suite(tmp_path / "personal.yaml", tree)), out, echo=lambda line: None)
    assert not result.failed and len(result.ran) == 2  # readings train nothing
    finals = {s: json.loads((out / s / "fedloge" / "seed0" / "summary.json").read_text())["final"] for s in ("a", "b")}
    collection = collect(out)
    selection = collection.selections[0]
    assert selection.metric == "val_pm_acc" and selection.row == "FedLoGe: personalized model"
    assert selection.scores[AS_RUN] == {s: {0: finals[s]["val_pm_acc"]} for s in ("a", "b")}
    for key, override in PERSONAL_READINGS.items():
        assert selection.scores[override] == {s: {0: finals[s]["pm_variants"][key]["val_pm_acc"]} for s in ("a", "b")}
    means = {c: selection.overall(c, ["a", "b"]) for c in selection.scores}
    chosen = max(means, key=means.get)
    assert selection.chosen == {"a": chosen, "b": chosen}
    key = selection.variants[chosen]
    for setting in collection.settings:
        final = finals[setting.name]
        expected = final["pm_acc"] if key == AS_RUN else final["pm_variants"][key]["pm_acc"]
        row = setting.rows[0]
        assert row.by_seed("pm_acc") == {0: expected} and row.by_seed("acc") == {0: final["acc"]}
    markdown = write_report(out, with_plots=False).markdown
    assert "**FedLoGe: personalized model**, selected on `val_pm_acc`" in markdown
    import csv  # the CSV names the reading its PM columns come from

    named = {r["setting"]: r["chosen"] for r in csv.DictReader((out / "report" / "tables.csv").open())}
    assert named == {s: ("" if key == AS_RUN else f"PM: {key}") for s in ("a", "b")}
    # a reading the runs do not report (a misspelled key) is named, never silently passed over
    import yaml

    spec = yaml.safe_load((out / "suite.yaml").read_text())
    spec["methods"][0]["select_personal"]["psi+phi"] = "method_args.personal_head=psi_plus_phi"
    (out / "suite.yaml").write_text(yaml.safe_dump(spec))
    warnings = collect(out).settings[0].warnings
    assert any("row 'FedLoGe': personal reading 'psi+phi' is not in" in w
               and "(its pm_variants: la_fr, psi_plus_phi, released_realignment)" not in w
               and "(its pm_variants: psi_plus_phi, released_realignment)" in w for w in warnings), warnings


def test_a_personal_reading_choice_without_a_validation_set_is_refused_before_anything_runs(tmp_path):
    from conftest import write_suite
    from fedlt.bench.suite import load_suite, run_suite
    from fedlt.errors import ConfigError

    tree = {**GRID_SUITE, "overrides": [o for o in GRID_SUITE["overrides"] if not o.startswith("data.val_per_class")],
            "methods": [{"name": "FedLoGe", "overrides": ["method=fedloge"], "select_personal": PERSONAL_READINGS}]}
    with pytest.raises(ConfigError, match="its personalized model is selected on val_pm_acc, but its cells have no "
                                          "validation set; add data.val_per_class=N"):
        run_suite(load_suite(write_suite(tmp_path / "p.yaml", tree)), tmp_path / "out", echo=lambda line: None)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("summary.json"))
