"""``fedlt bench``: suite files, validation before any cell runs, resumable cells, failed cells,
parallel workers, and the tables' arithmetic (means, stds, intervals, paired differences, marks)."""

from __future__ import annotations

import csv
import json
import re
import shutil
import statistics
import time
from pathlib import Path

import pytest
import torch
import yaml
from scipy import stats
from typer.testing import CliRunner

from conftest import TINY_SUITE, wait_until_group_ends, write_suite
from fedlt.bench.suite import (REPO_ROOT, calibration_args_difference, cell_dir, load_suite, method_args_difference,
                               run_suite, slug, write_suite_file)
from fedlt.bench.workers import STOP_GRACE_S
from fedlt.config import load_config
from fedlt.cli import app
from fedlt.errors import ConfigError, FedltError
from fedlt.reporting import write_report

METRICS = ("acc", "many_acc", "medium_acc", "few_acc", "pm_acc")


def finals(out, setting, method, seeds, variant=None):
    rows = []
    for seed in seeds:
        final = json.loads((cell_dir(out, setting, method, seed) / "summary.json").read_text())["final"]
        rows.append(final["variants"][variant] if variant else final)
    return rows


def test_tiny_suite_runs_every_cell_in_its_place(tiny_suite):
    _, out, result = tiny_suite
    assert len(result.cells) == 4 and len(result.ran) == 4 and not result.failed and not result.skipped
    for cell in result.cells:
        assert cell.run_dir == out / "if-10-alpha-0-5" / slug(cell.method) / f"seed{cell.seed}"
        cfg = (cell.run_dir / "config.yaml").read_text()
        assert f"seed: {cell.seed}" in cfg and "dataset: synthetic" in cfg
    assert (out / "suite.yaml").is_file() and not (out / "failed.json").exists()


def test_rerun_skips_finished_cells(tiny_suite):
    path, out, _ = tiny_suite
    stamps = {p: p.stat().st_mtime_ns for p in out.rglob("summary.json")}
    lines = []
    again = run_suite(load_suite(path), out, echo=lines.append)
    assert not again.ran and len(again.skipped) == 4
    assert {p: p.stat().st_mtime_ns for p in out.rglob("summary.json")} == stamps
    assert "4 already finished, 0 to run" in lines[0]


def _paired(seeds, a, b):
    """(mean difference, 95% interval) of rows a - b over their shared seeds, by scipy; None below 2 pairs."""
    shared = sorted(set(seeds[a]) & set(seeds[b]))
    if len(shared) < 2:
        return None
    x, y = [seeds[a][s] for s in shared], [seeds[b][s] for s in shared]
    return statistics.mean(x) - statistics.mean(y), tuple(stats.ttest_rel(x, y).confidence_interval(0.95))


def test_table_means_stds_differences_and_marks_match_the_cells(tiny_suite):
    _, out, _ = tiny_suite
    report = write_report(out, out / "tables-only", with_plots=False)
    setting = "IF=10, alpha=0.5"
    expected = {"FedAvg + CCVR": finals(out, setting, "FedAvg + CCVR", [0, 1]),
                "FedAvg": finals(out, setting, "FedAvg + CCVR", [0, 1], variant="uncalibrated"),
                "FedProx": finals(out, setting, "FedProx", [0, 1])}
    rows = list(csv.DictReader((report.out / "tables.csv").open()))
    assert [r["row"] for r in rows] == list(expected) and {r["reference"] for r in rows} == {"FedAvg + CCVR"}
    for row in rows:
        for m in METRICS:
            values = [f[m] for f in expected[row["row"]] if f.get(m) is not None]
            if not values:
                assert row[f"{m}_mean"] == "" and row[f"{m}_seed0"] == ""
                continue
            assert [float(row[f"{m}_seed{s}"]) for s in (0, 1)] == pytest.approx(values, abs=1e-4)
            assert float(row[f"{m}_mean"]) == pytest.approx(statistics.mean(values), abs=1e-4)
            assert float(row[f"{m}_std"]) == pytest.approx(statistics.stdev(values), abs=1e-4)
            mean = statistics.mean(values)  # equal seeds (e.g. few-shot 0.0 twice): the point; scipy gives nan
            lo, hi = (mean, mean) if len(set(values)) == 1 else \
                stats.t.interval(0.95, 1, loc=mean, scale=stats.sem(values))
            assert (float(row[f"{m}_ci_lo"]), float(row[f"{m}_ci_hi"])) == pytest.approx((lo, hi), abs=1e-4)
    # Δ and bold/underline, recomputed with scipy from the per-seed values of the cells
    detailed = report.markdown.split(f"\n## {setting}\n")[1]  # the setting's table, not the glance above it
    md = [line.strip("|").split(" | ") for line in detailed.splitlines() if line.startswith("| ")]
    header, body = [h.strip() for h in md[0]], {cells[0].strip(): [c.strip() for c in cells] for cells in md[1:]}
    assert header[:4] == ["method", "GM acc", "95% CI", "Δ GM vs FedAvg + CCVR"]
    for m, col, delta in (("acc", "GM acc", "Δ GM vs FedAvg + CCVR"), ("many_acc", "many", None),
                          ("medium_acc", "medium", None), ("few_acc", "few", None),
                          ("pm_acc", "PM acc", "Δ PM vs FedAvg + CCVR")):
        seeds = {r["row"]: {s: float(r[f"{m}_seed{s}"]) for s in (0, 1) if r[f"{m}_seed{s}"]} for r in rows}
        if not any(seeds.values()):  # a metric no run reports: "-" (PM: no column)
            if m == "pm_acc":
                assert col not in header
            else:
                assert {cells[header.index(col)] for cells in body.values()} == {"-"}
            continue
        label = {r["row"]: r["row"] + ("" if r["ranked"] == "1" else " †") for r in rows}
        if delta:
            for name in expected:
                d = _paired(seeds, name, "FedAvg + CCVR") if name != "FedAvg + CCVR" and seeds[name] else None
                text = body[label[name]][header.index(delta)]
                if d is not None:
                    mean, (lo, hi) = d
                    assert text == (f"{mean:+.2f} ±{(hi - lo) / 2:.2f} [{lo:.2f}, {hi:.2f}] "
                                    f"{'*' if lo > 0 or hi < 0 else 'n.r.'}"), (m, name)
                else:
                    assert text in ("ref", "-"), (m, name, text)

        def leads(a, b, above=True):
            d = _paired(seeds, a, b)
            return d is not None and (d[1][0] > 0 or (not above and d[1][1] < 0))

        order = sorted((r["row"] for r in rows if r["ranked"] == "1" and len(seeds[r["row"]]) >= 2),
                       key=lambda name: -statistics.mean(seeds[name].values()))
        clear = [name for name in order if name == "FedAvg + CCVR" or leads(name, "FedAvg + CCVR", above=False)]
        marks = {}  # best: a resolved lead over every row below; second: over every row below it, under the best
        if len(order) >= 2 and leads(order[0], order[1]):
            if all(leads(order[0], other) for other in order[2:]):
                marks[order[0]] = "best"
            if all(leads(order[1], other) for other in order[2:]):
                marks[order[1]] = "second"
        marks = {k: v for k, v in marks.items() if k in clear}
        for name in expected:
            cell = body[label[name]][header.index(col)]
            assert cell.startswith("**") == (marks.get(name) == "best"), (m, name, cell)
            assert cell.startswith("<u>") == (marks.get(name) == "second"), (m, name, cell)
    tex = (report.out / "tables.tex").read_text()
    assert r"$\pm$" in tex and r"$\Delta$GM" in tex and "FedAvg + CCVR & " in tex


def test_unranked_rows_and_the_message_section_of_a_suite(tiny_suite, tmp_path):
    """Suite keys ``unranked`` (a row shown with a dagger, never bold or underlined) and
    ``report_messages`` (bytes a client uploads per exchange kind)."""
    _, out, _ = tiny_suite
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    tree = yaml.safe_load((copy / "suite.yaml").read_text())
    (copy / "suite.yaml").write_text(yaml.safe_dump({**tree, "unranked": ["FedProx"], "report_messages": True}))
    markdown = write_report(copy, with_plots=False).markdown
    fedprox = [line for line in markdown.splitlines() if line.startswith("| FedProx")]
    assert len(fedprox) == 2 and all(line.startswith("| FedProx † |") for line in fedprox)  # glance, table
    fedprox = fedprox[1:]
    assert "**" not in fedprox[0] and "<u>" not in fedprox[0]
    assert "| Δ GM vs FedAvg + CCVR |" in markdown and "Measured on:" in markdown
    section = markdown.split("## What a client uploads (bytes per message)")[1]
    assert "fit" in section and "calibration_stats" in section
    assert "## What a client uploads" not in write_report(out, tmp_path / "plain", with_plots=False).markdown


def test_a_row_not_run_yet_is_named_in_the_notes_the_glance_table_points_to(tmp_path):
    """`--row` runs some rows first; the glance table's "no finished seed (see the notes)" then had no note."""
    tree = {**TINY_SUITE, "seeds": [0],
            "methods": [{"name": "FedAvg", "overrides": ["method=fedavg"]}, TINY_SUITE["methods"][1]]}
    suite = load_suite(write_suite(tmp_path / "s.yaml", tree))
    run_suite(suite, tmp_path / "out", rows=["FedAvg"], echo=lambda line: None)
    table = write_report(tmp_path / "out", with_plots=False).markdown
    assert "| FedProx (0/1 seeds) | - | no finished seed (see the notes) |" in table
    assert "row 'FedProx': no cell has run yet; `fedlt bench` runs them (--row to run one alone)" in table


def test_a_failing_cell_is_recorded_and_the_others_finish(tmp_path, monkeypatch):
    from fedlt.methods.fedprox import FedProxClient

    def broken(self, ctx, msg):
        raise RuntimeError("simulated crash in local training")

    tree = {**TINY_SUITE, "seeds": [0],
            "methods": [{"name": "FedAvg", "overrides": ["method=fedavg"]}, TINY_SUITE["methods"][1]]}
    suite = load_suite(write_suite(tmp_path / "s.yaml", tree))
    monkeypatch.setattr(FedProxClient, "fit", broken)  # fails at run time, after validation passed
    result = run_suite(suite, tmp_path / "out", echo=lambda line: None)
    assert [c.method for c in result.ran] == ["FedAvg"]
    assert [c.method for c, _ in result.failed] == ["FedProx"]
    failed = json.loads((tmp_path / "out" / "failed.json").read_text())
    assert len(failed) == 1 and "simulated crash" in failed[0]["error"] and "FedProx" in failed[0]["cell"]
    table = write_report(tmp_path / "out", with_plots=False).markdown
    assert "| FedProx (0/1 seeds) | - |" in table
    assert "| FedProx (0/1 seeds) | - | no finished seed (see the notes) | - | - | - |" in table.split("## At a glance")[1]
    assert "row 'FedProx': seed 0 failed: RuntimeError: simulated crash in local training; `fedlt bench` runs it " \
           "again" in table
    monkeypatch.undo()  # fixed: the re-run runs only the failed cell, and clears failed.json
    (tmp_path / "out" / "failed.json").write_bytes(b'[{"run_dir": 3}, "x"\xff')  # damaged meanwhile: no matter
    again = run_suite(suite, tmp_path / "out", echo=lambda line: None)
    assert [c.method for c in again.ran] == ["FedProx"] and len(again.skipped) == 1
    assert not (tmp_path / "out" / "failed.json").exists()


def test_interrupted_cell_resumes_from_its_checkpoint(tiny_suite, tmp_path, monkeypatch):
    from fedlt.engine.simulation import Simulation

    tree = {**TINY_SUITE, "seeds": [1], "methods": [TINY_SUITE["methods"][1]], "overrides":
            [*TINY_SUITE["overrides"], "run.checkpoint_every=1"]}
    suite = load_suite(write_suite(tmp_path / "s.yaml", tree))
    original = Simulation.fit_round

    def interrupted(self, rnd):
        if rnd == 2:
            raise KeyboardInterrupt
        return original(self, rnd)

    monkeypatch.setattr(Simulation, "fit_round", interrupted)
    with pytest.raises(KeyboardInterrupt):
        run_suite(suite, tmp_path / "out", echo=lambda line: None)
    monkeypatch.undo()
    (cell,) = run_suite(suite, tmp_path / "out", dry_run=True, echo=lambda line: None).cells
    assert cell.state == "resume"
    run_suite(suite, tmp_path / "out", echo=lambda line: None)
    _, reference, _ = tiny_suite
    resumed = finals(tmp_path / "out", "IF=10, alpha=0.5", "FedProx", [1])[0]
    uninterrupted = finals(reference, "IF=10, alpha=0.5", "FedProx", [1])[0]
    kept = (*METRICS, "loss", "per_class_acc")  # the loss too: the tiny suite's FedProx is near chance accuracy
    assert {k: resumed[k] for k in kept} == {k: uninterrupted[k] for k in kept}


@pytest.mark.parametrize("corrupt", ["cut_off", "not_an_object"])
def test_a_cell_with_an_unreadable_summary_is_unfinished_and_resumes(tiny_suite, tmp_path, corrupt):
    """A cut-off or foreign summary.json is not a finished cell: the report names the file, and the
    next ``bench run`` resumes the cell from its last checkpoint, which rewrites the summary."""
    path, reference, _ = tiny_suite
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    bad = cell_dir(out, "IF=10, alpha=0.5", "FedProx", 1) / "summary.json"
    good = bad.read_text()
    bad.write_text(good[:40] if corrupt == "cut_off" else "[1, 2]")
    with pytest.raises(FedltError, match=rf"{re.escape(str(bad))} is not a readable run summary .*delete that folder"):
        write_report(out, with_plots=False)
    cells = run_suite(load_suite(path), out, dry_run=True, echo=lambda line: None).cells
    assert {c.label: c.state for c in cells if c.state != "done"} == {"IF=10, alpha=0.5 / FedProx / seed 1": "resume"}
    again = run_suite(load_suite(path), out, echo=lambda line: None)
    assert [c.label for c in again.ran] == ["IF=10, alpha=0.5 / FedProx / seed 1"] and len(again.skipped) == 3
    assert json.loads(bad.read_text())["final"] == json.loads(good)["final"]
    assert "| FedProx |" in write_report(out, with_plots=False).markdown


def test_an_aborted_cell_is_left_out_of_the_report_and_run_again(tiny_suite, tmp_path):
    """A run that stopped early (a Flower run aborted by its timeout) has a summary, marked aborted: it is
    no finished seed of its row, and the next `fedlt bench` runs it again from the start."""
    path, reference, _ = tiny_suite
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    cell = cell_dir(out, "IF=10, alpha=0.5", "FedProx", 1)
    finished = json.loads((cell / "summary.json").read_text())
    elsewhere = {**finished["environment"], "cpu_capability": "another", "source_hash": "another"}
    (cell / "summary.json").write_text(json.dumps({**finished, "status": "aborted", "rounds_done": 1, "environment":
                                                   elsewhere, "reason": "1 of 2 clients answered"}))
    report = write_report(out, with_plots=False).markdown
    assert f"row 'FedProx': left out {cell} (aborted after 1 of" in report and "`fedlt bench` runs it again" in report
    assert "FedProx (1/2 seeds)" in report  # FedProx averages the seed it finished
    # its machine and code are not a finished cell's, which the folder's others would be checked against
    again = run_suite(load_suite(path), out, echo=lambda line: None)
    assert [c.label for c in again.ran] == ["IF=10, alpha=0.5 / FedProx / seed 1"] and len(again.skipped) == 3
    rerun = json.loads((cell / "summary.json").read_text())
    assert rerun.get("status") != "aborted" and rerun["final"] == finished["final"]


def test_a_file_where_a_cell_folder_goes_is_one_line(tiny_suite, tmp_path):
    path, reference, _ = tiny_suite
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    cell = cell_dir(out, "IF=10, alpha=0.5", "FedProx", 1)
    shutil.rmtree(cell)
    cell.write_text("hi")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(cell))} is a file where the cell's run directory goes; "
                                          "move it away or pass --out"):
        run_suite(load_suite(path), out, dry_run=True, echo=lambda line: None)

def test_a_bench_says_where_its_running_cells_are_between_their_ends(tmp_path, monkeypatch):
    """Cells train without progress lines of their own; the bench names each running cell's round and
    accuracy every HEARTBEAT_S seconds (a minute; shortened here), from its metrics.jsonl."""
    from conftest import TINY_SUITE, write_suite
    from fedlt.bench import heartbeat

    monkeypatch.setattr(heartbeat, "HEARTBEAT_S", 0.01)
    tree = {**TINY_SUITE, "seeds": [0], "methods": [TINY_SUITE["methods"][1]],
            "overrides": [*TINY_SUITE["overrides"][:3], "fl.rounds=6", *TINY_SUITE["overrides"][4:]]}
    lines = []
    run_suite(load_suite(write_suite(tmp_path / "s.yaml", tree)), tmp_path / "out", echo=lines.append)
    beats = [line for line in lines if line.startswith("[bench tiny] running | IF=10, alpha=0.5 / FedProx / seed 0: round ")]
    assert beats, lines
    assert all(re.search(r": round [1-6]/6(, acc \d+\.\d\d)?$", line) for line in beats), beats
    assert any(", acc " in line for line in beats) and lines[-1].startswith("[bench tiny] 1 ran")


def test_cell_progress_reads_a_cell_being_written(tmp_path):
    from fedlt.bench.heartbeat import cell_progress

    (tmp_path / "config.yaml").write_text("fl:\n  rounds: 50\n")
    (tmp_path / "metrics.jsonl").write_text('{"round": 1, "train_loss": 2.0}\n{"round": 2, "acc": 41.5}\n'
                                            '{"round": 3, "train_loss": 1.5}\n{"round": 4, "ac')  # cut off mid-write
    assert cell_progress(tmp_path, since=0) == "round 3/50, acc 41.50"
    assert cell_progress(tmp_path, since=0, validation=True) == "round 3/50"  # a candidate's test acc: never
    assert cell_progress(tmp_path, since=time.time() + 60) is None  # not written since the bench began
    assert cell_progress(tmp_path / "missing", since=0) is None
    (tmp_path / "metrics.jsonl").unlink()  # no round evaluated yet
    assert cell_progress(tmp_path, since=0) == "started, 50 rounds"
    (tmp_path / "config.yaml").write_text("fl:\n  rounds: 1\n")
    assert cell_progress(tmp_path, since=0) == "started, 1 round"

def test_two_workers_give_the_numbers_of_one(tiny_suite, tmp_path):
    _, reference, _ = tiny_suite
    path = write_suite(tmp_path / "s.yaml", {**TINY_SUITE, "methods": [TINY_SUITE["methods"][1]]})
    # bit-identical, not close: TINY_SUITE sets run.threads=1, which a worker process keeps, so each
    # cell runs the reference's kernels (same CPU, inherited environment) with its thread count
    result = run_suite(load_suite(path), tmp_path / "par", workers=2, echo=lambda line: None)
    assert len(result.ran) == 2 and not result.failed
    for cell in result.cells:
        a = json.loads((cell.run_dir / "summary.json").read_text())["final"]
        b = json.loads((cell_dir(reference, cell.setting, cell.method, cell.seed) / "summary.json").read_text())["final"]
        assert a == b


def test_cells_from_another_machine_type_are_refused_unless_mixed_machines(tiny_suite, tmp_path):
    path, out, _ = tiny_suite
    mine = tmp_path / "out"
    shutil.copytree(out, mine)
    summary = next(mine.rglob("summary.json"))
    tree = json.loads(summary.read_text())
    assert tree["environment"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    run_suite(load_suite(path), mine, seeds=[0, 1, 5], dry_run=True, echo=lambda line: None)  # same machine: fine
    tree["environment"]["cpu_capability"] = "OTHER"
    summary.write_text(json.dumps(tree))
    with pytest.raises(ConfigError, match=r"another machine type \(cpu_capability OTHER, torch .*this machine: "
                       r"cpu_capability .*--mixed-machines"):
        run_suite(load_suite(path), mine, seeds=[0, 1, 5], dry_run=True, echo=lambda line: None)
    run_suite(load_suite(path), mine, seeds=[0, 1, 5], dry_run=True, echo=lambda line: None, mixed_machines=True)
    again = run_suite(load_suite(path), mine, echo=lambda line: None)  # nothing left to run: nothing is mixed
    assert not again.ran and again.skipped


def test_a_row_whose_cells_ran_other_code_takes_no_new_cells_unless_mixed_code(tiny_suite, tmp_path):
    """A row's seeds are one method: a new seed is refused where the row's finished cells ran another
    source hash, or a ``+dirty`` commit without one (unknown code), with one line naming the row, the
    versions and the fix; other rows still take cells, and ``--mixed-code`` adds them anyway."""
    from fedlt.environment import source_hash

    path, out, _ = tiny_suite
    mine = tmp_path / "out"
    shutil.copytree(out, mine)
    setting = "IF=10, alpha=0.5"
    assert json.loads((cell_dir(mine, setting, "FedProx", 0) / "summary.json").read_text())["environment"][
        "source_hash"] == source_hash()
    run_suite(load_suite(path), mine, seeds=[0, 1, 5], dry_run=True, echo=lambda line: None)  # same code: fine
    summary = cell_dir(mine, setting, "FedProx", 1) / "summary.json"
    tree = json.loads(summary.read_text())
    for env, shown in (({**tree["environment"], "source_hash": "0123456789abcdef"}, "0123456789abcdef"),
                       ({**tree["environment"], "source_hash": None, "git_commit": "abc1234+dirty"}, "abc1234+dirty")):
        summary.write_text(json.dumps({**tree, "environment": env}))
        with pytest.raises(ConfigError, match=re.escape(
                f"row 'FedProx' ({setting}) in {mine} holds finished or started cells of other or unidentifiable code "
                f"({source_hash()}: seed 0; {shown}: seed 1; this process: {source_hash()}), and a row's seeds are "
                "one method; re-run the row at one commit into a fresh --out (or delete its cells there), or pass "
                "--mixed-code")):
            run_suite(load_suite(path), mine, seeds=[0, 1, 5], dry_run=True, echo=lambda line: None)
    cli = CliRunner().invoke(app, ["bench", str(path), "--out", str(mine), "--seeds", "0,1,5", "--dry-run"])
    assert cli.exit_code == 2 and len(cli.stderr.strip().splitlines()) == 1 and "--mixed-code" in cli.stderr
    assert "FedProx" not in {c.method for c in run_suite(load_suite(path), mine, seeds=[0, 1, 5], dry_run=True,
                                                          rows=["FedAvg + CCVR"], echo=lambda line: None).cells}
    dry = CliRunner().invoke(app, ["bench", str(path), "--out", str(mine), "--seeds", "0,1,5", "--dry-run",
                                   "--mixed-code"])
    assert dry.exit_code == 0 and "6 cells: 4 finished, 2 to run" in dry.stdout and not dry.stderr
    # a started cell's rounds are one method too: resuming it under other code than trained its first ones is refused
    from fedlt.engine.checkpoint import load_checkpoint, save_checkpoint

    summary.write_text(json.dumps(tree))
    started = cell_dir(mine, setting, "FedProx", 0)
    state = load_checkpoint(started)
    state["segments"][0]["environment"]["source_hash"] = "fedcba9876543210"
    save_checkpoint(started, state)
    (started / "summary.json").unlink()
    with pytest.raises(ConfigError, match=re.escape(f"fedcba9876543210: seed 0; this process: {source_hash()})")):
        run_suite(load_suite(path), mine, dry_run=True, rows=["FedProx"], echo=lambda line: None)


def test_a_cell_whose_checkpoint_is_cut_off_is_refused_before_anything_trains(tiny_suite, tmp_path):
    path, out, _ = tiny_suite
    mine = tmp_path / "out"
    shutil.copytree(out, mine)
    run_dir = cell_dir(mine, "IF=10, alpha=0.5", "FedProx", 1)
    (run_dir / "summary.json").unlink()
    (run_dir / "checkpoint.pt").write_bytes((run_dir / "checkpoint.pt").read_bytes()[:100])
    result = CliRunner().invoke(app, ["bench", str(path), "--out", str(mine)])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert (f"cell 'IF=10, alpha=0.5 / FedProx / seed 1': {run_dir / 'checkpoint.pt'} is cut off or damaged, so the "
            f"cell cannot resume; delete {run_dir} to run it afresh") in result.stderr


def test_a_cell_run_under_other_resolved_method_arguments_is_not_reused(tiny_suite, tmp_path):
    """The summary's resolved ``method_args`` (defaults included) must match what the config resolves to
    now: a changed default is a different run although the config file is the same. A summary from
    before fedlt recorded them is matched on the knobs its config set (and the earlier defaults listed)."""
    path, out, _ = tiny_suite
    mine = tmp_path / "out"
    shutil.copytree(out, mine)
    summary = cell_dir(mine, "IF=10, alpha=0.5", "FedProx", 0) / "summary.json"
    tree = json.loads(summary.read_text())
    assert tree["method_args"] == {"mu": 0.01}  # fedprox's default, not given by the suite
    summary.write_text(json.dumps({**tree, "method_args": {"mu": 0.5}}))
    with pytest.raises(ConfigError, match=re.escape(
            f"cell 'IF=10, alpha=0.5 / FedProx / seed 0': {summary.parent} holds a run of another config "
            "(method_args.mu: 0.5 -> 0.01); delete that folder or pass --out to a fresh one")):
        run_suite(load_suite(path), mine, dry_run=True, echo=lambda line: None)
    # an override that changes every cell: one error counting them all, not one folder per call
    with pytest.raises(ConfigError, match=r"seed \d+': \S+ holds a run of another config \(fl\.lr: [\d.]+ -> 0\.0123\), "
                                          r"and so do \d+ more cells' folders \(.*\); delete them, or pass --out"):
        run_suite(load_suite(path), mine, dry_run=True, overrides=["fl.lr=0.0123"], echo=lambda line: None)
    # a row that now spells out the default the run resolved keeps it (its config file set no knob)
    summary.write_text(json.dumps(tree))
    spelled = {**TINY_SUITE, "methods": [TINY_SUITE["methods"][0], {"name": "FedProx", "overrides": [
        "method=fedprox", "method_args.mu=0.01"]}]}
    spelled_suite = load_suite(write_suite(tmp_path / "spelled.yaml", spelled))
    cells = run_suite(spelled_suite, mine, dry_run=True, rows=["FedProx"], echo=lambda line: None).cells
    assert {c.state for c in cells} == {"done"}
    summary.write_text(json.dumps({k: v for k, v in tree.items() if k != "method_args"}))
    cells = run_suite(load_suite(path), mine, dry_run=True, echo=lambda line: None).cells
    assert {c.state for c in cells} == {"done"}
    # no record: the knobs its config set are known, the others ran the default of their time
    with pytest.raises(ConfigError, match=re.escape("(method_args.mu: the default of its time, not recorded -> 0.01)")):
        run_suite(spelled_suite, mine, dry_run=True, rows=["FedProx"], echo=lambda line: None)


def test_a_run_from_before_a_method_knob_existed_ran_what_the_method_did_then():
    """SFD's ``scl_form`` was added after runs were kept: a summary without it ran Eq. 7 (``paper``), so it
    matches a row that asks for ``paper`` and not one that asks for the released code's A-SCL, whatever the
    default is now; a summary that records the knob is matched on it."""
    before = {"ce_gamma": 0.1, "beta_pi": 1.0, "scl_weight": None, "scl_temperature": 0.07, "scl_delta": True,
              "projector_hidden": None, "projector_dim": None}
    paper, released = (load_config(None, ["method=sfd", f"method_args.scl_form={form}"]) for form in ("paper", "released"))
    assert method_args_difference(before, paper) is None
    assert method_args_difference(before, released) == "method_args.scl_form: 'paper' -> 'released'"
    assert method_args_difference({**before, "scl_form": "released"}, released) is None
    assert method_args_difference({**before, "scl_form": "released"}, paper) == "method_args.scl_form: 'released' -> 'paper'"


def test_a_fedyoyo_run_from_before_its_knobs_ran_what_they_now_spell_out():
    """FedYoYo's ``view_interpolation``, ``asd_average`` and ``prior_features`` came after runs were kept, and
    their defaults are now the released code's: a summary without them ran bilinear views, Eq. 1's average and
    training features, so it is a cell of a row that spells those out and not of the default row; a summary
    that records the released code's values is one of the default row, and one that records only the
    resampling is one of the row that spells out the other two."""
    earlier = ["method_args.asd_average=batch", "method_args.prior_features=train"]
    default, bilinear, released_views = (load_config(None, ["method=fedyoyo", *extra]) for extra in (
        [], ["method_args.view_interpolation=bilinear", *earlier], earlier))
    before = {"lam": 4.0, "gamma": 0.1, "prior": "local_remix"}
    assert method_args_difference(before, bilinear) is None
    assert method_args_difference(before, default) == "method_args.asd_average: 'batch' -> 'correct'"
    assert method_args_difference({}, default, recorded=False) == "method_args.asd_average: 'batch' -> 'correct'"
    assert method_args_difference(before, released_views) == "method_args.view_interpolation: 'bilinear' -> 'released'"
    views = {**before, "view_interpolation": "released"}
    assert method_args_difference(views, released_views) is None
    assert method_args_difference({**views, "asd_average": "correct"}, default) == (
        "method_args.prior_features: 'train' -> 'clean_eval'")
    assert method_args_difference({**views, "asd_average": "correct", "prior_features": "clean_eval"}, default) is None


def test_a_run_kept_before_a_default_changed_and_without_a_record_of_its_knobs_ran_the_earlier_default():
    """FedLoGe's generic and personal heads changed default after runs were kept, some from before
    summaries recorded every knob: such a run, whose config set neither, ran GA-FR(psi) and the paper's
    LA-FR head, so it is no cell of the default now, and is one of a row that spells those out."""
    from fedlt.methods.registry import get_method, parse_method_args

    def fedloge(*knobs):
        return load_config(None, ["method=fedloge", *(f"method_args.{k}" for k in knobs)])

    default, then = fedloge(), fedloge("generic_head=psi", "personal_head=realigned")
    assert method_args_difference({}, default, recorded=False) == "method_args.generic_head: 'psi' -> 'fixed'"
    assert method_args_difference({}, then, recorded=False) is None  # a row that spells out what it ran
    assert method_args_difference({"gamma": 1}, fedloge("gamma=1", "generic_head=psi", "personal_head=realigned"),
                                  recorded=False) is None
    assert method_args_difference({}, fedloge("gamma=1", "generic_head=psi", "personal_head=realigned"),
                                  recorded=False) == "method_args.gamma: the default of its time, not recorded -> 1.0"
    # a config that asked for the sum then ran LA-FR's unit psi, the default of that time
    plus = fedloge("generic_head=psi", "personal_head=realigned_plus_phi")
    assert method_args_difference({"personal_head": "realigned_plus_phi"}, plus, recorded=False) == \
        "method_args.la_fr_psi: 'unit' -> 'raw'"
    spelled = {"personal_head": "realigned_plus_phi", "la_fr_psi": "raw", "generic_head": "fixed"}
    assert method_args_difference(spelled, default, recorded=False) is None
    # a recorded summary is matched on its record, every knob of it
    recorded = parse_method_args(get_method("fedloge"), {"personal_head": "realigned"}).model_dump(mode="json")
    assert method_args_difference(recorded, fedloge("personal_head=realigned")) is None
    assert method_args_difference(recorded, default) == "method_args.la_fr_psi: 'unit' -> 'raw'"


def test_a_cell_run_under_other_resolved_calibration_knobs_is_not_reused(tiny_suite, tmp_path):
    """A calibrating run records every calibration knob (defaults included); a changed default of a knob
    its calibrations read is another run, one of a calibration it did not run is not. A summary from before
    that record ran CReFF's feature momentum at 0.5, the earlier default."""
    path, out, _ = tiny_suite
    mine = tmp_path / "out"
    shutil.copytree(out, mine)
    summary = cell_dir(mine, "IF=10, alpha=0.5", "FedAvg + CCVR", 0) / "summary.json"
    tree = json.loads(summary.read_text())
    assert tree["calibration"] == ["ccvr"]
    assert tree["calibration_args"]["retrain_steps"] == 20  # the suite's
    assert tree["calibration_args"]["ccvr_virtual_per_class"] == 100  # a default
    assert "calibration_args" not in json.loads((cell_dir(mine, "IF=10, alpha=0.5", "FedProx", 0)
                                                 / "summary.json").read_text())
    summary.write_text(json.dumps({**tree, "calibration_args": {**tree["calibration_args"],
                                                                 "ccvr_virtual_per_class": 7}}))
    with pytest.raises(ConfigError, match=re.escape(
            f"cell 'IF=10, alpha=0.5 / FedAvg + CCVR / seed 0': {summary.parent} holds a run of another config "
            "(calibration_args.ccvr_virtual_per_class: 7 -> 100); delete that folder or pass --out to a fresh one")):
        run_suite(load_suite(path), mine, dry_run=True, echo=lambda line: None)
    unread = {**tree["calibration_args"], "creff_feature_momentum": 0.9, "safs_steps": 3}  # knobs CCVR never reads
    summary.write_text(json.dumps({**tree, "calibration_args": unread}))
    assert {c.state for c in run_suite(load_suite(path), mine, dry_run=True, echo=lambda line: None).cells} == {"done"}
    before_record = {k: v for k, v in tree.items() if k != "calibration_args"}
    summary.write_text(json.dumps(before_record))
    assert {c.state for c in run_suite(load_suite(path), mine, dry_run=True, echo=lambda line: None).cells} == {"done"}
    summary.write_text(json.dumps({**before_record, "calibration": ["creff", "ccvr"]}))
    with pytest.raises(ConfigError, match=re.escape("(calibration_args.creff_feature_momentum: 0.5 -> 0.0)")):
        run_suite(load_suite(path), mine, dry_run=True, echo=lambda line: None)
    # a record from before a knob existed ran the knob's value of that time: CReFF's bias term as a column
    knob_later = {k: v for k, v in tree["calibration_args"].items() if k != "creff_matching_bias"}
    summary.write_text(json.dumps({**tree, "calibration": ["creff", "ccvr"], "calibration_args": knob_later}))
    with pytest.raises(ConfigError, match=re.escape("(calibration_args.creff_matching_bias: 'row' -> 'released')")):
        run_suite(load_suite(path), mine, dry_run=True, echo=lambda line: None)
    # a CReFF row that spells the earlier defaults keeps such a run: the values it ran with match, not their spelling
    spelled = load_config(None, ["method=creff", "calibration_args.creff_feature_momentum=0.5",
                                 "calibration_args.creff_matching_bias=row"])
    assert calibration_args_difference({"calibration": ["creff"]}, {}, spelled) is None
    assert calibration_args_difference({"calibration": ["creff"]}, {}, load_config(None, ["method=creff"])) == (
        "calibration_args.creff_feature_momentum: 0.5 -> 0.0")


@pytest.mark.parametrize(("override", "why"), [("seed=3", "a suite gives each cell its seed (pick them with --seeds)"),
                                                ("run.out_dir=/tmp/x", "a suite's cells go under --out"),
                                                ("run.name=x", "a suite names each cell's folder")])
def test_an_override_for_every_cell_may_not_set_what_the_suite_sets_for_each(tmp_path, override, why):
    """Every seed's cell would train seed 3, and a folder or name given for all cells would be ignored."""
    suite = load_suite(write_suite(tmp_path / "s.yaml", TINY_SUITE))
    with pytest.raises(ConfigError, match=re.escape(f"{override}: {why}")):
        run_suite(suite, tmp_path / "out", overrides=[override], dry_run=True, echo=lambda line: None)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("where", "override", "why"), [
    ("overrides", "seed=5", "seed=5 gives every cell that seed, whatever its seed<S> folder says"),
    ("settings", "seed=5", "seed=5 gives every cell that seed"),
    ("methods", "seed=3", "seed=3 gives every cell that seed"),
    ("grid", "seed", "seed=1 gives every cell that seed"),
    ("overrides", "run.out_dir=/tmp/x", "run.out_dir=/tmp/x: a suite's cells go under --out"),
    ("methods", "run.name=x", "run.name=x: a suite names each cell's folder"),
])
def test_a_suite_s_own_overrides_may_not_set_what_the_suite_sets_for_each_cell(tmp_path, where, override, why):
    """As for the command line's: a suite's seed=5 made the cells of seeds 0 and 1 train seed 5 alike (a
    mean over seeds of one run, with no spread), and its run.out_dir or run.name was dropped without a word."""
    tree = json.loads(json.dumps(TINY_SUITE))
    tree["seeds"] = [0, 1]
    if where == "overrides":
        tree["overrides"] = [*tree.get("overrides", []), override]
    elif where == "settings":
        tree["settings"] = [{"name": "default", "overrides": [override]}]
    elif where == "methods":
        tree["methods"][0]["overrides"] = [*tree["methods"][0].get("overrides", []), override]
    else:
        tree["methods"][0]["grid"] = {override: [1, 2]}
    with pytest.raises(ConfigError, match=re.escape(why)):
        load_suite(write_suite(tmp_path / "s.yaml", tree))
    tree["overrides"] = [*tree.get("overrides", []), "data.seed=7"]  # a seed the cell's own: allowed
    tree["methods"][0].pop("grid", None)
    tree["methods"][0]["overrides"] = ["seed=100{seed}"]
    tree["settings"] = [{"name": "default"}]
    tree["overrides"] = [o for o in tree["overrides"] if o != override]
    assert load_suite(write_suite(tmp_path / "ok.yaml", tree)).spec.seeds == [0, 1]


def test_a_folder_s_suite_file_names_a_repository_config_from_the_repository_root(tmp_path, monkeypatch):
    """A kept folder's suite file must load in any clone: a base config inside the repository is written
    as its path from the repository's root, one outside it stays absolute."""
    monkeypatch.chdir(tmp_path)  # found from the repository's root, not from a working directory's configs/
    inside = load_suite(write_suite(tmp_path / "inside.yaml", {**TINY_SUITE, "base": "configs/fmnist_lt.yaml"}))
    (tmp_path / "own.yaml").write_text("fl:\n  rounds: 1\n")
    outside = load_suite(write_suite(tmp_path / "outside.yaml", {**TINY_SUITE, "base": str(tmp_path / "own.yaml")}))
    for suite, folder in ((inside, tmp_path / "a"), (outside, tmp_path / "b")):
        write_suite_file(suite, folder, None)
    assert yaml.safe_load((tmp_path / "a" / "suite.yaml").read_text())["base"] == "configs/fmnist_lt.yaml"
    assert yaml.safe_load((tmp_path / "b" / "suite.yaml").read_text())["base"] == str((tmp_path / "own.yaml").resolve())
    assert load_suite(tmp_path / "a" / "suite.yaml").base == REPO_ROOT / "configs" / "fmnist_lt.yaml"


def test_running_some_seeds_keeps_the_folder_reportable_and_the_caption_names_the_seeds_averaged(tiny_suite, tmp_path):
    """``--seeds`` on a suite whose rows list their own seeds: the folder's suite file keeps the suite's
    seeds (a row's may not name a seed the suite lacks), and a report names the seeds its tables hold."""
    path, out, _ = tiny_suite
    tree = {**TINY_SUITE, "methods": [TINY_SUITE["methods"][0], {**TINY_SUITE["methods"][1], "seeds": [1]}]}
    suite = load_suite(write_suite(tmp_path / "row-seeds.yaml", tree))
    mine = tmp_path / "out"
    shutil.copytree(cell_dir(out, "IF=10, alpha=0.5", "FedAvg + CCVR", 0), cell_dir(mine, "IF=10, alpha=0.5",
                                                                                   "FedAvg + CCVR", 0))
    run_suite(suite, mine, seeds=[0], echo=lambda line: None)  # the row of seed 1 only has nothing to run
    assert yaml.safe_load((mine / "suite.yaml").read_text())["seeds"] == [0, 1]
    markdown = write_report(mine, with_plots=False).markdown
    assert "one seed (0)" in markdown and "over seeds 0, 1" not in markdown
    shutil.copytree(out, tmp_path / "all")
    run_suite(load_suite(path), tmp_path / "all", seeds=[0], echo=lambda line: None)  # nothing left to run
    assert yaml.safe_load((tmp_path / "all" / "suite.yaml").read_text())["seeds"] == [0, 1]
    assert "mean ± sample std over seeds 0, 1" in write_report(tmp_path / "all", with_plots=False).markdown


def test_a_report_leaves_out_a_run_copied_in_from_another_config_and_says_so(tiny_suite, tmp_path):
    """The bench refuses a cell folder holding a run of another config; its report never averages one in."""
    _, out, _ = tiny_suite
    mine = tmp_path / "out"
    shutil.copytree(out, mine)
    seed0, seed1 = (cell_dir(mine, "IF=10, alpha=0.5", "FedProx", s) for s in (0, 1))
    config = yaml.safe_load((seed1 / "config.yaml").read_text())
    (seed1 / "config.yaml").write_text(yaml.safe_dump({**config, "data": {**config["data"], "num_clients": 6}}))
    markdown = write_report(mine, with_plots=False).markdown
    assert f"row 'FedProx': left out {seed1}: its config differs from seed 0's (data.num_clients: 6 -> 4)" in markdown
    assert "| FedProx (1/2 seeds) |" in markdown
    shutil.rmtree(seed1)
    shutil.copytree(seed0, seed1)  # seed 0's run in seed 1's folder
    assert (f"row 'FedProx': left out {seed1}: it ran seed 0 (data.seed None) where its folder means seed 1 "
            "(data.seed None)") in write_report(mine, with_plots=False).markdown


def test_a_replicate_row_that_sets_its_own_seeds_is_reported_whole(tmp_path):
    """A row ``[data.seed={seed}, seed=100{seed}]`` (the federation of seed S, other training randomness)
    runs seed 100S in folder seedS: its runs are the row's, not runs copied in."""
    tree = {**TINY_SUITE, "methods": [TINY_SUITE["methods"][1], {"name": "FedProx replicate", "overrides": [
        "method=fedprox", "data.seed={seed}", "seed=100{seed}"]}]}
    out = tmp_path / "out"
    run_suite(load_suite(write_suite(tmp_path / "replicate.yaml", tree)), out, echo=lambda line: None)
    markdown = write_report(out, with_plots=False).markdown
    assert "left out" not in markdown and "| FedProx replicate |" in markdown and "(0/2 seeds)" not in markdown


def test_a_row_that_sets_another_key_per_seed_is_reported_whole(tmp_path):
    """``{seed}`` in any override is the cell's seed: a row ``fl.lr=0.0{seed}5`` ran its cells at other rates,
    which the report took for runs copied in from another config and left out (a row of 2 seeds reported
    with 1). A run whose config differs in a key the row does not set per seed is still left out."""
    tree = {**TINY_SUITE, "methods": [TINY_SUITE["methods"][1], {"name": "FedProx per-seed rate", "overrides": [
        "method=fedprox", "fl.lr=0.0{seed}5"]}]}
    out = tmp_path / "out"
    run_suite(load_suite(write_suite(tmp_path / "per-seed.yaml", tree)), out, echo=lambda line: None)
    markdown = write_report(out, with_plots=False).markdown
    assert "left out" not in markdown and "| FedProx per-seed rate |" in markdown
    seed1 = cell_dir(out, "IF=10, alpha=0.5", "FedProx per-seed rate", 1)
    config = yaml.safe_load((seed1 / "config.yaml").read_text())
    assert config["fl"]["lr"] == 0.015
    (seed1 / "config.yaml").write_text(yaml.safe_dump({**config, "data": {**config["data"], "num_clients": 6}}))
    assert (f"left out {seed1}: its config differs from seed 0's (data.num_clients: 6 -> 4)"
            in write_report(out, with_plots=False).markdown)


def test_changed_config_in_a_cell_folder_is_an_error_not_a_mix(tiny_suite, tmp_path):
    path, out, _ = tiny_suite
    tree = {**TINY_SUITE, "overrides": [*TINY_SUITE["overrides"], "fl.lr=0.01"]}
    with pytest.raises(ConfigError, match=r"fl\.lr: 0\.05 -> 0\.01.*--out"):
        run_suite(load_suite(write_suite(tmp_path / "changed.yaml", tree)), out, echo=lambda line: None)


BAD_SUITES = {
    "unknown_key": ({**TINY_SUITE, "setings": []}, "unknown key 'setings'"),
    "no_methods": ({k: v for k, v in TINY_SUITE.items() if k != "methods"}, "key 'methods' is missing"),
    "methods_misspelt": ({**{k: v for k, v in TINY_SUITE.items() if k != "methods"}, "method": TINY_SUITE["methods"]},
                         "unknown key 'method'"),
    "not_key_value": ({**TINY_SUITE, "overrides": ["fl.rounds"]}, "overrides: 'fl.rounds' is not key=value"),
    "bad_name": ({**TINY_SUITE, "name": "My Suite"}, "name: 'My Suite' is not a slug"),
    "bool_seed": ({**TINY_SUITE, "seeds": [True, 2]}, "seeds[0]: Input should be a valid integer"),
    "unknown_setting": ({**TINY_SUITE, "methods": [{"name": "A", "settings": ["nope"]}]},
                        "methods[0].settings names 'nope'"),
    "duplicate_row": ({**TINY_SUITE, "methods": [{"name": "A", "variants": {"A": "ccvr"}}]}, "row label 'A'"),
    "unknown_reference": ({**TINY_SUITE, "reference": "FedAvgg"}, "reference names 'FedAvgg', which is no row; use one "
                          "of: FedAvg + CCVR, FedAvg, FedProx"),
    "row_seed_outside_suite": ({**TINY_SUITE, "methods": [{**TINY_SUITE["methods"][1], "seeds": [0, 7]}]},
                               "methods[0].seeds names seed 7, which the suite does not run; use some of: 0, 1"),
    "no_settings": ({**TINY_SUITE, "settings": []}, "settings is empty; list at least one"),
    "empty_row_name": ({**TINY_SUITE, "methods": [{"name": " ", "overrides": ["method=fedavg"]}]},
                       "methods[0].name is empty; give it a name"),
    "seeds_not_a_list": ({**TINY_SUITE, "seeds": 0}, "seeds: Input should be a valid list, got 0 (see the suite format "
                         "in docs/benchmarks.md)"),
    "method_typo_in_last_cell": ({**TINY_SUITE, "methods": [*TINY_SUITE["methods"],
                                                            {"name": "Typo", "overrides": ["method=fedavgg"]}]},
                                 "cell 'IF=10, alpha=0.5 / Typo / seed 0': unknown method 'fedavgg'"),
}


@pytest.mark.parametrize("case", list(BAD_SUITES))
def test_bad_suite_files_exit_2_with_one_line_and_run_nothing(tmp_path, case):
    tree, message = BAD_SUITES[case]
    path = write_suite(tmp_path / "bad.yaml", tree)
    result = CliRunner().invoke(app, ["bench", str(path), "--out", str(tmp_path / "out")])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedlt: error: ") and message in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_unknown_suite_name_and_bad_yaml(tmp_path):
    result = CliRunner().invoke(app, ["bench", "no-such-suite"])
    assert result.exit_code == 2 and "built-in suite 'no-such-suite'" in result.stderr and "demo" in result.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nmethods: [\n")
    result = CliRunner().invoke(app, ["bench", str(bad)])
    assert result.exit_code == 2 and "is not valid YAML at line" in result.stderr
    bad.write_text("name: x\nmethods:\n  - name: A\n    overrides: [fl.rounds=1]\n    overrides: [fl.lr=0.1]\n")
    result = CliRunner().invoke(app, ["bench", str(bad)])
    assert result.exit_code == 2 and "gives the key 'overrides' twice (the second time at line 5)" in result.stderr


def test_builtin_suites_validate_and_list(tmp_path, monkeypatch):
    import fedlt.data.federated

    result = CliRunner().invoke(app, ["bench", "list"])
    assert result.exit_code == 0
    names = [line.split()[0] for line in result.stdout.splitlines()]
    assert {"demo", "calibration", "cpu-paper", "paper-creff", "paper-fedloge", "paper-gbme", "paper-fedyoyo",
            "paper-sfd"} <= set(names)
    built = []  # the federations are recorded, not built: the paper suites need CIFAR files this machine lacks
    monkeypatch.setattr(fedlt.data.federated, "build_federated_data",
                        lambda data, seed, **_: built.append((data.dataset, json.dumps(data.model_dump(mode="json")),
                                                              data.seed if data.seed is not None else seed)))
    for name in names:  # every cell's config passes the same checks as a run, and each federation is built once
        built.clear()
        dry = CliRunner().invoke(app, ["bench", name, "--dry-run", "--out", str(tmp_path / name)])
        assert dry.exit_code == 0, (name, dry.stderr)
        assert "0 finished" in dry.stdout
        assert built and len(built) == len(set(built)), (name, built)
        if name == "paper-creff":  # two datasets, three imbalance factors, three seeds
            assert sorted({b[0] for b in built}) == ["cifar10", "cifar100"] and len(built) == 18


@pytest.mark.parametrize(("methods", "claim", "refusal"), [
    ([{"name": "A", "overrides": ["method=fedavg"], "variants": {"B": "nosuchvariant"}}], None,
     "row 'A': its runs give no variant 'nosuchvariant' (they give: none); fix the row's variants"),
    ([{"name": "A", "overrides": ["method=ccvr"], "variants": {"B": "ccvr"}}], None,
     "row 'A': its runs give no variant 'ccvr' (they give: uncalibrated)"),
    ([{"name": "A", "overrides": ["method=fedloge"], "select_variants": {"sse_c": "method_args.generic_head=fixed"},
       "grid": {"method_args.gamma": [1, 4]}}], None,
     "row 'A': its runs give no variant 'sse_c' (they give: psi_ga_fr, psi_raw)"),
    ([{"name": "A", "overrides": ["method=fedavg"]}, {"name": "P", "overrides": ["method=fedper"]}],
     {"row": "P", "against": "A", "metric": "acc"}, "claims[0] compares acc of 'P', whose runs have no global model"),
    ([{"name": "A", "overrides": ["method=fedavg", "eval.personalized=false"]},
      {"name": "B", "overrides": ["method=fedprox"]}],
     {"row": "B", "against": "A", "metric": "pm_acc"}, "claims[0] compares pm_acc of 'A', whose runs have "
     "eval.personalized=false"),
    ([{"name": "A", "overrides": ["method=ccvr"], "variants": {"V": "uncalibrated"}}, {"name": "B", "overrides": []}],
     {"row": "V", "against": "B", "metric": "pm_acc"}, "claims[0] compares pm_acc of 'V', whose runs have a variant"),
])
def test_what_a_suite_reads_of_its_runs_is_checked_before_any_cell_trains(tmp_path, methods, claim, refusal):
    """A variant or a claim's metric the rows' runs cannot give is refused by the dry run, not found
    missing in the report after every cell trained."""
    tree = {**TINY_SUITE, "seeds": [0, 1], "overrides": [*TINY_SUITE["overrides"], "data.val_per_class=2"],
            "methods": methods}
    if claim is not None:
        tree["claims"] = [{"paper": "P", "claim": "c", **claim}]
    path = write_suite(tmp_path / "s.yaml", tree)
    result = CliRunner().invoke(app, ["bench", str(path), "--out", str(tmp_path / "out"), "--dry-run"])
    assert result.exit_code == 2 and refusal in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()


def test_an_impossible_partition_stops_a_suite_before_any_cell_trains(tmp_path):
    tree = {**TINY_SUITE, "seeds": [0], "methods": [
        TINY_SUITE["methods"][1], {"name": "Crowded", "overrides": ["data.num_clients=100000"]}]}
    path = write_suite(tmp_path / "s.yaml", tree)
    for extra in (["--dry-run"], []):
        result = CliRunner().invoke(app, ["bench", str(path), "--out", str(tmp_path / "out"), *extra])
        assert result.exit_code == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "cell 'IF=10, alpha=0.5 / Crowded / seed 0': data.num_clients=100000 exceeds" in lines[0]
        assert not (tmp_path / "out").exists()  # the FedProx cell did not train either


def test_missing_data_files_stop_a_suite_before_any_cell_trains(tmp_path):
    (tmp_path / "empty").mkdir()
    tree = {**TINY_SUITE, "seeds": [0], "methods": [
        TINY_SUITE["methods"][1], {"name": "On CIFAR", "overrides": ["data.dataset=cifar10", f"data.root={tmp_path / 'empty'}"]}]}
    path = write_suite(tmp_path / "s.yaml", tree)
    for extra in ([], ["--dry-run"]):
        result = CliRunner().invoke(app, ["bench", str(path), "--out", str(tmp_path / "out"), *extra])
        assert result.exit_code == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "cell 'IF=10, alpha=0.5 / On CIFAR / seed 0': cifar10: no cifar-10-batches-py/" in lines[0]
        assert not (tmp_path / "out").exists()  # the FedProx cell did not train either


def test_seed_placeholder_and_row_seeds_expand_into_the_right_cells(tmp_path):
    from fedlt.bench.suite import expand

    tree = {**TINY_SUITE, "seeds": [0, 1, 2], "methods": [
        {"name": "FedAvg", "overrides": ["method=fedavg"]},
        {"name": "FedAvg replicate", "overrides": ["method=fedavg", "data.seed={seed}", "seed=100{seed}"],
         "seeds": [1, 2]}]}
    suite = load_suite(write_suite(tmp_path / "s.yaml", tree))
    cells = expand(suite, tmp_path / "out")
    assert [(c.method, c.seed) for c in cells] == [("FedAvg", 0), ("FedAvg", 1), ("FedAvg", 2),
                                                   ("FedAvg replicate", 1), ("FedAvg replicate", 2)]
    replicate = cells[-1].overrides
    assert replicate[0] == "seed=2" and "data.seed=2" in replicate and "seed=1002" in replicate
    assert replicate.index("seed=1002") > 0  # the row's own seed comes after the cell's: it wins
    from fedlt.config import load_config

    cfg = load_config(suite.base, replicate)
    assert (cfg.seed, cfg.data.seed) == (1002, 2)


def test_report_states_the_cost_its_bench_log_measured(tiny_suite, tmp_path):
    import datetime

    from fedlt.reporting.cost import suite_cost

    _, out, _ = tiny_suite
    records = [json.loads(line) for line in (out / "bench-log.jsonl").read_text().splitlines()]
    cost = suite_cost(out / "bench-log.jsonl")
    ok = [r for r in records if r["status"] == "ok"]
    assert cost.cells == 4 == len(ok) and cost.cpu_s == pytest.approx(sum(r["cpu_s"] for r in ok))
    ends = [datetime.datetime.fromisoformat(r["time"]) for r in ok]
    starts = [e - datetime.timedelta(seconds=r["wall_s"]) for e, r in zip(ends, ok)]
    assert cost.span_s == pytest.approx((max(ends) - min(starts)).total_seconds())
    text = write_report(out, tmp_path / "report", with_plots=False).markdown
    assert f"Measured by this run (bench-log.jsonl): 4 cells, {cost.cpu_s / 60:.1f} CPU-minutes" in text
    log = out / "log.jsonl"  # a retried cell counts once (its last ok record); a torn line is skipped
    log.write_text(json.dumps({**ok[0], "cpu_s": 1.0}) + "\n" + json.dumps({**ok[0], "cpu_s": 2.0}) + "\n{\"cut")
    assert suite_cost(log).cells == 1 and suite_cost(log).cpu_s == 2.0
    moved = {**ok[0], "cpu_s": 3.0, "run_dir": str(Path("/elsewhere") / Path(ok[0]["run_dir"]).relative_to(out))}
    log.write_text(json.dumps(ok[0]) + "\n" + json.dumps(moved) + "\n")  # the same cell, its folder named otherwise
    assert suite_cost(log).cells == 1 and suite_cost(log).cpu_s == 3.0
    assert suite_cost(tmp_path / "absent.jsonl") is None
    gone = {**ok[1], "run_dir": str(Path(ok[1]["run_dir"]).parent / "seed99")}  # a cell whose folder was deleted
    log.write_text(json.dumps(ok[0]) + "\n" + json.dumps(gone) + "\n")
    assert suite_cost(log).cells == 1 and suite_cost(log).cpu_s == ok[0]["cpu_s"]
    log.write_text("\n".join(json.dumps(r) for r in [{**ok[0], "time": "yesterday"}, {**ok[0], "time": 3}, [1],
                                                     {k: v for k, v in ok[1].items() if k != "time"},
                                                     {**ok[1], "wall_s": "long"}, {**ok[1], "run_dir": 7},
                                                     {**ok[1], "time": ok[1]["time"] + "+00:00"}, ok[2]]))
    assert suite_cost(log).cells == 1 and suite_cost(log).cpu_s == ok[2]["cpu_s"]  # records without a time are no record


def test_row_option_runs_only_the_named_rows_and_a_variant_names_its_runs(tmp_path):
    from fedlt.bench.suite import expand

    suite = load_suite(write_suite(tmp_path / "s.yaml", TINY_SUITE))
    only = expand(suite, tmp_path / "out", rows=["FedProx"])
    assert [(c.method, c.seed) for c in only] == [("FedProx", 0), ("FedProx", 1)]
    by_variant = expand(suite, tmp_path / "out", rows=["FedAvg"])  # read from the CCVR row's runs
    assert {c.method for c in by_variant} == {"FedAvg + CCVR"}
    result = CliRunner().invoke(app, ["bench", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "out"),
                                      "--row", "FedProx", "--row", "Nosuch", "--dry-run"])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--row 'Nosuch' is no row of suite tiny; use one of: FedAvg + CCVR, FedAvg, FedProx" in lines[0]
    result = CliRunner().invoke(app, ["bench", str(tmp_path / "s.yaml"), "--out", str(tmp_path / "out"),
                                      "--row", "FedProx", "--dry-run"])
    assert result.exit_code == 0 and "2 cells: 0 finished, 2 to run" in result.stdout and not result.stderr


def test_reference_config_commands_run_exactly_the_reference_suites_cells(tmp_path):
    """configs/reference.yaml's one command per headline row resolves to the reference suite's cell
    of that row (seed 0): the two spellings of the protocol cannot drift apart."""
    import shlex

    from fedlt.bench.suite import config_difference, expand
    from fedlt.config import load_config
    from fedlt.methods.registry import get_method, parse_method_args

    root = Path(__file__).resolve().parents[1]
    text = (root / "configs/reference.yaml").read_text()
    commands = re.findall(r"^#\s+fedlt run configs/reference\.yaml(.*?)\s+#\s+([^,\n]+?)\s*(?:,.*)?$", text, re.M)
    rows = {name: shlex.split(args) for args, name in commands}
    assert set(rows) == {"FedAvg (CE)", "FedAvg (BSM)", "CReFF", "SFD", "FedLoGe", "GBME", "FedYoYo"}
    cells = {c.method: c for c in expand(load_suite("reference"), tmp_path, seeds=[0])}

    def resolved(cfg):  # method_args with the defaults filled in: the suite spells some out
        tree = cfg.model_dump(mode="json")
        tree["method_args"] = parse_method_args(get_method(cfg.method), cfg.method_args).model_dump(mode="json")
        return tree

    for name, overrides in rows.items():
        suite_cfg = resolved(load_config(load_suite("reference").base, cells[name].overrides))
        command_cfg = resolved(load_config(root / "configs/reference.yaml", ["seed=0", *overrides]))
        assert config_difference(suite_cfg, command_cfg) is None, name
        assert config_difference(command_cfg, suite_cfg) is None, name


@pytest.mark.parametrize("name, momentum, weight_decay, augment", [
    ("paper-creff", 0.0, 0.0, "crop_flip"),    # Sec. 4.1 "SGD with a learning rate 0.1"; the released code crops and flips
    ("paper-fedyoyo", 0.0, 0.0, "crop_flip"),  # CReFF's setting and code (FedYoYo's own views aside)
    ("paper-fedloge", 0.5, 0.0, "crop_flip"),  # the released code: momentum 0.5, no weight decay, crop and flip
    ("paper-gbme", 0.9, 5e-4, "crop_flip"),    # the released code's, with Cutout on CIFAR-100 (below)
    ("paper-sfd", 0.9, 1e-5, "resized_crop_flip"),  # App. C.2; the released code's augmentation
])
def test_paper_suites_train_locally_with_their_papers_sgd(tmp_path, name, momentum, weight_decay, augment):
    """fedlt's own defaults (momentum 0.9, weight decay 5e-4, no augmentation, CReFF's feature momentum
    0.5) are not every paper's: each paper suite states its local SGD and augmentation, for every cell."""
    from fedlt.bench.suite import expand
    from fedlt.config import load_config

    suite = load_suite(name)
    for cell in expand(suite, tmp_path):
        cfg = load_config(suite.base, cell.overrides)
        views = "none" if cfg.method == "fedyoyo" else augment  # FedYoYo draws its own weak and strong views
        if name == "paper-gbme" and cfg.data.dataset == "cifar100":
            views = "crop_flip_cutout"
        assert (cfg.fl.momentum, cfg.fl.weight_decay, cfg.data.augment) == (momentum, weight_decay, views), cell.label
        if name in ("paper-creff", "paper-fedyoyo"):  # both papers' released split
            assert (cfg.data.partition, cfg.data.equal_size) == ("grouped_dirichlet", False), cell.label
        if cfg.method == "creff" and name in ("paper-creff", "paper-fedyoyo"):
            assert cfg.calibration_args["creff_feature_momentum"] == 0, cell.label
        if cfg.data.dataset == "svhn":
            assert cfg.data.hflip is True, cell.label  # the paper's weak view flips, digits too
    if name == "paper-gbme":
        assert {load_config(suite.base, c.overrides).fl.rounds for c in expand(suite, tmp_path)} == {2000}


@pytest.mark.parametrize("name", ["paper-creff", "paper-fedloge", "paper-gbme", "paper-fedyoyo", "paper-sfd"])
def test_paper_suites_run_every_row_of_their_table_that_fedlt_has(name):
    """A paper suite names the table's rows it lacks as 'missing until their methods land': a method fedlt
    has is a row, not missing (paper-creff named FedAvgM missing long after method=fedavgm landed)."""
    from fedlt.methods.registry import list_methods

    def key(label: str) -> str:
        return re.sub(r"[^a-z0-9]", "", label.lower())

    suite = load_suite(name)
    missing = re.search(r"Missing until (?:its|their) methods? lands?: ([^.]+)\.", suite.spec.description)
    assert missing, name
    have = {key(method) for method, _ in list_methods()}
    assert not [m for m in missing.group(1).split(", ") if key(m) in have], name
    rows = {m.name: m.overrides for m in suite.spec.methods}
    if name == "paper-creff":  # CReFF's Table 1: FedAvgM (Hsu et al. 2019) among the heterogeneity-oriented rows
        assert rows["FedAvgM"] == ["method=fedavgm"]


@pytest.mark.parametrize("signum", [2, 15])  # SIGINT, SIGTERM: sent to the bench alone, not to its workers
def test_a_signalled_bench_stops_its_workers_and_starts_no_queued_cell(tmp_path, signum):
    """With --workers 2, an interrupt of the bench left its pool to go on: after SIGINT the queued cells
    still ran (and were not logged), after SIGTERM the workers outlived the bench and started new cells.
    Now the running cells are interrupted (they resume later), the queued ones never start, and no
    process of the bench is left."""
    import os
    import subprocess
    import sys
    import time

    tree = {**TINY_SUITE, "seeds": [0, 1, 2, 3], "methods": [TINY_SUITE["methods"][1]],
            "overrides": [*TINY_SUITE["overrides"], "fl.rounds=400", "eval.every=100", "run.checkpoint_every=1"]}
    path = write_suite(tmp_path / "s.yaml", tree)
    out = tmp_path / "out"
    bench = subprocess.Popen([sys.executable, "-m", "fedlt.cli", "bench", str(path), "--out", str(out), "--workers",
                              "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    cells = [cell_dir(out, "IF=10, alpha=0.5", "FedProx", seed) for seed in range(4)]
    deadline = time.monotonic() + 240
    while not all((c / "checkpoint.pt").is_file() for c in cells[:2]):
        assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
        time.sleep(0.2)
    os.kill(bench.pid, signum)
    signalled = time.monotonic()
    _, err = bench.communicate(timeout=120)
    assert bench.returncode == 128 + signum, err
    assert time.monotonic() - signalled < STOP_GRACE_S / 2  # the cells stopped at once: no grace waited out
    assert "interrupted" in err.splitlines()[-1] and "Traceback" not in err, err
    last = err.splitlines()[-1]  # it names the cells it stopped and the round each had reached
    assert all(f"IF=10, alpha=0.5 / FedProx / seed {seed} (started, 400 rounds)" in last for seed in (0, 1)), err
    assert last.endswith("the same `fedlt bench` command goes on with them (from the last checkpoint, where there "
                         "is one) and with the suite's other unfinished cells"), last
    wait_until_group_ends(bench.pid)  # the workers were stopped before the bench ended
    assert not cells[2].exists() and not cells[3].exists()  # queued: never started
    states = {c.seed: c.state for c in run_suite(load_suite(path), out, dry_run=True, echo=lambda line: None).cells}
    assert states == {0: "resume", 1: "resume", 2: "new", 3: "new"}
    assert not (out / "bench-log.jsonl").exists() and not (out / "failed.json").exists()


def test_ctrl_c_while_the_bench_spawns_its_workers_stops_it(monkeypatch, capfd):
    """The bench ignored SIGINT while it spawned its workers (so that they start deaf to it): a Ctrl-C in
    that window was lost, and the bench ran the whole suite. It now stops the bench once the workers are
    spawned (none cut short amid its spawn, which ends in a traceback), and the workers end."""
    import multiprocessing
    import os
    import signal
    import threading
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import _ExecutorManagerThread

    from fedlt.bench.workers import run_in_workers

    submit = ProcessPoolExecutor.submit

    def ctrl_c_first(pool, *args, **kwargs):
        if not pool._processes:  # the first worker's spawn
            os.kill(os.getpid(), signal.SIGINT)
        return submit(pool, *args, **kwargs)

    monkeypatch.setattr(ProcessPoolExecutor, "submit", ctrl_c_first)
    ended = []
    jobs = [(seed, ([("status", "ok"), ("wall_s", 0.0)],)) for seed in range(4)]  # dict(pairs): a cell's info
    with pytest.raises(KeyboardInterrupt):
        run_in_workers(jobs, 2, dict, lambda key, info: ended.append(key))
    assert ended == []
    # the pool's thread that reaps its workers has ended: left running, it raced a caller's join (no exit code)
    assert not [thread for thread in threading.enumerate() if isinstance(thread, _ExecutorManagerThread)]
    for worker in multiprocessing.active_children():
        worker.join(timeout=120)
        assert worker.exitcode is not None
    assert "Traceback" not in capfd.readouterr().err


def test_a_diverged_cell_kept_from_an_earlier_call_still_fails_the_bench_and_is_named(tmp_path):
    """A diverged cell is a result (its method's failure), kept like a finished one; a later call said
    '0 failed' and exited 0 where the first exited 1. Every call now names it and exits 1."""
    tree = {**TINY_SUITE, "seeds": [0], "methods": [{"name": "FedAvg", "overrides": ["method=fedavg"]},
                                                    {"name": "Wild", "overrides": ["method=fedavg", "fl.lr=1000000"]}]}
    path = write_suite(tmp_path / "s.yaml", tree)
    out = tmp_path / "out"
    for call in range(2):
        result = CliRunner().invoke(app, ["bench", str(path), "--out", str(out), "--no-report"])
        assert result.exit_code == 1, (call, result.stderr)
        footer = [line for line in result.stderr.splitlines() if " ran, " in line][0]
        assert footer.split("] ")[1].startswith(["1 ran, 0 skipped (finished before), 1 failed (see ",
                                                 "0 ran, 2 skipped (finished before, 1 of them diverged), 0 failed "
                                                 "(see "][call]), footer
        assert "failed: IF=10, alpha=0.5 / Wild / seed 0: " in result.stderr
    assert "diverged (kept from an earlier call)" in result.stderr
    assert json.loads((out / "failed.json").read_text())[0]["cell"] == "IF=10, alpha=0.5 / Wild / seed 0"
    table = write_report(out, with_plots=False).markdown
    assert "row 'Wild': seed 0 diverged in round 1" in table


def test_a_call_for_some_rows_or_seeds_refuses_a_folder_whose_other_runs_are_of_an_edited_row(tiny_suite, tmp_path):
    """`--row` and `--seeds` checked only the cells they ran, yet rewrote the folder's suite file from the
    edited suite: a row's finished runs of its old settings were then reported as its new ones."""
    _, reference, _ = tiny_suite
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    rows = [TINY_SUITE["methods"][0], {"name": "FedProx", "overrides": ["method=fedprox", "fl.lr=0.02"]}]
    edited = load_suite(write_suite(tmp_path / "edited.yaml", {**TINY_SUITE, "methods": rows}))
    for call in ({"rows": ["FedAvg + CCVR"]}, {"seeds": [2]}):
        with pytest.raises(ConfigError, match=r"cell 'IF=10, alpha=0.5 / FedProx / seed 0': .* holds a run of another "
                                              r"config \(fl.lr: 0.05 -> 0.02\), and so does 1 more cell's folder "
                                              r"\(\S+seed1\); delete them"):
            run_suite(edited, out, dry_run=True, echo=lambda line: None, **call)
    kept = load_suite(write_suite(tmp_path / "kept.yaml", TINY_SUITE))  # unedited: the same calls pass
    assert [c.state for c in run_suite(kept, out, dry_run=True, seeds=[2], echo=lambda line: None).cells] == ["new"] * 2


def test_a_cell_whose_config_file_is_empty_is_refused_and_left_out_of_the_report(tiny_suite, tmp_path):
    """An empty config.yaml matched any settings: the bench kept the cell as finished."""
    path, reference, _ = tiny_suite
    out = tmp_path / "out"
    shutil.copytree(reference, out)
    emptied = cell_dir(out, "IF=10, alpha=0.5", "FedProx", 0) / "config.yaml"
    emptied.write_text("")
    with pytest.raises(ConfigError, match=rf"{re.escape(str(emptied))} is empty, so what the cell ran is unknown; "
                                          "delete .* to run the cell afresh"):
        run_suite(load_suite(path), out, dry_run=True, echo=lambda line: None)
    assert f"{emptied.parent}: its config.yaml is empty" in write_report(out, with_plots=False).markdown


def test_a_kept_cell_from_before_a_config_key_existed_is_a_cell_of_that_keys_default_only(tiny_suite, tmp_path):
    """A cell whose config predates a key ran what that key's default does: a row that asks for another value
    is another run and is refused, not counted as finished; a row at the default keeps the cell."""
    path, out, _ = tiny_suite
    mine = tmp_path / "out"
    shutil.copytree(out, mine)
    saved = cell_dir(mine, "IF=10, alpha=0.5", "FedProx", 0) / "config.yaml"
    tree = yaml.safe_load(saved.read_text())
    del tree["data"]["hflip"]
    saved.write_text(yaml.safe_dump(tree))
    assert {c.state for c in run_suite(load_suite(path), mine, dry_run=True, echo=lambda line: None).cells} == {"done"}
    flipped = load_suite(write_suite(tmp_path / "flipped.yaml", {**TINY_SUITE, "overrides": [
        *TINY_SUITE["overrides"], "data.hflip=false"]}))
    with pytest.raises(ConfigError, match=re.escape(
            f"{saved.parent} holds a run of another config (data.hflip: not recorded (the run predates it, so it ran "
            "the default 'auto') -> False)")):
        run_suite(flipped, mine, dry_run=True, rows=["FedProx"], echo=lambda line: None)


def test_a_bench_that_ignores_sigint_keeps_its_cells_running_through_one_and_still_stops_on_sigterm(tmp_path):
    """A bench started where SIGINT is ignored (`cmd &` in a script) went on after a Ctrl-C to
    its process group, but its workers did not: the cells running were logged FAILED and the queued ones
    went on. The workers now ignore it too; the bench's own stop (on SIGTERM) still stops them at once."""
    import os
    import signal
    import subprocess
    import sys
    import time

    tree = {**TINY_SUITE, "seeds": [0, 1, 2], "methods": [TINY_SUITE["methods"][1]],
            "overrides": [*TINY_SUITE["overrides"], "fl.rounds=400", "eval.every=100", "run.checkpoint_every=1"]}
    path = write_suite(tmp_path / "s.yaml", tree)
    out = tmp_path / "out"
    bench = subprocess.Popen([sys.executable, "-m", "fedlt.cli", "bench", str(path), "--out", str(out), "--workers",
                              "2"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    cells = [cell_dir(out, "IF=10, alpha=0.5", "FedProx", seed) for seed in range(3)]
    deadline = time.monotonic() + 240

    while not all((c / "checkpoint.pt").is_file() for c in cells[:2]):
        assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
        time.sleep(0.2)
    os.killpg(bench.pid, signal.SIGINT)  # Ctrl-C to the whole group: the bench, and its workers
    checkpoint = (cells[0] / "checkpoint.pt").stat().st_mtime_ns
    while (cells[0] / "checkpoint.pt").stat().st_mtime_ns == checkpoint:  # the cell trains on
        assert bench.poll() is None and time.monotonic() < deadline, bench.communicate()
        time.sleep(0.2)
    os.kill(bench.pid, signal.SIGTERM)
    signalled = time.monotonic()
    _, err = bench.communicate(timeout=120)
    assert bench.returncode == 143 and "FAILED" not in err and "Traceback" not in err, err
    assert time.monotonic() - signalled < STOP_GRACE_S / 2  # the workers stopped on the bench's request
    wait_until_group_ends(bench.pid)
    assert not cells[2].exists() and not (out / "failed.json").exists()


def test_new_cells_train_with_the_thread_count_of_the_folders_finished_cells(tmp_path):
    """A thread count changes the floats and rows are paired by seed, so a bench called again with other
    --workers (or one cell resumed in the bench's process) must not give its new cells another count."""
    suite = {**TINY_SUITE, "overrides": [o for o in TINY_SUITE["overrides"] if not o.startswith("run.threads")]
             + ["fl.rounds=1"], "seeds": [0], "methods": [{"name": "FedProx", "overrides": ["method=fedprox"]}]}
    path, out = write_suite(tmp_path / "threads.yaml", suite), tmp_path / "out"
    before = torch.get_num_threads()
    try:
        run_suite(load_suite(path), out, echo=lambda line: None)
        first = cell_dir(out, "IF=10, alpha=0.5", "FedProx", 0) / "summary.json"
        tree = json.loads(first.read_text())
        tree["environment"]["threads"] = 3  # as if the earlier call ran its cells with 3 threads each
        first.write_text(json.dumps(tree))
        lines: list[str] = []
        run_suite(load_suite(path), out, seeds=[0, 1], echo=lines.append)
        assert "[bench tiny] cells run with 3 thread(s) each, as the folder's finished cells did" in "\n".join(lines)
        second = json.loads((cell_dir(out, "IF=10, alpha=0.5", "FedProx", 1) / "summary.json").read_text())
        assert second["environment"]["threads"] == 3
    finally:
        torch.set_num_threads(before)


def test_an_aborted_flower_cell_goes_on_from_its_checkpoint(tmp_path, monkeypatch):
    """A Flower cell stopped after its checkpoint was run again from round 1; its clients kept nothing on their
    nodes, so the next `fedlt bench` resumes it, as `fedlt run --resume` would (Ditto's cell starts again)."""
    pytest.importorskip("flwr")
    from flower_loopback import LoopbackGrid, server_identity

    from fedlt.config import build_config
    from fedlt.engine.flower_app import FlowerSimulation, run_on_grid

    tree = {**TINY_SUITE, "seeds": [0], "overrides": [*TINY_SUITE["overrides"], "engine=flower",
                                                        "run.checkpoint_every=1"],
            "methods": [{"name": "FedProx", "overrides": ["method=fedprox"]},
                        {"name": "Ditto", "overrides": ["method=ditto"]}]}
    path, out = write_suite(tmp_path / "s.yaml", tree), tmp_path / "out"
    cells = run_suite(load_suite(path), out, dry_run=True, echo=lambda line: None).cells
    original = FlowerSimulation.fit_round
    monkeypatch.setattr(FlowerSimulation, "fit_round", lambda self, rnd: (_ for _ in ()).throw(KeyboardInterrupt)
                        if rnd == 2 else original(self, rnd))
    for cell in cells:  # each cell's own config, stopped in round 2 as by Ctrl-C
        cfg = load_config(None, [*cell.overrides, f"run.out_dir={cell.run_dir.parent}", f"run.name={cell.run_dir.name}"])
        with server_identity(), pytest.raises(KeyboardInterrupt):
            run_on_grid(build_config(cfg.dump()), LoopbackGrid(nodes=2), quiet=True)
        assert json.loads((cell.run_dir / "summary.json").read_text())["status"] == "aborted"
    states = {c.method: c.state for c in run_suite(load_suite(path), out, dry_run=True, echo=lambda line: None).cells}
    assert states == {"FedProx": "resume", "Ditto": "new"}
