"""Every combination of valid values runs or is refused up front: methods and calibrations declare
their heads and losses, models the images they take, and ``check_config`` refuses a pair that has
no meaning with one line, before any data are read.

The property test draws configurations (method, calibrations, loss, model, dataset, partition,
participation, local epochs, engine, backend, resume) and runs each at the smallest scale. Its fast profile
(the default) runs in CI; the long one (2,000 draws) is::

    FEDLT_HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/test_compatibility.py -k property -q -p no:cacheprovider

A failure it finds becomes an ``@example`` of :func:`test_property_every_configuration_runs_or_is_refused`.
"""

from __future__ import annotations

import importlib.util
import math
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar
from unittest import mock

import numpy as np
import pytest
import scipy.io
import test_datasets
import torch
from flower_loopback import LoopbackGrid, server_identity
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from test_datasets import rewrite_cifar10, write_cifar10, write_cinic, write_idx

import fedlt
from fedlt.calibration.calibrators import CALIBRATORS, Calibrator, TauNorm
from fedlt.calibration.wrapper import reads_knob
from fedlt.config import build_config
from fedlt.data.registry import DATASETS
from fedlt.engine.simulation import RunResult, Simulation
from fedlt.errors import ConfigError, DataError
from fedlt.losses import LOSSES
from fedlt.methods.base import LINEAR_HEAD, ModelHead
from fedlt.methods.registry import METHODS
from fedlt.models.base import FedModel
from fedlt.models.registry import MODELS, ModelEntry, ModelInput, create_model, input_refusal
from fedlt.models.resnet import IMAGENET_STEM_MIN_SIZE
from fedlt.results import TIMING_KEYS
from fedlt.run_parts import check_config

settings.register_profile("fast", max_examples=30, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
settings.register_profile("long", max_examples=2000, derandomize=True, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
PROFILE = os.environ.get("FEDLT_HYPOTHESIS_PROFILE", "fast")
RUN_FILES = {"summary.json", "metrics.jsonl", "config.yaml", "report.md"}
#: the smallest knobs that keep each method's and calibration's own steps cheap
CHEAP_METHOD_ARGS = {"fedloge": {"sse_steps": 10}, "fedetf": {"adapt_iterations": 1, "adapt_epochs": 1},
                     "fedbabu": {"finetune_epochs": 1}, "fedrep": {"head_epochs": 1}}
CHEAP_CALIBRATION_ARGS = {"creff_features_per_class": 5, "creff_feature_steps": 2, "creff_retrain_steps": 2,
                          "retrain_steps": 2, "ccvr_virtual_per_class": 5, "oracle_per_class": 5, "safs_steps": 1,
                          "safs_finetune_epochs": 1, "safs_rff_dim": 16, "safs_max_per_class": 4,
                          "safs_min_per_class": 2}


def tiny(out: Path, method: str, calibration: list[str], loss: str = "ce", partition: str = "dirichlet",
         participation: float = 1.0, classes_per_client: int = 3, *, model: str = "cnn",
         dataset: str = "synthetic", root: str | None = None, image_size: int | None = None, alpha: float = 0.5,
         num_clients: int = 4, local_epochs: int = 1, engine: str = "inprocess", rounds: int = 1,
         backend: str = "sequential") -> dict:
    tree = {
        "seed": 0, "method": method, "calibration": calibration, "loss": {"name": loss},
        "method_args": CHEAP_METHOD_ARGS.get(method, {}), "model": {"name": model}, "engine": engine,
        "data": {"dataset": dataset, "root": root, "image_size": image_size, "num_clients": num_clients,
                 "imbalance_factor": 10, "partition": partition, "alpha": alpha,
                 "classes_per_client": classes_per_client},
        "fl": {"rounds": rounds, "participation": participation, "local_epochs": local_epochs},
        "run": {"out_dir": str(out), "threads": 1, "backend": backend},
    }
    names = [*METHODS[method].calibration, *calibration]
    if names:  # the cheap knobs of the calibrations that run (another's is refused)
        tree["calibration_args"] = {k: v for k, v in CHEAP_CALIBRATION_ARGS.items() if reads_knob(names, k)}
    return tree


def usable_loss(method: str) -> str:
    losses = METHODS[method].losses
    return losses[0] if losses else "ce"


def verdict(tree: dict) -> str | None:
    """None when check_config accepts ``tree``, else its one-line refusal."""
    try:
        check_config(build_config(tree))
    except ConfigError as err:
        return str(err)
    return None


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_calibration_pair_is_accepted_or_refused_in_one_line(method, tmp_path):
    for name in CALIBRATORS:
        message = verdict(tiny(tmp_path, method, [name], usable_loss(method)))
        if message is not None:
            assert "\n" not in message
            assert f"method {method}" in message and f"calibration {name}" in message, message
            assert "use calibration=<one of" in message, message
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_loss_pair_is_accepted_or_refused_in_one_line(method, tmp_path):
    accepted = []
    for loss in LOSSES:
        message = verdict(tiny(tmp_path, method, [], loss))
        if message is None:
            accepted.append(loss)
        else:
            assert "\n" not in message
            assert f"method {method}" in message and f"loss {loss}" in message, message
    assert accepted, f"method {method} accepts no loss"
    spec = METHODS[method]
    expected = spec.losses if spec.losses is not None else (list(LOSSES) if spec.uses_loss_config else ["ce"])
    assert set(accepted) == set(expected)


@pytest.mark.parametrize(("method", "method_args", "refused"), [
    ("fedetf", {}, True),
    ("fedbabu", {}, True),
    ("fedper", {}, True),
    ("fedrep", {"global_head": False}, True),
    ("fedrep", {}, False),
    ("gbme", {}, True),  # cosine expert heads
    ("gbme", {"expert_head": "linear"}, False),
    ("gbme", {"ensemble": False}, False),
    ("fedloge", {}, False),
])
def test_taunorm_follows_the_declared_head(method, method_args, refused, tmp_path):
    tree = tiny(tmp_path, method, ["taunorm"], usable_loss(method))
    tree["method_args"] = {**tree["method_args"], **method_args}
    message = verdict(tree)
    assert (message is not None) == refused, message
    if refused:
        assert "has no meaning" in message and "taunorm" in message


def test_the_refusal_names_the_pair_and_what_would_work():
    message = verdict(tiny(Path("/nonexistent"), "gbme", ["taunorm"], "bsm"))
    assert message.startswith("method gbme + calibration taunorm has no meaning: ")
    assert "cosine expert heads" in message and "method_args.expert_head=linear" in message
    assert "ccvr" in message.split("use calibration=")[1]
    message = verdict(tiny(Path("/nonexistent"), "gbme", [], "ce"))
    assert message.startswith("method gbme + loss ce: ") and "loss.name=<one of bsm, la, ldam>" in message


class SingleHeadOnly(Calibrator):
    """A calibration from outside the package that cannot act on an ensemble."""

    name: ClassVar[str] = "single_head_only"
    ensembles = False


def test_components_registered_from_outside_are_checked_from_their_declarations(monkeypatch, tmp_path):
    monkeypatch.setitem(CALIBRATORS, SingleHeadOnly.name, SingleHeadOnly)
    assert verdict(tiny(tmp_path, "fedavg", [SingleHeadOnly.name])) is None
    message = verdict(tiny(tmp_path, "gbme", [SingleHeadOnly.name], "bsm"))
    assert "method gbme + calibration single_head_only has no meaning" in message
    assert "works on a single head" in message
    fixed = ModelHead("a fixed head of its own")
    monkeypatch.setitem(METHODS, "outside", METHODS["fedavg"].__class__(
        "outside", "a method from outside", METHODS["fedavg"].server, METHODS["fedavg"].client,
        head=lambda args: fixed))
    assert "a fixed head of its own" in verdict(tiny(tmp_path, "outside", ["taunorm"]))
    assert verdict(tiny(tmp_path, "outside", ["fed3r"])) is None
    assert TauNorm.refusal("outside", LINEAR_HEAD) is None


def test_cli_refuses_a_meaningless_pair_with_one_line_and_writes_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedlt.cli", "run", "method=fedetf", "calibration=taunorm",
                           f"run.out_dir={tmp_path / 'out'}"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("fedlt: error: method fedetf + calibration taunorm has no meaning")
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def nothing_written(out: Path) -> bool:
    return not out.exists() or list(out.iterdir()) == []


# ----------------------------------------------------------------------------- model x dataset


def test_every_model_takes_every_registered_dataset_at_its_own_size():
    """The registries' defaults all fit: a refusal comes only from a size or channel count asked for."""
    for model in MODELS:
        for dataset, info in DATASETS.items():
            assert input_refusal(model, dataset, info) is None, (model, dataset)


@pytest.mark.parametrize(("model", "size", "fix"), [
    ("cnn", 8, None), ("resnet8", 8, None), ("resnet18", 9, None), ("resnet50", 9, None),
    ("cnn", 4, "use data.image_size>=8"),  # no model takes 4 px
    ("resnet32", 7, "use data.image_size>=8"),
    ("resnet18", 8, "use data.image_size>=9 or model.name=<one of cnn, resnet8, resnet32>"),
    ("resnet34", 8, "use data.image_size>=9 or model.name=<one of cnn, resnet8, resnet32>"),
    ("resnet50", 8, "use data.image_size>=9 or model.name=<one of cnn, resnet8, resnet32>"),
])
def test_a_model_is_refused_images_smaller_than_it_declares(model, size, fix):
    message = verdict(tiny(Path("/nonexistent"), "fedavg", [], model=model, image_size=size))
    if fix is None:
        assert message is None
        return
    assert "\n" not in message
    assert message.startswith(f"model {model} + dataset synthetic (3x{size}x{size} images): {model} needs images of "
                              "at least "), message
    assert message.endswith(fix), message


@pytest.fixture
def one_thread():
    """One torch thread, as the runs have (run.threads=1): two oversubscribe a loaded machine's cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("model", list(MODELS))
def test_each_declared_smallest_side_trains_on_a_single_image(model, one_thread):
    """The declaration is what the network needs: one-sample batches (a client holding one image)
    train at the declared side, in train and eval mode, and the side below it is refused."""
    size = MODELS[model].input.min_image_size
    for side in (size, IMAGENET_STEM_MIN_SIZE) if model == "resnet50" else (size,):  # and its ImageNet stem's
        net = MODELS[model].builder(num_classes=3, in_channels=1, image_size=side)
        net(torch.randn(1, 1, side, side)).sum().backward()
        with torch.no_grad():
            assert net.eval()(torch.randn(1, 1, side, side)).shape == (1, 3)
    with pytest.raises(ConfigError, match=f"image_size must be >= {size} for model '{model}'"):
        create_model(model, 3, in_channels=1, image_size=size - 1)


def test_four_stage_resnets_cannot_train_one_image_one_pixel_below_their_declaration(one_thread):
    """Why resnet18/34/50 declare 9 px: at 8 px their last map is 1x1, and a client's single image
    is one value per channel for BatchNorm."""
    net = MODELS["resnet18"].builder(num_classes=3, in_channels=3, image_size=8)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel"):
        net(torch.randn(1, 3, 8, 8))


def test_a_dataset_size_it_does_not_come_in_is_refused_before_reading():
    message = verdict(tiny(Path("/nonexistent"), "fedavg", [], dataset="cifar10", root="/nonexistent",
                           image_size=16))
    assert message == ("cifar10: images are 32x32 and are not resized, but data.image_size=16; drop data.image_size "
                       "or set it to 32")


def three_channel_only(num_classes: int, in_channels: int = 3, image_size: int = 32) -> FedModel:
    """A model from outside the package whose first layer is fixed to RGB (e.g. pretrained weights)."""
    return MODELS["cnn"].builder(num_classes=num_classes, in_channels=3)


def test_a_model_registered_from_outside_is_checked_from_its_own_declaration(monkeypatch, tmp_path):
    monkeypatch.setitem(MODELS, "rgb32", ModelEntry(three_channel_only, "RGB only, 32 px and up",
                                                    ModelInput(min_image_size=32, channels=(3,), why="its weights "
                                                               "were trained at 32 px")))
    assert verdict(tiny(tmp_path, "fedavg", [], model="rgb32", dataset="cifar10", root="/nonexistent")) is None
    message = verdict(tiny(tmp_path, "fedavg", [], model="rgb32", dataset="fmnist", root="/nonexistent"))
    assert message == ("model rgb32 + dataset fmnist (1x28x28 images): rgb32 takes 3-channel images only; use "
                       "model.name=<one of cnn, resnet8, resnet18, resnet32, resnet34, resnet50>")
    message = verdict(tiny(tmp_path, "fedavg", [], model="rgb32"))  # synthetic, 16 px by default
    assert message == ("model rgb32 + dataset synthetic (3x16x16 images): rgb32 needs images of at least 32x32 (its "
                       "weights were trained at 32 px); use data.image_size>=32 or model.name=<one of cnn, resnet8, "
                       "resnet18, resnet32, resnet34, resnet50>")
    assert verdict(tiny(tmp_path, "fedavg", [], model="rgb32", image_size=32)) is None
    monkeypatch.setitem(MODELS, "plain", (three_channel_only, "registered as a plain pair"))
    assert "plain needs images of at least 8x8 (fedlt's smallest image side)" in verdict(
        tiny(tmp_path, "fedavg", [], model="plain", image_size=6))
    with pytest.raises(ConfigError, match="model 'rgb32' takes 3-channel images only, got 1"):
        create_model("rgb32", 10, in_channels=1)
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_a_model_the_images_are_too_small_for_with_one_line_and_writes_nothing(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedlt.cli", "run", "model.name=resnet18", "data.dataset=synthetic",
                           "data.image_size=8", f"run.out_dir={tmp_path / 'out'}"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("fedlt: error: model resnet18 + dataset synthetic (3x8x8 images): resnet18 needs "
                                  "images of at least 9x9")
    assert len(proc.stderr.splitlines()) == 1 and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------- the property

HAS_FLOWER = importlib.util.find_spec("flwr") is not None
FILE_DATASETS = ("cifar10", "fmnist", "svhn", "cinic10")
PER_CLASS, TEST_PER_CLASS = 20, 3  # 20 per class: the long-tail draw (IF=10) keeps 2 of the tail class


@pytest.fixture(scope="session")
def file_data(tmp_path_factory) -> dict[str, str]:
    """data.root of tiny CIFAR-10, Fashion-MNIST, SVHN and CINIC-10 folders in their real on-disk
    formats (test_datasets' writers), every class present, written once per session."""
    root = tmp_path_factory.mktemp("file-datasets")
    labels, test_labels = np.repeat(np.arange(10), PER_CLASS), np.repeat(np.arange(10), TEST_PER_CLASS)
    rng = np.random.default_rng(0)
    with pytest.MonkeyPatch.context() as patch:  # the same pixels whichever of test_datasets' tests ran first
        patch.setattr(test_datasets, "RNG", rng)
        write_cifar10(root / "cifar10")
        rewrite_cifar10(root / "cifar10", list(range(10)) * (PER_CLASS // 5), test_labels.tolist())  # 5 batches
        (root / "fmnist").mkdir()
        for prefix, y in (("train", labels), ("t10k", test_labels)):
            write_idx(root / "fmnist" / f"{prefix}-images-idx3-ubyte", 2051, rng.integers(0, 256, (len(y), 28, 28)),
                      gz=prefix == "train")
            write_idx(root / "fmnist" / f"{prefix}-labels-idx1-ubyte", 2049, y, gz=prefix == "train")
        (root / "svhn").mkdir()  # test_datasets.write_svhn holds five labels: too few for every class
        for split, y in (("train", labels), ("test", test_labels)):
            scipy.io.savemat(root / "svhn" / f"{split}_32x32.mat",
                             {"X": rng.integers(0, 256, (32, 32, 3, len(y)), dtype=np.uint8),
                              "y": np.where(y == 0, 10, y).astype(np.float64)[:, None]})  # 10 is the digit 0
        write_cinic(root / "cinic10", ("train", "test"))  # two images per class: copied up to PER_CLASS
        for folder in (root / "cinic10" / "train").iterdir():
            for path in sorted(folder.iterdir()):
                for copy in range(PER_CLASS // 2 - 1):
                    shutil.copy(path, path.with_name(f"{path.stem}-{copy}{path.suffix}"))
    return {name: str(root / name) for name in FILE_DATASETS}


@dataclass(frozen=True)
class Case:
    """One drawn configuration; the defaults are the smallest synthetic run."""

    method: str = "fedavg"
    calibration: tuple[str, ...] = ()
    loss: str | None = None  # None: a loss the method trains with
    model: str = "cnn"
    dataset: str = "synthetic"
    image_size: int | None = None
    partition: str = "dirichlet"
    alpha: float = 0.5
    classes_per_client: int = 3
    num_clients: int = 4
    participation: float = 1.0
    local_epochs: int = 1
    engine: str = "inprocess"
    backend: str = "sequential"  # of the in-process engine; vectorized is refused to methods it cannot train
    nodes: int = 2  # SuperNodes of the loopback grid (engine=flower)
    resume: bool = False  # cut the run after round 1, resume it, compare with the uninterrupted run

    def tree(self, out: Path, roots: dict[str, str]) -> dict:
        loss = usable_loss(self.method) if self.loss is None else self.loss
        return tiny(out, self.method, list(self.calibration), loss, self.partition, self.participation,
                    self.classes_per_client, model=self.model, dataset=self.dataset, root=roots.get(self.dataset),
                    image_size=self.image_size, alpha=self.alpha, num_clients=self.num_clients,
                    local_epochs=self.local_epochs, engine=self.engine, rounds=2 if self.resume else 1,
                    backend=self.backend)


CHEAP_MODELS = ("cnn", "cnn", "cnn", "cnn", "resnet8", "resnet32", "resnet32")
COSTLY_MODELS = ("resnet18", "resnet34", "resnet50")  # 10-25M parameters: rarely, and only on tiny files


@st.composite
def cases(draw) -> Case:
    costly = draw(st.integers(0, 9)) == 9  # one in ten; shrinking (towards 0) makes a failure cheap
    model = draw(st.sampled_from(COSTLY_MODELS if costly else CHEAP_MODELS))
    dataset = draw(st.sampled_from(["synthetic", "synthetic", "synthetic", *FILE_DATASETS]))
    if dataset == "synthetic":  # 16 px by default; 4 and 8 px are refused to some models, 9 px to none
        sizes = [4, 8] if costly else [None, 8, 8, 9, 12, 4]
    else:  # their own side, or one they do not come in (refused)
        sizes = [None, None, None, None, None, 16]
    engine = draw(st.sampled_from(["inprocess", "inprocess", "inprocess", "flower"] if HAS_FLOWER else ["inprocess"]))
    return Case(
        method=draw(st.sampled_from(list(METHODS))),
        calibration=tuple(draw(st.lists(st.sampled_from(list(CALIBRATORS)), max_size=2, unique=True))),
        loss=draw(st.sampled_from([None, None, *LOSSES])),  # None, half the time: a loss the method trains with
        model=model, dataset=dataset, image_size=draw(st.sampled_from(sizes)),
        partition=draw(st.sampled_from(["dirichlet", "pathological", "iid"])),
        alpha=draw(st.sampled_from([0.1, 0.5, 5.0])),
        classes_per_client=draw(st.integers(2, 4)),
        num_clients=draw(st.sampled_from([3, 4, 6])),
        participation=draw(st.sampled_from([0.5, 1.0])),
        local_epochs=draw(st.sampled_from([1, 2])),
        engine=engine,
        nodes=draw(st.sampled_from([1, 2, 3])) if engine == "flower" else 2,
        resume=engine == "inprocess" and draw(st.integers(0, 5)) == 5,  # resuming is refused under Flower
        # drawn last, so the draws before it are those of the configurations without it
        backend=draw(st.sampled_from(["sequential", "graphed", "graphed", "vectorized"])) if engine == "inprocess"
        else "sequential",
    )


def launch(tree: dict, nodes: int) -> RunResult:
    """``fedlt.run``, or under engine=flower the Flower engine at message level: the ServerApp's
    loop over a grid of ``nodes`` in-process SuperNodes running the real ClientApp."""
    if tree["engine"] != "flower":
        return fedlt.run(tree, quiet=True)
    from fedlt.engine.flower_app import run_on_grid

    with server_identity():
        return run_on_grid(build_config(tree), LoopbackGrid(nodes), quiet=True)


def run_or_refusal(tree: dict, out: Path, nodes: int = 2) -> RunResult | None:
    """The property: a finite accuracy and a complete run folder, or a ConfigError from
    check_config with nothing written. A partition that the drawn data cannot fill (a pathological
    deal covering fewer classes than the long-tail draw kept) is known only once the data are
    drawn: a DataError, still before anything is written. The result, None when refused."""
    refusal = verdict(tree)
    if refusal is not None:
        with pytest.raises(ConfigError):
            launch(tree, nodes)
        assert nothing_written(out)
        return None
    try:
        result = launch(tree, nodes)
    except DataError:
        assert tree["data"]["partition"] == "pathological" and nothing_written(out)
        return None
    last = result.metrics[-1]
    assert math.isfinite(last["acc"] if "acc" in last else last["pm_acc"])  # pm_acc alone: no global model
    assert RUN_FILES <= {p.name for p in result.run_dir.iterdir()}
    return result


def without_timing(final: dict) -> dict:
    return {k: v for k, v in final.items() if k not in TIMING_KEYS}


def resumes_to_the_same_result(tree: dict, out: Path, full: RunResult) -> None:
    """A run cut in round 2 (as the engine tests cut one: an interrupt, so what the crash loses is
    lost) and resumed from its round-1 checkpoint ends where the uninterrupted ``full`` run did."""
    cut = {**tree, "run": {**tree["run"], "out_dir": str(out), "name": "cut", "checkpoint_every": 1}}
    fit_round = Simulation.fit_round

    def crash_in_round_2(self, rnd):
        if rnd == 2:
            raise KeyboardInterrupt
        return fit_round(self, rnd)

    with mock.patch.object(Simulation, "fit_round", crash_in_round_2), pytest.raises(KeyboardInterrupt):
        fedlt.run(cut, quiet=True)
    assert not (out / "cut" / "summary.json").exists()
    resumed = fedlt.resume(out / "cut", quiet=True)
    assert without_timing(resumed.summary["final"]) == without_timing(full.summary["final"])
    assert RUN_FILES <= {p.name for p in resumed.run_dir.iterdir()}


@settings(settings.get_profile(PROFILE))
@given(case=cases())
@example(case=Case(method="fedavg", loss="ce", partition="pathological", participation=0.5, classes_per_client=2))
@example(case=Case(method="gbme", calibration=("ccvr",), loss="bsm"))
@example(case=Case(method="fedloge", calibration=("taunorm",), loss="ce"))
@example(case=Case(method="fedetf", calibration=("taunorm",), loss="ce"))
@example(case=Case(model="resnet18", image_size=8))  # refused: 8 px leaves resnet18 a 1x1 map
@example(case=Case(model="resnet32", dataset="svhn", engine="flower", nodes=3, local_epochs=2))
@example(case=Case(method="fedper", dataset="fmnist", partition="iid", resume=True))
# a client the Dirichlet deal leaves without training samples (client 4 here): its la prior and LDAM margins
@example(case=Case(method="fedavg", loss="la", dataset="cifar10", alpha=0.1, num_clients=6))
@example(case=Case(method="fedavg", loss="ldam", dataset="cifar10", alpha=0.1, num_clients=6))
# SAFS's covariance of fewer resnet32 features than dimensions, indefinite when formed in float32
@example(case=Case(method="sfd", model="resnet32", alpha=0.1, classes_per_client=2, participation=0.5))
# clients trained together, client 4 without data (as above), SCAFFOLD's state over two rounds
@example(case=Case(method="scaffold", backend="graphed", dataset="cifar10", alpha=0.1, num_clients=6, resume=True))
@example(case=Case(method="fedrep", calibration=("ccvr",), backend="graphed", dataset="cifar10", alpha=0.1,
                   num_clients=6))
@example(case=Case(method="gbme", backend="vectorized", loss="bsm"))  # refused: it trains only its own experts
def test_property_every_configuration_runs_or_is_refused(tmp_path_factory, file_data, case):
    out = tmp_path_factory.mktemp("property") / "out"
    tree = case.tree(out, file_data)
    result = run_or_refusal(tree, out, case.nodes)
    if case.resume and result is not None:
        resumes_to_the_same_result(tree, out.parent / "cut", result)


def test_gbme_with_a_model_it_has_no_experts_for_is_refused_up_front(tmp_path):
    assert verdict(tiny(tmp_path, "gbme", [], "bsm", model="resnet50")) is not None


def test_a_pooled_method_under_flower_is_refused_by_check_config(tmp_path):
    assert verdict(tiny(tmp_path, "centralized", [], engine="flower")) is not None


# ----------------------------------------------------------------------------- the Flower engine

#: the pairs that crashed before the declarations and run since (taunorm needs gbme's linear expert heads)
REPAIRED = [("gbme", "bsm", name, {"expert_head": "linear"} if name == "taunorm" else {}) for name in CALIBRATORS]
REPAIRED.append(("fedloge", "ce", "taunorm", {}))


@pytest.mark.skipif(not HAS_FLOWER, reason="needs flwr")
@pytest.mark.parametrize(("method", "loss", "calibration", "method_args"), REPAIRED,
                         ids=[f"{m}+{c}" for m, _, c, _ in REPAIRED])
def test_repaired_pairs_run_on_the_flower_engine_as_in_process(tmp_path, method, loss, calibration, method_args):
    tree = tiny(tmp_path / "flower", method, [calibration], loss, image_size=8, engine="flower")
    tree["method_args"] = {**tree["method_args"], **method_args}
    assert verdict(tree) is None
    remote = run_or_refusal(tree, tmp_path / "flower")
    local = run_or_refusal({**tree, "engine": "inprocess", "run": {**tree["run"], "out_dir": str(tmp_path / "local")}},
                           tmp_path / "local")
    assert remote.summary["engine"] == "flower" and remote.summary["dropped"] == []
    same = ("acc", "loss", "per_class_acc", "pm_acc", "variants")  # loss: most of these tiny runs predict one class
    assert {k: remote.summary["final"][k] for k in same} == {k: local.summary["final"][k] for k in same}


def test_configuration_page_shows_the_matrix_from_the_declarations(monkeypatch):
    from fedlt.docs_config import render

    page = render()
    rows: dict[str, str] = {}
    for line in page.splitlines():  # the calibration table comes first
        if line.startswith("| `"):
            rows.setdefault(line.split(" | ")[0], line)
    assert "## Compatibility" in page
    header = next(line for line in page.splitlines() if line.startswith("| method | creff"))
    fedetf = rows["| `fedetf`"].split(" | ")
    assert fedetf[header.split(" | ").index("taunorm")].startswith("refused: ")
    assert fedetf[header.split(" | ").index("ccvr")] == "runs"
    monkeypatch.setitem(CALIBRATORS, SingleHeadOnly.name, SingleHeadOnly)
    page = render()
    gbme = next(line for line in page.splitlines() if line.startswith("| `gbme` | runs"))
    assert gbme.rstrip(" |").endswith("refused: single_head_only works on a single head, and gbme's model has 3 "
                                      "cosine expert heads (unit-norm class vectors, nothing learned in their norms)")


def test_configuration_page_shows_which_model_takes_which_dataset_from_the_declarations(monkeypatch):
    from fedlt.docs_config import render

    monkeypatch.setitem(MODELS, "rgb32", ModelEntry(three_channel_only, "RGB only, 32 px and up",
                                                    ModelInput(min_image_size=32, channels=(3,))))
    lines = render().splitlines()
    table = lines[lines.index("### Model x dataset"):]

    def cells(line: str) -> list[str]:
        return [cell.strip("| ") for cell in line.split(" | ")]

    header = cells(next(line for line in table if line.startswith("| model | ")))
    rows = {cells(line)[0]: dict(zip(header, cells(line))) for line in table if line.startswith("| `")}
    assert rows["`resnet18`"]["cifar10"] == "runs"
    assert rows["`resnet18`"]["synthetic"] == "runs (data.image_size >= 9)"
    assert rows["`rgb32`"]["fmnist"] == "refused: rgb32 takes 3-channel images only"
    assert rows["`rgb32`"]["svhn"] == "runs" and rows["`rgb32`"]["imagenet_lt"] == "runs (data.image_size >= 32)"
