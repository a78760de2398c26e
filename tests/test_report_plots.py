"""``fedlt report`` figures and ranking, ``fedlt data describe``, the partition record, tracking."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from fedlt.cli import app
from fedlt.reporting import write_report
from fedlt.reporting.collect import Row, Run, Setting
from fedlt.reporting.tables import build_table

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_readable_png(path: Path) -> None:
    import matplotlib.image

    assert path.read_bytes()[:8] == PNG_SIGNATURE, path
    image = matplotlib.image.imread(path)
    h, w = image.shape[:2]
    assert 250 <= h <= 2000 and 400 <= w <= 2500 and image.shape[2] in (3, 4), (path, image.shape)
    assert image[..., :3].std() > 0.05, f"{path} is blank"


def test_suite_report_writes_every_plot_as_a_readable_png(tiny_suite, tmp_path):
    _, out, _ = tiny_suite
    report = write_report(out, tmp_path / "report")
    names = sorted(p.name for p in report.files)
    s = "if-10-alpha-0-5"
    assert names == sorted([f"curves-{s}.png", f"shots-{s}.png", f"per-class-{s}.png", f"partition-{s}.png",
                            f"features-{s}-fedavg-ccvr.png", "tables.md", "tables.csv", "tables.tex"])
    for path in report.files:
        if path.suffix == ".png":
            assert_readable_png(path)


def test_a_report_removes_the_features_plot_of_a_row_that_no_longer_has_runs(tiny_suite, tmp_path):
    """A row renamed or removed leaves no features plot behind; a current row's plot that this report
    cannot redraw, another setting's plots and other files stay."""
    _, out, _ = tiny_suite
    folder = tmp_path / "report"
    folder.mkdir()
    stale = folder / "features-if-10-alpha-0-5-an-old-row.png"
    kept = [folder / "features-if-10-alpha-0-5-fedprox.png", folder / "curves-another-setting.png",
            folder / "features-another-setting-fedprox.png", folder / "my-figure.png", folder / "notes.md"]
    for path in [stale, *kept]:
        path.write_bytes(PNG_SIGNATURE)
    write_report(out, folder, with_plots=False)  # tables only: no plot is touched
    assert stale.exists()
    write_report(out, folder)
    assert not stale.exists() and all(p.exists() for p in kept)
    assert (folder / "features-if-10-alpha-0-5-fedavg-ccvr.png").is_file()


def test_a_damaged_partition_record_stops_the_report_before_it_writes_anything(tiny_suite, tmp_path):
    import shutil

    from fedlt.errors import DataError

    _, out, result = tiny_suite
    run_dir = tmp_path / "run"
    shutil.copytree(next(c.run_dir for c in result.cells if c.method == "FedProx"), run_dir)
    for damage in (b'{"counts": [[1, 2], [3', b"\xff\xfe", b"[1, 2]", b'{"counts": [1, 2]}',
                   b'{"counts": [[1, 2], [3, 4]]}', b'{"counts": [[1]], "dataset": "x", "imbalance_factor": "big"}'):
        (run_dir / "partition.json").write_bytes(damage)
        with pytest.raises(DataError, match=f"^{run_dir / 'partition.json'} is not a partition record"):
            write_report(run_dir, tmp_path / "r")
        assert not (tmp_path / "r").exists()
    assert write_report(run_dir, tmp_path / "r", with_plots=False).files  # the tables need no partition


def test_single_run_directory_report(tiny_suite, tmp_path):
    _, out, result = tiny_suite
    run_dir = next(c.run_dir for c in result.cells if c.method == "FedAvg + CCVR")
    cli = CliRunner().invoke(app, ["report", str(run_dir), "--out", str(tmp_path / "r"), "--no-plots"])
    assert cli.exit_code == 0, cli.stderr
    glance, detailed = cli.stdout.split("Final-round accuracy (%): ")  # the caption opens the detailed tables
    rows = [line.split(" | ")[0] for line in detailed.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows == ["| method", "| ccvr", "| ccvr [uncalibrated]"]
    assert "| ccvr [uncalibrated] | " in glance and "n/a (1 seed)" in glance  # one seed: no interval, no verdict
    summary = json.loads((run_dir / "summary.json").read_text())
    assert f"{summary['final']['acc']:.2f}" in cli.stdout
    bad = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert bad.exit_code == 2 and "neither a run directory" in bad.stderr


def _row(label, accs, ranked=True):
    runs = [Run(Path("."), i, {"final": {"acc": a, "many_acc": None, "medium_acc": None, "few_acc": None,
                                         "pm_acc": None}}) for i, a in enumerate(accs)]
    return Row(label, None, runs, ranked=ranked)


def test_unresolved_orders_get_no_marks_and_upper_bounds_are_never_ranked():
    setting = Setting("s", [_row("a", [50.0, 60.0]), _row("b", [70.0]), _row("c", [55.001, 54.999]),
                            _row("d", [69.999]), _row("oracle", [99.0], ranked=False), _row("e", [10.0])])
    table = build_table(setting)
    assert table.marks == {}  # one-seed rows on top: their order against the others is not resolved
    resolved = Setting("s", [_row("a", [50.0, 51.0, 52.0]), _row("b", [60.0, 62.0, 61.0]),
                             _row("oracle", [99.0, 98.0, 97.0], ranked=False)])
    # b - a = +10 over 3 seeds: b best, a (the reference) second; the oracle is above both but not ranked
    assert build_table(resolved).marks == {(1, "acc"): "best", (0, "acc"): "second"}
    assert [c for c, _ in table.columns] == ["acc", "many_acc", "medium_acc", "few_acc"]  # no PM reported: no column
    a = table.cells[0]["acc"]
    assert a.mean == 55.0 and a.std == pytest.approx(np.std([50, 60], ddof=1)) and a.n == 2
    assert table.cells[1]["acc"].std is None


def test_partition_record_matches_the_federation(tiny_suite):
    from fedlt.config import load_config
    from fedlt.data.federated import build_federated_data

    _, _, result = tiny_suite
    cell = result.cells[0]
    record = json.loads((cell.run_dir / "partition.json").read_text())
    cfg = load_config(cell.run_dir / "config.yaml")
    data = build_federated_data(cfg.data, cfg.seed)
    assert np.array_equal(np.array(record["counts"]), data.partition.counts)
    summary = json.loads((cell.run_dir / "summary.json").read_text())
    assert np.array(record["counts"]).sum(0).tolist() == summary["train_class_counts"]


def test_artifacts_hold_synthetic_and_real_features(tiny_suite):
    import torch

    _, _, result = tiny_suite
    ccvr = next(c for c in result.cells if c.method == "FedAvg + CCVR")
    art = torch.load(ccvr.run_dir / "artifacts.pt", weights_only=True)
    feats, labels = art["ccvr/synthetic_features"], art["ccvr/synthetic_labels"]
    assert feats.shape[1] == art["test_features"].shape[1] == 128 and len(feats) == len(labels)
    assert len(art["test_labels"]) == 10 * 100  # up to 100 test images per class, 10 classes
    fedprox = next(c for c in result.cells if c.method == "FedProx")
    assert not (fedprox.run_dir / "artifacts.pt").exists()  # nothing to save: no file


def test_data_describe_prints_the_partition_and_draws_it(tmp_path):
    args = ["data", "describe", "data.dataset=synthetic", "data.num_clients=5", "data.imbalance_factor=10",
            "--out", str(tmp_path)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.stderr
    text = result.stdout
    assert "synthetic-LT: IF=10, Dirichlet alpha=0.5, 5 clients, seed 0" in text
    clients = text.split("client  samples  classes  largest class (share)\n")[1].strip().splitlines()
    assert len(clients) == 5
    record = json.loads(next(tmp_path.glob("partition-*.json")).read_text())
    counts = np.array(record["counts"])
    assert [int(line.split()[1]) for line in clients] == counts.sum(1).tolist()
    assert [int(line.split()[2]) for line in clients] == (counts > 0).sum(1).tolist()
    assert "many" in text and "medium" in text and "few" in text
    assert_readable_png(next(tmp_path.glob("partition-*.png")))
    grouped = CliRunner().invoke(app, [*args[:-2], "data.num_clients=10", "data.partition=grouped_dirichlet",
                                       "data.alpha=0.3", "--out", str(tmp_path / "grouped")])
    assert "Dirichlet alpha=0.3" in grouped.stdout and grouped.exit_code == 0  # the alpha it was drawn with
    record = json.loads(next((tmp_path / "grouped").glob("partition-*-a0.3-*.json")).read_text())
    assert record["alpha"] == 0.3 and record["partition"] == "grouped_dirichlet"


def test_data_describe_names_the_federation_it_drew(tmp_path):
    """With data.seed set, describe printed and named the partition after the run's seed: data.seed=3 was
    "seed 0" and overwrote seed 0's files; two pathological splits of other classes_per_client, or Dirichlet
    splits of another rounding, shared files."""
    base = ["data", "describe", "data.dataset=synthetic", "data.num_clients=4"]
    texts = {}
    for name, more in {"own": ["seed=3"], "data": ["data.seed=3"], "zero": [],
                       "c3": ["data.partition=pathological", "data.classes_per_client=3"],
                       "c4": ["data.partition=pathological", "data.classes_per_client=4"],
                       "lr": ["data.rounding=largest_remainder"], "val": ["data.val_per_class=5"],
                       "eq": ["data.equal_size=true"], "both": ["data.equal_size=true", "data.val_per_class=5"]}.items():
        result = CliRunner().invoke(app, [*base, *more, "--out", str(tmp_path)])
        assert result.exit_code == 0, result.stderr
        texts[name] = result.stdout
    assert "4 clients, seed 3" in texts["data"] and texts["data"] == texts["own"] != texts["zero"]
    # other settings that change which samples the clients hold: named in the header, and files of their own
    assert texts["both"].startswith("synthetic-LT: IF=100, Dirichlet alpha=0.5, 4 clients, seed 0; "
                                    "data.equal_size=true, data.val_per_class=5\n")
    own = sorted(p.name for p in tmp_path.glob("partition-*-seed0-*.json"))
    assert len(own) == 3 and all(re.fullmatch(r"partition-synthetic-if100-dirichlet-a0.5-k4-seed0-[0-9a-f]{8}.json", n)
                                 for n in own)
    assert len({json.dumps(json.loads((tmp_path / n).read_text())["counts"]) for n in own}) == 3
    names = sorted(p.name for p in tmp_path.glob("partition-*.json") if p.name not in own)
    assert texts["lr"].startswith("synthetic-LT: IF=100, Dirichlet alpha=0.5, largest-remainder rounding, 4 clients")
    assert names == ["partition-synthetic-if100-dirichlet-a0.5-k4-seed0.json",
                     "partition-synthetic-if100-dirichlet-a0.5-k4-seed3.json",
                     "partition-synthetic-if100-dirichlet-a0.5-largest-remainder-k4-seed0.json",
                     "partition-synthetic-if100-pathological-c3-k4-seed0.json",
                     "partition-synthetic-if100-pathological-c4-k4-seed0.json"]
    assert json.loads((tmp_path / names[1]).read_text())["seed"] == 3  # written last by data.seed=3 under seed 0


def test_a_runs_report_and_partition_record_name_the_federations_seed(tmp_path):
    """A run of seed 0 with data.seed=3 trains on the federation of seed 3: its partition.json said seed 0
    and its report named seed 0 alone."""
    import fedlt

    result = fedlt.run(fedlt.load_config(None, ["data.dataset=synthetic", "data.num_clients=3", "data.seed=3",
                                                "fl.rounds=1", "run.threads=1", f"run.out_dir={tmp_path}"]),
                       quiet=True)
    assert json.loads((result.run_dir / "partition.json").read_text())["seed"] == 3
    assert "seed 0 (the federation's: data.seed 3)." in (result.run_dir / "report.md").read_text()


def test_tensorboard_mirrors_the_evaluated_rounds(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    import fedlt

    res = fedlt.run(overrides=["data.dataset=synthetic", "data.num_clients=4", "fl.rounds=2", "fl.local_epochs=1",
                               "eval.every=1", "run.threads=1", "run.tensorboard=true", f"run.out_dir={tmp_path}"],
                    quiet=True)
    events = EventAccumulator(str(res.run_dir / "tensorboard"))
    events.Reload()
    logged = [(e.step, round(e.value, 4)) for e in events.Scalars("acc")]
    assert logged == [(r["round"], round(r["acc"], 4)) for r in res.metrics]
    assert "comm/up_model" in events.Tags()["scalars"]


def test_tensorboard_without_the_package_is_a_config_error(monkeypatch, tmp_path):
    import importlib.util

    import fedlt
    from fedlt.errors import ConfigError

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(ConfigError, match=r"run.tensorboard=true needs the tensorboard package; pip install"):
        fedlt.run(overrides=["data.dataset=synthetic", "run.tensorboard=true", f"run.out_dir={tmp_path}"], quiet=True)
    assert not any(tmp_path.iterdir())  # failed before the run directory existed


def _run_with_metrics(path: Path, seed: int, lines: list[dict]) -> Run:
    path.mkdir(parents=True)
    (path / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return Run(path, seed, {"final": {}})


def test_diagnostics_plot_only_changing_method_numbers(tmp_path):
    from fedlt.reporting import plots

    def lines(tv: list[float]) -> list[dict]:  # engine keys, a constant and a boolean are not diagnostics
        return [{"round": r + 1, "lr": 0.05, "train_loss": 1.0 / (r + 1), "acc": 50.0 + r, "dp_epsilon": 5.0,
                 "converged": r > 1, "prior_tv": v, "prior_l2": v / 2} for r, v in enumerate(tv)]

    yoyo = Row("FedYoYo", None, [_run_with_metrics(tmp_path / f"y{s}", s, lines([0.5 - 0.1 * r - 0.01 * s for r in range(4)]))
                                 for s in range(2)])
    plain = Row("FedAvg", None, [_run_with_metrics(tmp_path / "a0", 0, [{"round": r + 1, "acc": 40.0} for r in range(4)])])
    setting = Setting("IF=100", [plain, yoyo])
    assert plots.diagnostic_keys(setting) == ["prior_l2", "prior_tv"]
    x, mean, std = plots._mean_curve(yoyo, "prior_tv", Run.diagnostics)
    assert list(x) == [1, 2, 3, 4] and mean[0] == pytest.approx(0.495) and std[0] == pytest.approx(np.std([0.5, 0.49], ddof=1))
    assert_readable_png(plots.plot_diagnostics(setting, tmp_path / "d.png"))
    assert plots.plot_diagnostics(Setting("none", [plain]), tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_a_plot_cut_short_by_ctrl_c_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A figure is drawn into ``tmp-NAME.png`` and renamed; Ctrl-C while it was drawn left that cut file."""
    import matplotlib.figure
    import matplotlib.pyplot as plt

    from fedlt.reporting import plots

    def cut(self, path, **kwargs):
        with open(path, "wb") as handle:
            handle.write(PNG_SIGNATURE)  # a part of the image
        raise KeyboardInterrupt

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", cut)
    with pytest.raises(KeyboardInterrupt):
        plots._save(plt.figure(), tmp_path / "curves.png")
    assert list(tmp_path.iterdir()) == []


def test_per_class_accuracy_is_averaged_by_class_size_rank_under_any_class_order(tmp_path):
    from fedlt.reporting.plots import by_class_size, plot_per_class

    def run(seed, counts, acc):
        return Run(tmp_path / f"s{seed}", seed, {"train_class_counts": counts, "final": {"per_class_acc": acc},
                                                 "shot_groups": {"many": [], "medium": [], "few": []}})

    # seed 0: class 0 is the head; seed 1 (shuffled order): class 2 is the head. The head scores 90, the tail 10.
    runs = [run(0, [100, 10, 1], [90.0, 50.0, 10.0]), run(1, [10, 1, 100], [60.0, 20.0, 80.0])]
    sizes, acc = by_class_size(runs)
    assert sizes.tolist() == [1.0, 10.0, 100.0] and acc.tolist() == [15.0, 55.0, 85.0]  # by index: [75, 35, 45]
    assert_readable_png(plot_per_class(Setting("s", [Row("FedAvg", None, runs)]), tmp_path / "per-class.png"))


def test_a_report_of_runs_aborted_before_their_class_counts_were_known_draws_no_per_class_plot(tiny_suite,
                                                                                                tmp_path):
    """A Flower run aborted early has no train_class_counts in its summary: the report stopped with a
    KeyError half-way through its figures."""
    import shutil

    _, out, _ = tiny_suite
    copy = tmp_path / "runs"  # a folder of run directories (a suite's report leaves aborted runs out)
    for i, run in enumerate(sorted(p.parent for p in out.rglob("summary.json") if p.parent.name.startswith("seed"))):
        shutil.copytree(run, copy / f"run{i}")
    for path in copy.rglob("summary.json"):
        summary = json.loads(path.read_text())
        del summary["train_class_counts"]
        path.write_text(json.dumps({**summary, "status": "aborted", "reason": "stopped", "rounds_done": 1}))
    names = {p.name for p in write_report(copy, tmp_path / "report").files}
    setting = "synthetic-lt-if-10-dirichlet-alpha-0-5-4-clients-2-rounds-participation-0-5"
    assert f"per-class-{setting}.png" not in names and f"curves-{setting}.png" in names


def test_partition_plot_orders_its_columns_head_to_tail_when_the_classes_were_shuffled(tmp_path, monkeypatch):
    """Under data.class_order=shuffled class 0 need not be the head: the columns follow the class sizes,
    each named by its class index and federation total."""
    from fedlt.reporting import plots

    drawn = {}
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.setdefault("fig", fig) and path)
    counts = [[1, 9, 0], [2, 30, 4]]  # class totals 3, 39, 4: head class 1, then 2, then 0
    plots.plot_partition({"counts": counts, "dataset": "synthetic", "imbalance_factor": 13, "alpha": 0.5}, tmp_path / "p.png")
    heatmap = drawn["fig"].axes[0]
    assert [t.get_text() for t in heatmap.get_xticklabels()] == ["1\n(39)", "2\n(4)", "0\n(3)"]
    assert np.ma.getdata(heatmap.images[0].get_array()).tolist() == [[9, 0, 1], [30, 4, 2]]


def test_partition_plots_side_bar_keeps_its_share_of_the_width_at_many_classes(tmp_path, monkeypatch):
    """The clients' sizes beside the heatmap had 2.2 parts of the width to the heatmap's one per class: at
    1,000 classes a 2-pixel sliver whose axis labels ran into each other. It keeps the share it has at 10
    classes (2.2 to 10), and the heatmap's axis, which no longer names each class, says it counts them."""
    from fedlt.reporting import plots

    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)
    for classes in (10, 1000):
        counts = np.ones((3, classes), dtype=int).tolist()
        plots.plot_partition({"counts": counts, "dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5},
                             tmp_path / "p.png")
    shares = []
    for fig in drawn:
        heatmap, side = (ax.get_position().width for ax in fig.axes[:2])
        shares.append(side / heatmap)
    assert shares[0] == pytest.approx(0.22, rel=1e-6) and shares[1] == pytest.approx(0.22, rel=1e-6)
    assert drawn[1].axes[0].get_xlabel() == "classes by training samples, head → tail"
    assert drawn[0].axes[0].get_xlabel() == "class index (training samples), head → tail"


def test_partition_plot_names_no_imbalance_factor_a_dataset_long_tailed_as_distributed_did_not_apply(tmp_path,
                                                                                                   monkeypatch):
    """ImageNet-LT's partition plot was titled with data.imbalance_factor (IF=100 by default), which
    its federation never read."""
    from fedlt.reporting import plots

    drawn = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: drawn.append(fig) or path)
    for dataset in ("imagenet_lt", "synthetic"):
        plots.plot_partition({"counts": [[1, 9], [2, 3]], "dataset": dataset, "imbalance_factor": 13, "alpha": 0.5},
                             tmp_path / "p.png")
    titles = [fig.axes[0].get_title(loc="left") for fig in drawn]
    assert titles[0].startswith("Partition: imagenet_lt, as distributed, Dirichlet alpha=0.5, 2 clients")
    assert titles[1].startswith("Partition: synthetic-LT, IF=13, Dirichlet alpha=0.5, 2 clients")


def test_many_classes_and_clients_are_summarised_not_listed_one_per_line(tmp_path, monkeypatch):
    """ImageNet-LT's 1,000 or iNaturalist's 8,142 classes made `fedlt data describe` and a run's
    report.md print one line per class (and a shot group's every class on one line), 500 clients
    one line each: beyond ROWS_EACH they come in size bins, the largest and smallest clients, and
    listings name LISTED_CLASSES and count the rest."""
    from fedlt.config import load_config
    from fedlt.reporting import describe
    from fedlt.results import LISTED_CLASSES, listed, render_report, size_bins

    assert listed([str(i) for i in range(3)]) == "0, 1, 2"
    assert listed([str(i) for i in range(50)]).endswith(f"{LISTED_CLASSES - 1}, ... (50 in all)")
    bins = size_bins([1, 9, 9, 4, 2, 7, 3], bins=3)
    assert bins == [([1, 2, 5], "9..7"), ([3, 6], "4..3"), ([4, 0], "2..1")]
    monkeypatch.setattr(describe, "ROWS_EACH", 4)
    text, _ = describe.describe_data(None, ["data.dataset=synthetic", "data.num_clients=12"], tmp_path)
    assert "class  name" not in text and "10 classes from head to tail in bins" in text
    clients = text.split("client  samples  classes  largest class (share)\n")[1].splitlines()
    assert len(clients) == 11 and "... 2 more clients" in clients[5]
    sizes = [int(line.split()[1]) for line in clients[:5] + clients[6:]]
    assert sizes == sorted(sizes, reverse=True)
    cfg = load_config(None, ["data.dataset=synthetic"])
    per_class = [float(c % 2) * 100 for c in range(150)]
    summary = {"final": {"round": 1, "acc": 50.0, "per_class_acc": per_class}, "best_round": {"round": 1, "acc": 50.0,
               "selected_by": "acc"}, "communication_bytes": {}, "shot_rule": "count",
               "shot_groups": {"many": list(range(150)), "medium": [], "few": []},
               "train_class_counts": [300 - c for c in range(150)], "class_names": [f"c{c}" for c in range(150)]}
    report = render_report(cfg, summary, [])
    assert "many = classes 0, 1, 2" in report and "... (150 in all)" in report and "| c149 |" not in report
    table = report.split("## Per-class accuracy (final round)")[1].split("\n\n")[2].splitlines()
    assert table[2] == "| 1 | 15 | 300..286 | 46.67 | 8 |" and len(table) == 12


def test_per_class_accuracy_of_many_classes_is_drawn_as_size_bins(tmp_path, monkeypatch):
    """At ImageNet-LT's 1,000 classes a point per class (each 0 or 100 on a test image or two) drew a
    comb of vertical lines: beyond ROWS_EACH classes each line has SIZE_BINS points, bins' means."""
    import matplotlib.axes

    from fedlt.reporting.plots import plot_per_class

    counts = [200 - c for c in range(150)]
    run = Run(tmp_path / "s0", 0, {"train_class_counts": counts, "final": {"per_class_acc": [100.0 * (c % 2)
              for c in range(150)]}, "shot_groups": {"many": [], "medium": [], "few": []}})
    drawn = []
    original = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot", lambda self, x, y, *a, **k: drawn.append((list(x), list(y)))
                        or original(self, x, y, *a, **k))
    assert_readable_png(plot_per_class(Setting("s", [Row("FedAvg", None, [run])]), tmp_path / "per-class.png"))
    (x, y), = drawn
    assert len(x) == 10 and x == sorted(x) and x[0] == pytest.approx(np.mean(counts[-15:]))
    assert y[0] == pytest.approx(100 * 8 / 15)  # the 15 smallest classes, 135..149: 8 odd ones at 100
