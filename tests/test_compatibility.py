"""Every combination of valid values runs or is refused up front: methods and calibrations declare
their heads and losses, ``check_config`` refuses a pair that has no meaning with one line.

The property test draws configurations and runs each at the smallest scale. Its fast profile (the
default) runs in CI; the long one is::

    FEDLT_HYPOTHESIS_PROFILE=long .venv/bin/python -m pytest tests/test_compatibility.py -k property

A failure it finds becomes an ``@example`` of :func:`test_property_every_configuration_runs_or_is_refused`.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import fedlt
from fedlt.calibration.calibrators import CALIBRATORS, Calibrator, TauNorm
from fedlt.config import build_config
from fedlt.errors import ConfigError, DataError
from fedlt.losses import LOSSES
from fedlt.methods.base import LINEAR_HEAD, ModelHead
from fedlt.methods.registry import METHODS
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
         participation: float = 1.0, classes_per_client: int = 3) -> dict:
    tree = {
        "seed": 0, "method": method, "calibration": calibration, "loss": {"name": loss},
        "method_args": CHEAP_METHOD_ARGS.get(method, {}),
        "data": {"dataset": "synthetic", "num_clients": 4, "imbalance_factor": 10, "partition": partition,
                 "classes_per_client": classes_per_client},
        "fl": {"rounds": 1, "participation": participation, "local_epochs": 1},
        "run": {"out_dir": str(out), "threads": 1},
    }
    if calibration or METHODS[method].calibration:
        tree["calibration_args"] = CHEAP_CALIBRATION_ARGS
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


def run_or_refusal(tree: dict, out: Path) -> None:
    """The property: a finite accuracy and a complete run folder, or a ConfigError from
    check_config with nothing written. A partition that the drawn data cannot fill (a pathological
    deal covering fewer classes than the long-tail draw kept) is known only once the data are
    drawn: a DataError, still before anything is written."""
    refusal = verdict(tree)
    if refusal is not None:
        with pytest.raises(ConfigError):
            fedlt.run(tree, quiet=True)
        assert nothing_written(out)
        return
    try:
        result = fedlt.run(tree, quiet=True)
    except DataError:
        assert tree["data"]["partition"] == "pathological" and nothing_written(out)
        return
    assert math.isfinite(result.metrics[-1]["acc"])
    assert RUN_FILES <= {p.name for p in result.run_dir.iterdir()}


@settings(settings.get_profile(PROFILE))
@given(method=st.sampled_from(list(METHODS)),
       calibration=st.lists(st.sampled_from(list(CALIBRATORS)), max_size=2, unique=True),
       loss=st.sampled_from([None, None, *LOSSES]),  # None, half the time: a loss the method trains with
       partition=st.sampled_from(["dirichlet", "pathological", "iid"]),
       participation=st.sampled_from([0.5, 1.0]),
       classes_per_client=st.integers(2, 4))
@example(method="fedavg", calibration=[], loss="ce", partition="pathological", participation=0.5,
         classes_per_client=2)
@example(method="gbme", calibration=["ccvr"], loss="bsm", partition="dirichlet", participation=1.0, classes_per_client=3)
@example(method="fedloge", calibration=["taunorm"], loss="ce", partition="dirichlet", participation=1.0, classes_per_client=3)
@example(method="fedetf", calibration=["taunorm"], loss="ce", partition="dirichlet", participation=1.0, classes_per_client=3)
def test_property_every_configuration_runs_or_is_refused(tmp_path_factory, method, calibration, loss, partition,
                                                         participation, classes_per_client):
    out = tmp_path_factory.mktemp("property") / "out"
    loss = usable_loss(method) if loss is None else loss
    run_or_refusal(tiny(out, method, calibration, loss, partition, participation, classes_per_client), out)


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
