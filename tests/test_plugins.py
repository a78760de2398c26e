"""Methods and calibrations from other packages (``fedlt.methods`` / ``fedlt.calibrations`` entry
points): the example package in examples/fedlt-example-plugin is found in-process, by
``run.backend=parallel`` workers, by ``fedlt bench --workers 2`` workers, by a Flower ClientApp and
by the SuperNodes of a loopback deployment, and a broken plug-in is one line naming it.

Nothing is pip-installed: a ``.dist-info`` folder in tmp (what pip would write, as far as entry-point
discovery reads it) and the example's source folder go on ``sys.path`` and on ``PYTHONPATH`` for
subprocesses, the way an installed package is on every interpreter's path."""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

import fedlt
from fedlt.calibration.calibrators import CALIBRATORS
from fedlt.cli import app
from fedlt.errors import ConfigError
from fedlt.methods.base import Client, MethodSpec, Server
from fedlt.methods.registry import METHODS
from fedlt.models.registry import MODELS

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "fedlt-example-plugin"
TINY = {"data": {"dataset": "synthetic", "num_clients": 4, "imbalance_factor": 10},
        "fl": {"rounds": 2, "local_epochs": 1, "participation": 1.0}, "eval": {"personalized": False}}


def install(site: Path, name: str, version: str, groups: dict[str, dict[str, str]]) -> None:
    """Write the ``.dist-info`` that ``pip install`` would leave in ``site`` for entry-point discovery."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "entry_points.txt").write_text("".join(
        f"[{group}]\n" + "".join(f"{ep} = {target}\n" for ep, target in eps.items()) + "\n"
        for group, eps in groups.items()))


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A folder standing in for site-packages, on this process's path and its subprocesses';
    the registries look for plug-ins again on their next use, and after the test."""
    site = tmp_path / "site-packages"
    site.mkdir()
    paths = [str(site), str(EXAMPLE / "src")]
    for path in reversed(paths):
        monkeypatch.syspath_prepend(path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(paths + os.environ.get("PYTHONPATH", "").split(os.pathsep)))
    for registry in (METHODS, CALIBRATORS, MODELS):
        registry.forget_plugins()
    yield site
    for registry in (METHODS, CALIBRATORS, MODELS):  # rediscovered lazily, on the restored sys.path
        registry.forget_plugins()


@pytest.fixture
def example(site):
    """The example package 'installed' with the entry points its own pyproject.toml declares."""
    project = tomllib.loads((EXAMPLE / "pyproject.toml").read_text())["project"]
    install(site, project["name"], project["version"], project["entry-points"])
    return project


def run(tmp_path, name: str, **extra) -> dict:
    cfg = {"seed": 1, "method": "clipavg", **TINY, "run": {"out_dir": str(tmp_path), "name": name, "threads": 1}}
    for key, value in extra.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def finite(summary: dict) -> bool:
    acc = summary["final"]["acc"]
    return math.isfinite(acc) and 0 <= acc <= 100


def test_example_plugin_is_listed_with_its_package_and_runs_in_process(example, tmp_path):
    methods = CliRunner().invoke(app, ["methods"])
    assert methods.exit_code == 0
    assert [line for line in methods.output.splitlines() if line.startswith("clipavg ")] == [
        f"clipavg        {METHODS['clipavg'].description} [plug-in: fedlt-example-plugin 0.1.0]"]
    assert "fedavg " in methods.output and "[plug-in" not in methods.output.split("clipavg")[0]
    calibrations = CliRunner().invoke(app, ["calibrations"])
    assert calibrations.exit_code == 0
    assert "equalnorm      equalnorm: learned head's class rows rescaled to their mean norm, bias removed " \
           "(after training) [plug-in: fedlt-example-plugin 0.1.0]" in calibrations.output

    # the plug-in's own server and knob at work: a bound no update reaches gives FedAvg (to float
    # rounding: it averages updates, not weights), one every update exceeds changes the model
    fedavg = fedlt.run(run(tmp_path, "fedavg", method="fedavg"), quiet=True)
    free = fedlt.run(run(tmp_path, "free", method_args={"max_norm": 1e9}), quiet=True)
    assert [m["loss"] for m in free.metrics] == pytest.approx([m["loss"] for m in fedavg.metrics], rel=1e-5)
    assert free.summary["final"]["server_metrics"] == {"clipped_fraction": 0.0}
    result = fedlt.run(run(tmp_path, "clip", method_args={"max_norm": 0.01}, calibration=["equalnorm"]), quiet=True)
    assert finite(result.summary) and result.summary["method_args"] == {"max_norm": 0.01, "server_lr": 1.0}
    assert result.summary["final"]["server_metrics"]["clipped_fraction"] == 1.0
    assert result.summary["final"]["variants"]["uncalibrated"]["loss"] != pytest.approx(fedavg.summary["final"]["loss"])
    # fedlt's source hash does not cover the plug-in's code: the run names it beside the hash
    assert result.summary["environment"]["outside_code"] == {"clipavg": "plug-in fedlt-example-plugin 0.1.0",
                                                            "equalnorm": "plug-in fedlt-example-plugin 0.1.0"}
    assert "outside_code" not in fedavg.summary["environment"]
    # the plug-in's model: listed with its package, trained like a built-in, named beside the hash
    models = CliRunner().invoke(app, ["models"])
    assert "mlp            two-layer perceptron on the flattened image, 256-d feature [plug-in: " \
           "fedlt-example-plugin 0.1.0]" in models.output
    mlp = fedlt.run(run(tmp_path, "mlp", method="fedavg", model={"name": "mlp"}), quiet=True)
    assert finite(mlp.summary) and mlp.summary["environment"]["outside_code"] == {
        "mlp": "plug-in fedlt-example-plugin 0.1.0"}
    # its declarations are checked like a built-in's: the server reads each reply, equalnorm needs a learned head
    with pytest.raises(ConfigError, match="method clipavg's server reads each client's fit reply"):
        fedlt.run(run(tmp_path, "secure", secagg={"enabled": True}), quiet=True)
    with pytest.raises(ConfigError, match="calibration equalnorm has no meaning: equalnorm works on the model's "
                                          "learned linear head, and fedetf's model has a fixed"):
        fedlt.run(run(tmp_path, "etf", method="fedetf", calibration=["equalnorm"]), quiet=True)
    with pytest.raises(ConfigError, match="method clipavg has no knob method_args.mu; its knobs: max_norm, server_lr"):
        fedlt.run(run(tmp_path, "knob", method_args={"mu": 1}), quiet=True)


def test_parallel_backend_workers_find_the_plugin(example, tmp_path):
    """Each worker is a fresh interpreter that rebuilds the method from its name."""
    cfg = run(tmp_path, "parallel", fl={"rounds": 1}, run={"backend": "parallel", "workers": 2, "device": "cpu"})
    result = fedlt.run(cfg, quiet=True)
    assert result.summary["backend"] == "parallel" and finite(result.summary)


def test_bench_workers_find_the_plugin(example, tmp_path):
    suite = {"name": "plugin", "title": "Plug-ins", "description": "the example plug-in's method and calibration",
             "overrides": ["data.dataset=synthetic", "data.num_clients=4", "data.imbalance_factor=10", "fl.rounds=1",
                           "fl.local_epochs=1", "eval.personalized=false", "run.threads=1"],
             "seeds": [0], "settings": [{"name": "IF=10", "overrides": []}],
             "methods": [{"name": "ClipAvg", "overrides": ["method=clipavg"]},
                         {"name": "FedAvg + equalnorm", "overrides": ["method=fedavg", "calibration=equalnorm"]}]}
    path = tmp_path / "plugin.yaml"
    path.write_text(yaml.safe_dump(suite, sort_keys=False))
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["bench", str(path), "--out", str(out), "--workers", "2", "--no-report"])
    assert result.exit_code == 0, result.output
    summaries = [json.loads(p.read_text()) for p in sorted(out.rglob("summary.json"))]
    assert sorted(s["method"] for s in summaries) == ["clipavg", "fedavg"]
    assert all(finite(s) for s in summaries)
    # a later version of the plug-in is other code: the bench refuses to add seeds to its row
    clip = next(p.parent for p in out.rglob("summary.json") if json.loads(p.read_text())["method"] == "clipavg")
    summary = json.loads((clip / "summary.json").read_text())
    summary["environment"]["outside_code"]["clipavg"] = "plug-in fedlt-example-plugin 0.0.9"
    (clip / "summary.json").write_text(json.dumps(summary))
    again = CliRunner().invoke(app, ["bench", str(path), "--out", str(out), "--seeds", "0,1", "--no-report"])
    assert again.exit_code == 2 and "row 'ClipAvg' (IF=10)" in again.output, again.output
    assert "+ clipavg: plug-in fedlt-example-plugin 0.0.9: seed 0" in again.output


def test_flower_clientapp_finds_the_plugin(example, tmp_path, monkeypatch):
    """The real ClientApp handler rebuilds the method by name on the SuperNode's side."""
    pytest.importorskip("flwr")
    monkeypatch.setenv("FLWR_TELEMETRY_ENABLED", "0")
    from flower_loopback import LoopbackGrid, server_identity

    from fedlt.config import build_config
    from fedlt.engine import flower_app

    monkeypatch.setattr(flower_app, "_runtime", {})  # no client runtime left from another test
    with server_identity():
        result = flower_app.run_on_grid(build_config(run(tmp_path, "flower", engine="flower")), LoopbackGrid(nodes=2),
                                        quiet=True)
    assert finite(result.summary) and result.summary["final"]["server_metrics"]["clipped_fraction"] >= 0
    # the ClientApp built its client from the plug-in's spec: it parsed clipavg's own knobs
    assert [type(runtime.client.args).__name__ for runtime in flower_app._runtime.values()] == ["ClipAvgArgs"]


def test_a_loopback_deployment_runs_the_plugin(example, tmp_path):
    """``python -m fedlt.deploy``: a real SuperLink and two SuperNode processes on 127.0.0.1, each
    of which finds the plug-in through the installed entry points and rebuilds it by name."""
    import subprocess
    import sys

    config = tmp_path / "plugin.yaml"
    config.write_text(yaml.safe_dump(run(tmp_path, "deployed", engine="flower")))
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ["PYTHONPATH"]])}
    proc = subprocess.run([sys.executable, "-m", "fedlt.deploy", "--nodes", "2", "--workdir", str(tmp_path / "work"),
                           "--timeout", "240", str(config)], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "deployed" / "summary.json").read_text())
    assert summary["method"] == "clipavg" and summary["engine"] == "flower" and finite(summary)
    assert summary["final"]["server_metrics"]["clipped_fraction"] >= 0  # the plug-in's server ran its own step
    from flower_loopback import deployment_pids
    assert deployment_pids(tmp_path / "work") == []  # the deploy stopped every process it started


BROKEN = {  # entry points of a distribution 'fedlt-broken' -> what the one line must say
    "built-in name": ("fedlt.methods", {"fedavg": "fedlt_example_plugin.clipavg:SPEC"},
                      "plug-in method 'fedavg' (entry point fedavg = fedlt_example_plugin.clipavg:SPEC in fedlt-broken "
                      "1.0) has the name of fedlt's built-in method 'fedavg'; rename the entry point under "
                      '[project.entry-points."fedlt.methods"] or pip uninstall fedlt-broken'),
    "two plug-ins": ("fedlt.calibrations", {"equalnorm": "fedlt_example_plugin.equalnorm:EqualNorm"},
                     "plug-in calibration 'equalnorm' (entry point equalnorm = fedlt_example_plugin.equalnorm:EqualNorm "
                     "in fedlt-example-plugin 0.1.0) has the name of the one in fedlt-broken 1.0; rename one entry "
                     'point under [project.entry-points."fedlt.calibrations"] or pip uninstall fedlt-example-plugin'),
    "import fails": ("fedlt.methods", {"ghost": "fedlt_no_such_module:SPEC"},
                     "plug-in method 'ghost' (entry point ghost = fedlt_no_such_module:SPEC in fedlt-broken 1.0) failed "
                     "to load (ModuleNotFoundError: No module named 'fedlt_no_such_module'); fix its module or pip "
                     "uninstall fedlt-broken"),
    "not a spec": ("fedlt.methods", {"doc": "fedlt_example_plugin:__doc__"},
                   "plug-in method 'doc' (entry point doc = fedlt_example_plugin:__doc__ in fedlt-broken 1.0) loads an "
                   "object of type str, not a MethodSpec or a callable returning one; point the entry point at the "
                   "method's MethodSpec"),
    "other name": ("fedlt.methods", {"clip": "fedlt_example_plugin.clipavg:SPEC"},
                   "plug-in method 'clip' (entry point clip = fedlt_example_plugin.clipavg:SPEC in fedlt-broken 1.0) "
                   "loads the method named 'clipavg'; name the entry point 'clipavg'"),
    "not a calibrator": ("fedlt.calibrations", {"clip": "fedlt_example_plugin.clipavg:ClipAvgServer"},
                         "plug-in calibration 'clip' (entry point clip = fedlt_example_plugin.clipavg:ClipAvgServer in "
                         "fedlt-broken 1.0) loads the class ClipAvgServer, not a subclass of "
                         "fedlt.calibration.calibrators.Calibrator; point the entry point at the calibration's class"),
}


def test_a_broken_model_plugin_is_one_line_in_the_models_listing(site, example):
    """`fedlt models` was the one listing that printed a traceback for a broken plug-in."""
    install(site, "fedlt-broken", "1.0", {"fedlt.models": {"cnn": "fedlt_example_plugin.mlp:ENTRY"}})
    result = CliRunner().invoke(app, ["models"])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.output
    assert result.stderr.startswith("fedlt: error: plug-in model 'cnn' (entry point cnn = fedlt_example_plugin.mlp:"
                                    "ENTRY in fedlt-broken 1.0) has the name of fedlt's built-in model 'cnn'")


def test_a_plugin_calibration_needing_an_unknown_statistic_is_refused_when_it_loads():
    """A misspelt ``needs`` ran with empty statistics, after a query that sent every client the model."""
    from fedlt.calibration.calibrators import STAT_KINDS, Calibrator, calibrator_from_plugin

    typo = type("Typo", (Calibrator,), {"name": "typo", "needs": frozenset({"class_sum"})})
    with pytest.raises(ValueError, match=rf"^loads Typo, whose needs name no statistic: class_sum; use "
                                         rf"{', '.join(STAT_KINDS)}$"):
        calibrator_from_plugin("typo", typo)
    assert calibrator_from_plugin("fine", type("Fine", (Calibrator,), {"name": "fine", "needs": frozenset(
        {"class_sums"})})).name == "fine"


@pytest.mark.parametrize("case", list(BROKEN))
def test_a_broken_plugin_is_one_line_naming_it_and_the_fix(site, example, case):
    group, eps, message = BROKEN[case]
    install(site, "fedlt-broken", "1.0", {group: eps})
    command, registry, builtin = ("methods", METHODS, "fedavg") if group == "fedlt.methods" else \
        ("calibrations", CALIBRATORS, "ccvr")
    for _ in range(2):  # not remembered as discovered: every use says it again
        result = CliRunner().invoke(app, [command])
        assert result.exit_code == 2 and result.stderr.splitlines() == [f"fedlt: error: {message}"], result.output
    with pytest.raises(ConfigError) as err:
        registry[builtin]  # any use, e.g. a run checking its method
    assert str(err.value) == message
    # nothing half-registered, the example's good entry included
    assert set(registry._entries) == set(registry._builtins)


def test_a_plugin_never_replaces_a_name_registered_in_code(example):
    METHODS["clipavg"] = MethodSpec("clipavg", "registered in code", Server, Client)  # before discovery
    try:
        with pytest.raises(ConfigError, match=r"^plug-in method 'clipavg' \(.* in fedlt-example-plugin 0.1.0\) has "
                                              "the name of the one registered in code as method 'clipavg'"):
            METHODS["fedavg"]
    finally:
        del METHODS["clipavg"]


def test_a_method_or_calibration_registered_in_code_is_refused_where_other_processes_rebuild_it(example, tmp_path):
    """A method registered in a script reached the workers of run.backend=parallel and Flower's nodes
    by name only: the run failed in round 1 with "unknown method", its folder half-written, or ran the
    built-in a script had replaced. Refused before anything starts; the entry point's own method runs."""
    from fedlt.calibration.calibrators import Calibrator
    from fedlt.run_parts import check_config

    cfg = lambda method, **over: fedlt.load_config(None, [f"method={method}", "data.dataset=synthetic", *(  # noqa: E731
        f"{k}={v}" for k, v in over.items())])
    METHODS["squeeze"] = MethodSpec("squeeze", "registered in code", Server, Client)
    fedavg = METHODS["fedavg"]
    METHODS["fedavg"] = MethodSpec("fedavg", "a script's own fedavg", Server, Client)
    CALIBRATORS["scale"] = type("Scale", (Calibrator,), {})
    try:
        for method in ("squeeze", "fedavg"):
            with pytest.raises(ConfigError, match=rf"^method {method} is registered in this process's code, and the "
                                                  r"worker processes of run.backend=parallel build the run by name"):
                check_config(cfg(method, **{"run.backend": "parallel"}))
            with pytest.raises(ConfigError, match=r"Flower's nodes \(engine=flower\) build the run by name .* "
                                                  "fedlt.methods entry point .*, or use engine=inprocess$"):
                check_config(cfg(method, engine="flower"))
            check_config(cfg(method))  # in this process: it runs
        with pytest.raises(ConfigError, match=r"^calibration scale is registered .* fedlt.calibrations entry point "
                                              r"\(docs/writing-a-method.md\), or use run.backend=sequential$"):
            check_config(cfg("clipavg", **{"run.backend": "parallel", "calibration": "scale"}))
        check_config(cfg("clipavg", **{"run.backend": "parallel"}))  # the plug-in's: found by name anywhere
    finally:
        METHODS["fedavg"] = fedavg
        del METHODS["squeeze"], CALIBRATORS["scale"]
    check_config(cfg("fedavg", **{"run.backend": "parallel"}))


def test_a_bench_with_workers_refuses_a_method_registered_in_code_before_any_cell_trains(tmp_path):
    """The bench's worker processes look a cell's method up by name: a method registered in a script
    failed each of its cells one by one, after the others had trained. Refused before any cell runs;
    one worker (this process) runs it."""
    from conftest import TINY_SUITE, write_suite
    from fedlt.bench.suite import load_suite, run_suite

    suite = {**TINY_SUITE, "methods": [{"name": "Squeeze", "overrides": ["method=squeeze"]}]}
    path = write_suite(tmp_path / "s.yaml", suite)
    fedavg = METHODS["fedavg"]
    METHODS["squeeze"] = MethodSpec("squeeze", "registered in code", fedavg.server, fedavg.client)
    try:
        with pytest.raises(ConfigError, match=r"^suite tiny, cell '.*Squeeze / seed 0': method squeeze is registered "
                                              r"in this process's code, and the bench's worker processes \(--workers N\) "
                                              r"build the run by name .*, or use --workers 1$"):
            run_suite(load_suite(path), tmp_path / "out", workers=2, echo=lambda line: None)
        assert not (tmp_path / "out").exists()
        result = run_suite(load_suite(path), tmp_path / "out", workers=1, echo=lambda line: None)
        assert len(result.ran) == 2 and not result.failed
    finally:
        del METHODS["squeeze"]


def test_a_method_that_breaks_the_hook_contract_is_refused_in_one_line_naming_the_hook(tmp_path):
    """A plug-in's slip used to fail deep in the engine (a dict for a Reply: "'dict' object has no
    attribute 'nbytes'"), rounds later (numpy in ctx.state at the first checkpoint), or not at all (weights
    worth 0 samples, an average returned instead of loaded, misnamed weights: the global model never
    trained and the run reported it). Each is now one line naming the hook and the fix, in round 1."""
    from fedlt.errors import PluginError
    from fedlt.methods.fedavg import FedAvgClient, FedAvgServer

    class Client(FedAvgClient):
        slip = None

        def fit(self, ctx, msg):
            reply = super().fit(ctx, msg)
            if self.slip == "dict":
                return {"weights": reply.weights}
            if self.slip == "no_samples":
                return Reply(weights=reply.weights, metrics=reply.metrics)
            if self.slip == "renamed":
                return Reply({"model." + k: v for k, v in reply.weights.items()}, reply.num_samples)
            if self.slip == "numpy_state":
                ctx.state["prior"] = ctx.data.host_prior()  # fedlt's own helper returns numpy
            if self.slip == "set_state":
                ctx.state["seen"] = {1, 2}  # a checkpoint keeps it, a Flower node's state cannot
            return reply

        def personalize(self, ctx, msg):
            super().personalize(ctx, msg)
            if self.slip == "personal_state":
                ctx.state["cache"] = np.zeros(2)

    class Returns(FedAvgServer):
        def aggregate(self, rnd, replies):
            return weighted_average(replies)

    class TensorMetric(FedAvgServer):
        def metrics(self):
            return {"norm": self.model.head.weight.norm(), "n": np.int64(3), "bad": object()}

    class NumpyState(FedAvgServer):
        def state_dict(self):
            return {**super().state_dict(), "seen": {"rounds": [np.float64(1.0)]}}

    import numpy as np

    from fedlt.messages import Reply
    from fedlt.methods.aggregation import weighted_average

    cases = {
        "dict": (FedAvgServer, r"^SlipClient\.fit returned dict; a client hook returns a fedlt\.messages\.Reply$"),
        "no_samples": (FedAvgServer, r"^SlipClient\.fit replied with weights worth num_samples=0 from a client "
                                     r"holding \d+ samples; the average ignores such replies: set Reply\(num_samples"),
        "renamed": (FedAvgServer, r"^FedAvgServer\.aggregate: the replies' weight 'model\.\S+' and \d+ more name no "
                                  r"entry of the model"),
        "numpy_state": (FedAvgServer, r"^SlipClient\.fit left ctx\.state\['prior'\] \(a numpy\.ndarray\) in "
                                      r"ctx\.state, which a checkpoint or a Flower node cannot keep"),
        "set_state": (FedAvgServer, r"^SlipClient\.fit left ctx\.state\['seen'\] \(a set\) in ctx\.state"),
        "personal_state": (FedAvgServer, r"^SlipClient\.personalize left ctx\.state\['cache'\] \(a numpy\.ndarray"),
        "returns": (Returns, r"^Returns\.aggregate returned dict, which the engine ignores"),
        "metric": (TensorMetric, r"^TensorMetric\.metrics\(\) gave 'bad' as a object, which a metrics line"),
        "server_state": (NumpyState, r"^NumpyState\.state_dict\(\) holds state_dict\(\)\['seen'\]\['rounds'\]\[0\] "
                                     r"\(a numpy\.float64\), which a checkpoint cannot keep"),
    }
    try:
        for slip, (server, message) in cases.items():
            client = type("SlipClient", (Client,), {"slip": slip, "personalized": slip == "personal_state"})
            METHODS["slip"] = MethodSpec("slip", "breaks the contract", server, client)
            with pytest.raises(PluginError, match=message):
                fedlt.run(run(tmp_path, slip, method="slip", run={"checkpoint_every": 10},
                              eval={"personalized": slip == "personal_state"}), quiet=True)
        # the same slips inside a calibration's wrapper name the method's own client, and fail as early
        METHODS["slip"] = MethodSpec("slip", "breaks the contract", FedAvgServer,
                                     type("SlipClient", (Client,), {"slip": "dict"}))
        with pytest.raises(PluginError, match=r"^SlipClient\.fit returned dict; a client hook returns a fedlt\.messages\.Reply$"):
            fedlt.run(run(tmp_path, "wrapped", method="slip", calibration=["ccvr"]), quiet=True)
        # and in the graphed backend's step, which builds the reply itself
        local = type("LocalSlip", (FedAvgClient,), {"local_objective": lambda self, ctx, msg: (
            ctx.state.__setitem__("prior", ctx.data.host_prior()), super(local, self).local_objective(ctx, msg))[1]})
        METHODS["slip"] = MethodSpec("slip", "breaks the contract in its objective", FedAvgServer, local)
        with pytest.raises(PluginError, match=r"^LocalSlip\.local_objective left ctx\.state\['prior'\] \(a numpy"):
            fedlt.run(run(tmp_path, "graphed", method="slip", run={"backend": "graphed"}), quiet=True)
        # what a slip looked like is accepted where it is not one: one-element tensors and numpy numbers
        # from metrics() are read as floats, a client without samples may reply with weights worth 0
        TensorMetric.metrics = lambda self: {"norm": self.model.head.weight.norm(), "n": np.int64(3)}
        METHODS["slip"] = MethodSpec("slip", "reads metrics", TensorMetric, FedAvgClient)
        rows = fedlt.run(run(tmp_path, "metric-ok", method="slip", eval={"every": 1}), quiet=True).metrics
        assert [type(r["norm"]) for r in rows] == [float, float] and rows[0]["n"] == 3
        assert rows[0]["norm"] != rows[1]["norm"]  # the model trained
    finally:
        METHODS.pop("slip", None)


def test_check_client_hook_lets_a_client_without_samples_reply_with_weights_worth_nothing():
    from fedlt.engine.clients import check_client_hook
    from fedlt.errors import PluginError
    from fedlt.messages import Reply

    weights = {"w": __import__("torch").zeros(2)}
    C = type("C", (), {})()  # noqa: N806 - the client, named in the refusals
    check_client_hook(C, "fit", Reply(weights, 0), {"n": 1, "t": weights["w"], "l": [1, (2.0, "x")]}, samples=0)
    check_client_hook(C, "query('stats')", Reply(weights, 0), {}, samples=5)  # a query's reply weighs nothing
    with pytest.raises(PluginError, match=r"^C\.fit replied with weights worth num_samples=0 from a client holding 5"):
        check_client_hook(C, "fit", Reply(weights, 0), {}, samples=5)
    with pytest.raises(PluginError, match=r"^C\.fit left a key of ctx\.state \(a numpy\.int64\) in ctx\.state"):
        check_client_hook(C, "fit", Reply(weights, 3), {__import__("numpy").int64(1): 1}, samples=3)
    loop = [1]
    loop.append({"back": loop})  # a cycle: refused in one line, not a RecursionError
    with pytest.raises(PluginError, match=r"^C\.fit left ctx\.state\['l'\]\[1\]\['back'\] \(a list that contains "
                                          r"itself\) in ctx\.state"):
        check_client_hook(C, "fit", Reply(weights, 3), {"l": loop}, samples=3)
    shared = [1.0]
    check_client_hook(C, "fit", Reply(weights, 3), {"a": shared, "b": [shared, shared]}, samples=3)  # shared, no cycle


def test_a_dataset_added_in_code_is_refused_where_other_processes_load_it(monkeypatch):
    """A dataset added to DATASETS in a script ran sequentially, but the workers of run.backend=parallel
    failed with "unknown dataset", leaving a half-written folder; refused before anything starts. The
    vectorized refusal of a method registered in code no longer suggests the parallel backend it refuses."""
    from fedlt.data.registry import DATASETS
    from fedlt.run_parts import choose_backend, check_config

    monkeypatch.setitem(DATASETS, "mine", DATASETS["synthetic"])
    cfg = lambda *over: fedlt.load_config(None, ["data.dataset=mine", *over])  # noqa: E731
    check_config(cfg())
    with pytest.raises(ConfigError, match=r"^dataset mine is added to DATASETS in this process's code, and the worker "
                                          r"processes of run.backend=parallel load .*; use run.backend=sequential$"):
        check_config(cfg("run.backend=parallel"))
    own_step = type("OwnStep", (Client,), {"fit": lambda self, ctx, msg: None})
    METHODS["squeeze"] = MethodSpec("squeeze", "registered in code", Server, own_step)
    try:
        with pytest.raises(ConfigError, match=r"does not support method squeeze .*; use run\.backend=auto or "
                                              r"sequential$"):
            choose_backend(fedlt.load_config(None, ["method=squeeze", "run.backend=vectorized"]), own_step,
                           __import__("torch").device("cpu"))
    finally:
        del METHODS["squeeze"]


def test_a_calibration_whose_finish_returns_its_head_is_refused_instead_of_reporting_the_uncalibrated_model(tmp_path):
    """finish returning the head it built (instead of storing it in self._head) left the run's headline
    the uncalibrated model under the calibration's name; refused in one line naming the hook."""
    from fedlt.calibration.calibrators import Calibrator, linear_head, weight_and_bias
    from fedlt.errors import PluginError

    class Doubled(Calibrator):
        name = "doubled"
        acts_on = "learned_linear"

        def finish(self, stats, head):
            weight, bias = weight_and_bias(head)
            return linear_head(2 * weight, bias)

    CALIBRATORS["doubled"] = Doubled
    try:
        with pytest.raises(PluginError, match=r"^Doubled\.finish returned Linear, which is ignored: finish sets the "
                                              r"calibrated head \(self\._head\) and returns None$"):
            fedlt.run(run(tmp_path, "doubled", method="fedavg", calibration=["doubled"]), quiet=True)
    finally:
        del CALIBRATORS["doubled"]


def test_a_calibration_without_a_head_or_of_the_wrong_width_is_refused_after_its_finish(tmp_path):
    """A finish that set no head reported the uncalibrated model under the calibration's name; a head of
    C-1 outputs failed deep in evaluation (IndexError: Target 9 is out of bounds)."""
    from fedlt.calibration.calibrators import Calibrator, linear_head, weight_and_bias
    from fedlt.errors import PluginError

    class Forgets(Calibrator):
        name = "forgets"
        acts_on = "learned_linear"

        def finish(self, stats, head):
            pass

    class Narrow(Forgets):
        name = "narrow"

        def finish(self, stats, head):
            weight, bias = weight_and_bias(head)
            self._head = linear_head(weight[:-1], bias[:-1])

    CALIBRATORS["forgets"], CALIBRATORS["narrow"] = Forgets, Narrow
    try:
        with pytest.raises(PluginError, match=r"^Forgets\.finish set no head: it stores the calibrated head in "
                                              r"self\._head"):
            fedlt.run(run(tmp_path, "forgets", method="fedavg", calibration=["forgets"]), quiet=True)
        with pytest.raises(PluginError, match=r"^Narrow's head maps 2 features of width \d+ to \(2, 9\), not "
                                              r"\(2, 10\)"):
            fedlt.run(run(tmp_path, "narrow", method="fedavg", calibration=["narrow"]), quiet=True)
    finally:
        del CALIBRATORS["forgets"], CALIBRATORS["narrow"]


def test_a_server_or_objective_hook_of_the_wrong_type_is_refused_in_one_line(tmp_path):
    """A dict from fit_message, a loss function from local_objective, a repeated client from
    select_clients, a query the client cannot answer and numpy weights in a reply failed deep in the
    engine with a traceback; each is one PluginError naming the hook."""
    import numpy as np

    from fedlt.errors import PluginError
    from fedlt.messages import Query, Reply
    from fedlt.methods.fedavg import FedAvgClient, FedAvgServer
    from fedlt.training.sequential import ObjectiveClient

    class DictMessage(FedAvgServer):
        def fit_message(self, rnd, cid):
            return {"weights": super().fit_message(rnd, cid).weights}

    class Twice(FedAvgServer):
        def select_clients(self, rnd, sampled):
            return [*sampled, *sampled]

    class Asks(FedAvgServer):
        def next_query(self, stage, rnd, clients):
            return Query("stats", {cid: Message() for cid in clients}) if stage == "after_fit" else None

    class LossOnly(ObjectiveClient):
        def local_objective(self, ctx, msg):
            return lambda logits, y: logits.sum()

    class NumpyWeights(FedAvgClient):
        def fit(self, ctx, msg):
            reply = super().fit(ctx, msg)
            return Reply({k: v.numpy() for k, v in reply.weights.items()}, reply.num_samples, metrics=reply.metrics)

    from fedlt.messages import Message

    cases = [
        (DictMessage, FedAvgClient, {}, r"^DictMessage\.fit_message returned dict; it returns a fedlt\.messages\.Message"),
        (DictMessage, FedAvgClient, {"backend": "graphed"}, r"^DictMessage\.fit_message returned dict"),
        (Twice, FedAvgClient, {}, r"^Twice\.select_clients returned \[.*\]: need distinct ids in 0\.\.3$"),
        (Asks, FedAvgClient, {}, r"^FedAvgClient has no query 'stats'; answer it in its query\(\)"),
        (FedAvgServer, LossOnly, {}, r"^LossOnly\.local_objective returned function; it returns a "
                                     r"fedlt\.methods\.base\.LocalObjective"),
        (FedAvgServer, LossOnly, {"backend": "graphed"}, r"^LossOnly\.local_objective returned function"),
        (FedAvgServer, NumpyWeights, {}, r"^NumpyWeights\.fit replied with weight '\S+' as a ndarray; reply tensors"),
    ]
    try:
        for i, (server, client, run_section, message) in enumerate(cases):
            METHODS["slip"] = MethodSpec("slip", "breaks the contract", server, client)
            with pytest.raises(PluginError, match=message):
                fedlt.run(run(tmp_path, f"slip{i}", method="slip", run=run_section), quiet=True)
    finally:
        METHODS.pop("slip", None)


def test_resuming_a_plug_in_run_where_the_plug_in_is_missing_says_to_install_it(tmp_path) -> None:
    import yaml

    from fedlt.config import Config
    from fedlt.errors import ConfigError

    tree = Config().dump()
    tree["method"] = "laavg"
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(tree))
    with pytest.raises(ConfigError, match=re.escape(f"{tmp_path} ran method 'laavg', which no installed method or "
                                                    "plug-in provides; install the plug-in that registers it")):
        fedlt.resume(tmp_path, quiet=True)


def test_a_model_registered_in_code_is_checked_once_and_refused_where_it_cannot_reach(tmp_path):
    """A model from outside fedlt is built once on blank images before its run: an encoder that does not
    flatten is one line naming the model, not a shape error mid-training; registered in code, it does not
    reach the workers of run.backend=parallel, which say so before anything is written."""
    from torch import nn

    from fedlt.models import FedModel
    from fedlt.models.registry import ModelEntry

    def unflat(num_classes, in_channels=3, image_size=32):
        return FedModel(nn.Conv2d(in_channels, 4, 3, padding=1), feature_dim=4, num_classes=num_classes)

    def flat(num_classes, in_channels=3, image_size=32):
        return FedModel(nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, 8)), 8, num_classes)

    MODELS["unflat"], MODELS["flat"] = ModelEntry(unflat, "forgets to flatten"), ModelEntry(flat, "flat")
    try:
        with pytest.raises(ConfigError, match=re.escape("model 'unflat': its encoder maps 2 images to features of "
                                                        "shape (2, 4, 16, 16), not (2, 4) (feature_dim); flatten")):
            fedlt.run(run(tmp_path, "unflat", method="fedavg", model={"name": "unflat"}), quiet=True)
        assert not (tmp_path / "unflat").exists()
        with pytest.raises(ConfigError, match=r"^model flat is registered in this process's code, and the worker "
                                              r"processes of run.backend=parallel build the run by name .* a "
                                              r"fedlt.models entry point"):
            fedlt.run(run(tmp_path, "par", method="fedavg", model={"name": "flat"}, run={"backend": "parallel"}),
                      quiet=True)
        MODELS["narrow"] = (lambda num_classes: flat(num_classes), "builder without the image's shape")
        with pytest.raises(ConfigError, match=r"^model 'narrow': its builder '<lambda>' takes no in_channels, "
                                              r"image_size; a builder takes num_classes, in_channels and image_size"):
            fedlt.run(run(tmp_path, "narrow", method="fedavg", model={"name": "narrow"}), quiet=True)
        ok = fedlt.run(run(tmp_path, "flat", method="fedavg", model={"name": "flat"}), quiet=True)
        assert finite(ok.summary) and ok.summary["environment"]["outside_code"] == {"flat": "registered in code"}
    finally:
        del MODELS["unflat"], MODELS["flat"], MODELS["narrow"]
