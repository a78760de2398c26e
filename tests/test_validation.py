"""The validation split (data.val_per_class): balanced, disjoint from the training federation and
the test set, deterministic per seed, evaluated beside the test set; without it the federation is
exactly the one drawn before it existed."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from fedlt import api
from fedlt.config import DataConfig, federation_seed, load_config
from fedlt.data.federated import build_federated_data, build_partition
from fedlt.data.local_test import local_test_indices
from fedlt.data.longtail import longtail_counts, longtail_indices, resolve_class_order
from fedlt.data.registry import load_dataset
from fedlt.errors import DataError
from fedlt.results import new_run_dir
from fedlt.seeding import numpy_rng

N = 20  # validation images per class; the synthetic source has 300 training and 100 test images per class


def data_cfg(**kw) -> DataConfig:
    return DataConfig(**{"dataset": "synthetic", "num_clients": 4, "imbalance_factor": 10,
                         "class_order": "shuffled", **kw})


def image_keys(images: torch.Tensor) -> set[bytes]:
    return {bytes(row.numpy().tobytes()) for row in images}


def same_partition(a, b) -> bool:
    return all(np.array_equal(x, y) for x, y in zip(a.client_indices, b.client_indices)) and np.array_equal(a.counts, b.counts)


def test_without_validation_the_federation_is_drawn_as_before():
    """The pipeline without the validation step, written out: nothing may draw from its streams."""
    cfg = data_cfg()
    got = build_federated_data(cfg, seed=3)
    pair = load_dataset("synthetic", every_class=True)
    seed = federation_seed(cfg, 3)
    rng = numpy_rng(seed, "data")
    order = resolve_class_order("shuffled", 10, numpy_rng(seed, "class_order"))
    keep = longtail_indices(pair.train.labels.numpy(), 10, rng, num_classes=10, class_order=order)
    partition = build_partition(cfg, pair.train.labels.numpy()[keep], rng)
    local = local_test_indices(partition.counts, pair.test.labels.numpy(), numpy_rng(seed, "local_test"))
    assert got.val is None and got.val_source is None
    assert torch.equal(got.train.images, pair.train.images[torch.as_tensor(keep)])
    assert same_partition(got.partition, partition)
    assert all(np.array_equal(a, b) for a, b in zip(got.local_test, local))
    assert torch.equal(got.test.images, pair.test.images)


@pytest.mark.parametrize("source", ["train", "test"])
def test_validation_is_balanced_and_disjoint_from_training_and_test(source):
    data = build_federated_data(data_cfg(val_per_class=N, val_from=source), seed=0)
    assert data.val_source == source
    assert data.val.class_counts().tolist() == [N] * 10
    val = image_keys(data.val.images)
    assert len(val) == 10 * N  # the synthetic images are distinct, so set sizes count images
    assert not val & image_keys(data.train.images)
    assert not val & image_keys(data.test.images)
    assert "200 balanced validation samples (from " + source + ")" in data.describe()


def test_from_train_holds_out_before_the_draw_and_shrinks_every_class():
    data = build_federated_data(data_cfg(val_per_class=N, val_from="train"), seed=0)
    plain = build_federated_data(data_cfg(), seed=0)
    # The head class's size is the smallest class of the source: 300 - N; every target follows it.
    order = np.argsort(-plain.train_counts, kind="stable")
    assert sorted(data.train_counts.tolist(), reverse=True) == longtail_counts(300 - N, 10, 10).tolist()
    assert np.array_equal(np.argsort(-data.train_counts, kind="stable"), order)  # same head-to-tail order
    assert torch.equal(data.test.images, plain.test.images)  # the test set is untouched


def test_from_test_keeps_the_training_federation_exactly():
    data = build_federated_data(data_cfg(val_per_class=N, val_from="test"), seed=0)
    plain = build_federated_data(data_cfg(), seed=0)
    assert torch.equal(data.train.images, plain.train.images) and same_partition(data.partition, plain.partition)
    assert data.test.class_counts().tolist() == [100 - N] * 10
    assert image_keys(data.test.images) | image_keys(data.val.images) == image_keys(plain.test.images)
    for indices in data.local_test:  # local test sets index the remaining test set
        assert indices.size == 0 or indices.max() < len(data.test)


def test_the_draw_is_deterministic_per_federation_seed():
    first = build_federated_data(data_cfg(val_per_class=N), seed=1)
    again = build_federated_data(data_cfg(val_per_class=N), seed=1)
    other = build_federated_data(data_cfg(val_per_class=N), seed=2)
    fixed = build_federated_data(data_cfg(val_per_class=N, seed=1), seed=7)  # data.seed decides, not the run's
    assert torch.equal(first.val.images, again.val.images) and torch.equal(first.val.images, fixed.val.images)
    assert not torch.equal(first.val.images, other.val.images)


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"val_from": "test", "val_per_class": 100},
     "data.val_per_class=100: class 0 has only 100 images in the test split of synthetic, and one must stay there; "
     "use data.val_per_class <= 99 or data.val_from=train"),
    ({"val_from": "train", "val_per_class": 295},
     "data.val_per_class=295 held out of synthetic's training source leaves 5 images in its smallest class, too few "
     "for data.imbalance_factor=10 (the tail would get none); use data.val_per_class <= 290 or data.val_from=test"),
    ({"val_from": "train", "val_per_class": 300},  # the largest N named is one the imbalance factor allows too
     "data.val_per_class=300 held out of synthetic's training source leaves 0 images in its smallest class, too few "
     "for data.imbalance_factor=10 (the tail would get none); use data.val_per_class <= 290 or data.val_from=test"),
    ({"val_from": "dataset", "val_per_class": 5},
     "data.val_from=dataset: synthetic has no validation list of its own; use data.val_from=train or test (or auto)"),
])
def test_a_source_that_cannot_supply_the_split_is_one_clear_error(kw, fragment):
    with pytest.raises(DataError) as err:
        build_federated_data(data_cfg(**kw), seed=0)
    assert str(err.value) == fragment


def write_imagenet_lt(root: Path, per_class: dict[str, int]) -> None:
    """A 3-class ImageNet-LT in its on-disk format: image root + ``path label`` list files."""
    for split, count in per_class.items():
        lines = []
        for label in range(3):
            for i in range(count):
                rel = f"{split}/n{label}/{i}.png"
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                Image.new("RGB", (10, 10), (40 * label + 10, 7 * i % 256, 3 * i % 256)).save(root / rel)
                lines.append(f"{rel} {label}\n")
        (root / f"ImageNet_LT_{split}.txt").write_text("".join(lines))


def test_imagenet_lt_uses_its_own_validation_list(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLT_CACHE", str(tmp_path / "cache"))
    root = tmp_path / "imagenet"
    write_imagenet_lt(root, {"train": 12, "test": 4, "val": 3})
    cfg = DataConfig(dataset="imagenet_lt", root=str(root), image_size=8, imbalance_factor=2, num_clients=2,
                     val_per_class=2)
    data = build_federated_data(cfg, seed=0)
    pair = load_dataset("imagenet_lt", str(root), 8, with_val=True)
    assert data.val_source == "dataset" and data.val.class_counts().tolist() == [2, 2, 2]
    assert image_keys(data.val.images) <= image_keys(pair.val.images)
    assert torch.equal(data.test.images, pair.test.images)  # neither test nor training source is touched
    with pytest.raises(DataError, match=r"class 0 has only 3 images in imagenet_lt's own validation split; use "
                                        r"data.val_per_class <= 3, add images of that class to it, or draw the "
                                        r"validation set from data.val_from=train or test$"):
        build_federated_data(cfg.model_copy(update={"val_per_class": 4}), seed=0)
    (root / "ImageNet_LT_val.txt").unlink()  # the list is missing: the error names the other sources too
    with pytest.raises(DataError, match=r"list file ImageNet_LT_val.txt not found in .*\(or draw the validation set "
                                        r"from data.val_from=train or test\)$"):
        build_federated_data(cfg, seed=0)


def test_inat_defaults_to_the_test_split():
    from fedlt.data.registry import DATASETS
    from fedlt.data.validation import resolve_source

    info = DATASETS["inat"]
    assert resolve_source("auto", "inat", info.val_loader is not None, info.long_tailed) == "test"
    assert resolve_source("auto", "cifar10", False, False) == "train"


def test_a_run_evaluates_the_validation_set_beside_the_test_set(tmp_path):
    cfg = load_config(None, ["data.dataset=synthetic", "data.num_clients=4", "data.imbalance_factor=10",
                             "fl.rounds=2", "fl.participation=1.0", "fl.local_epochs=2", "fl.lr=0.05", "eval.every=1",
                             f"data.val_per_class={N}", "calibration=ccvr", "calibration_args.retrain_steps=5",
                             f"run.out_dir={tmp_path}", "run.name=r"])
    sim = api.prepare(cfg)
    result = sim.run(new_run_dir(cfg), quiet=True)
    rows = [json.loads(line) for line in (tmp_path / "r" / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2] and all("val_acc" in r and "val_few_acc" in r for r in rows)
    final = result.summary["final"]
    assert final["acc"] > 30  # a model that learned: a constant-class predictor would score 10 on both sets
    model, val = sim.server.global_model().eval(), sim.eval_data.val
    with torch.no_grad():  # the validation images counted by hand, not through the engine's evaluation
        hit = model(val.normalize(val.images)).argmax(1) == val.labels
    # one image more or less moves an accuracy by 100 / 200: 1e-4 only absorbs the percentage's float rounding
    assert len(val) == 10 * N and final["val_acc"] == pytest.approx(100 * hit.sum().item() / len(val), abs=1e-4)
    few = torch.isin(val.labels, torch.tensor(sim.groups.classes["few"]))
    assert few.any() and final["val_few_acc"] == pytest.approx(100 * hit[few].sum().item() / few.sum().item(),
                                                               abs=1e-4)
    assert "val_acc" in final["variants"]["uncalibrated"]
    assert "val_acc" not in final["server_metrics"]
    assert result.summary["best_round"]["selected_by"] == "val_acc"
    best = max(rows, key=lambda r: r["val_acc"])
    assert result.summary["best_round"]["round"] == best["round"]
    assert "| final (headline) | 2 |" in (tmp_path / "r" / "report.md").read_text()
    assert "val acc" in (tmp_path / "r" / "report.md").read_text()


def test_the_best_round_is_chosen_on_validation_accuracy_not_on_test_accuracy():
    from fedlt.results import summarize

    cfg = load_config(None, ["data.dataset=synthetic", "fl.rounds=3", f"data.val_per_class={N}"])
    comm = {"down_model": 0, "down_payload": 0, "up_model": 0, "up_payload": 0}
    rows = [{"round": 1, "acc": 60.0, "val_acc": 50.0, "comm": comm}, {"round": 2, "acc": 50.0, "val_acc": 70.0,
            "comm": comm}, {"round": 3, "acc": 55.0, "val_acc": 60.0, "comm": comm}]
    summary = summarize(cfg, rows, {})
    assert (summary["best_round"]["round"], summary["best_round"]["selected_by"]) == (2, "val_acc")
    assert (summary["final"]["round"], summary["final"]["acc"]) == (3, 55.0)
    without_val = summarize(cfg, [{k: v for k, v in r.items() if k != "val_acc"} for r in rows], {})
    assert (without_val["best_round"]["round"], without_val["best_round"]["selected_by"]) == (1, "acc")


def test_the_cli_refuses_an_impossible_split_in_one_line_and_writes_nothing(tmp_path):
    import os
    import subprocess
    import sys

    src = Path(__file__).resolve().parents[1] / "src"
    env = {k: v for k, v in os.environ.items() if k not in ("FEDLT_DATA", "PYTHONPATH")}
    env.update(PYTHONPATH=str(src), FLWR_TELEMETRY_ENABLED="0")
    done = subprocess.run([sys.executable, "-m", "fedlt.cli", "run", "data.dataset=synthetic", "data.val_from=test",
                           "data.val_per_class=150", f"run.out_dir={tmp_path / 'runs'}", "--quiet"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "Traceback" not in done.stderr
    assert "data.val_per_class=150: class 0 has only 100 images in the test split" in done.stderr
    assert not (tmp_path / "runs").exists()
