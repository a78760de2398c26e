"""The personalized baselines: GM/PM reporting, what stays on the clients, FedBN, Ditto, FedBABU."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fedlt
from fedlt.api import prepare
from fedlt.config import build_config
from fedlt.engine.simulation import Simulation
from fedlt.errors import ConfigError
from fedlt.methods.ditto import DittoArgs, DittoClient
from fedlt.methods.registry import METHODS
from fedlt.models import FedModel
from fedlt.methods.personal import PREFIX, batchnorm_keys
from fedlt.reporting.comparison import comparison_table

FAST = {  # the cheapest settings of each method's knobs
    "fedrod": {}, "fedbabu": {"finetune_epochs": 1}, "fedetf": {"adapt_iterations": 1, "adapt_epochs": 1},
    "fedrep": {"head_epochs": 1}, "fedper": {}, "ditto": {}, "fedbn": {},
}


def tiny(tmp_path, method, name="run", rounds=2, **over) -> dict:
    cfg = {
        "seed": 5, "method": method, "method_args": dict(FAST.get(method, {})),
        "data": {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 4},
        "fl": {"rounds": rounds, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 2},
        "run": {"out_dir": str(tmp_path), "name": name, "checkpoint_every": 0, "threads": 1},
    }
    for key, value in over.items():
        section, _, field = key.partition("__")
        cfg[section] = {**cfg.get(section, {}), field: value} if field else value
    return cfg


def spy_on_messages(monkeypatch) -> list[dict]:
    """Every exchange: kind, client, what went down, what came back, the client's state afterwards."""
    calls = []
    original = Simulation._deliver

    def deliver(self, kind, rnd, messages):
        for cid, msg, reply in original(self, kind, rnd, messages):
            if kind != "evaluate":
                state = {k: v.clone() for k, v in self.client_states.get(cid, {}).items()}
                calls.append({"kind": kind, "cid": cid, "msg": msg, "reply": reply, "state": state})
            yield cid, msg, reply

    monkeypatch.setattr(Simulation, "_deliver", deliver)
    return calls


@pytest.mark.parametrize("method", list(FAST))
def test_every_baseline_reports_gm_and_pm(tmp_path, method, monkeypatch):
    calls = spy_on_messages(monkeypatch)
    res = fedlt.run(tiny(tmp_path, method), quiet=True)
    final = res.summary["final"]
    assert final["pm_acc"] is not None and 0 <= final["pm_acc"] <= 100
    if method == "fedper":
        assert final["acc"] is None and "acc" not in res.metrics[-1]
        assert "| final (headline) | 2 | - | - | - | - |" in (res.run_dir / "report.md").read_text()
        row = comparison_table([("per", res.summary)]).splitlines()[2]
        assert row.startswith("| per | fedper |") and "| - | - | - | - |" in row
    else:
        assert final["acc"] is not None and final["few_acc"] is not None
    # nothing a client keeps as personal is ever sent to the server, by name or by value
    for call in calls:
        personal = {k: v for k, v in call["state"].items() if k.startswith(PREFIX)}
        sent = [v for v in (*call["reply"].weights.values(), *call["reply"].payload.values())
                if isinstance(v, torch.Tensor)]
        shared_by_design = method in ("fedrep", "fedbn")  # uploaded for the GM average only (knob)
        if not shared_by_design:
            assert not any(v.shape == p.shape and torch.equal(v, p) for v in sent for p in personal.values()), method
    kept = {k.split("/")[1] for c in calls for k in c["state"]}
    expected = {"fedrod": {"p_head"}, "fedrep": {"head"}, "fedper": {"head"}, "ditto": {"model"},
                "fedbabu": set(), "fedetf": set(), "fedbn": set()}  # the CNN has no BatchNorm
    assert kept == expected[method]


def test_fedrep_with_strictly_local_heads_has_no_global_model(tmp_path, monkeypatch):
    calls = spy_on_messages(monkeypatch)
    rep = fedlt.run(tiny(tmp_path, "fedrep", "rep", method_args={"head_epochs": 1, "global_head": False}), quiet=True)
    assert rep.summary["final"]["acc"] is None and rep.summary["final"]["pm_acc"] is not None
    assert all(not k.startswith("head.") for c in calls if c["kind"] == "fit" for k in c["reply"].weights)


def small_bn_model(cfg, num_classes, in_channels, image_size) -> FedModel:
    """A seconds-fast model with two BatchNorm layers (the registered ones with BN are ResNets)."""
    encoder = nn.Sequential(nn.Conv2d(in_channels, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                            nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(32, 16), nn.BatchNorm1d(16), nn.ReLU())
    return FedModel(encoder, 16, num_classes)


@pytest.fixture
def fedbn_small(monkeypatch):
    monkeypatch.setattr(METHODS["fedbn"], "make_model", small_bn_model)


def test_fedbn_keeps_batchnorm_on_the_clients(tmp_path, monkeypatch, fedbn_small):
    from fedlt.methods.fedbn import FedBNClient

    calls, starts = spy_on_messages(monkeypatch), {}
    objective_of = FedBNClient.local_objective

    def recording(self, ctx, msg):  # the BatchNorm each local training starts from
        objective = objective_of(self, ctx, msg)
        starts.setdefault(ctx.cid, []).append({k: v.clone() for k, v in objective.start.items()})
        return objective

    monkeypatch.setattr(FedBNClient, "local_objective", recording)
    cfg = tiny(tmp_path, "fedbn", "bn")
    res = fedlt.run(cfg, quiet=True)
    bn = set(batchnorm_keys(small_bn_model(None, 10, 3, 16)))
    assert bn == {f"encoder.{i}.{k}" for i in (1, 6)
                  for k in ("weight", "bias", "running_mean", "running_var", "num_batches_tracked")}
    fits = [c for c in calls if c["kind"] == "fit"]
    for call in fits:
        assert not bn & set(call["msg"].weights)  # the server never sends BatchNorm
        assert {k.removeprefix(PREFIX + "bn/") for k in call["state"]} == bn
    by_client = {}
    for call in fits:
        by_client.setdefault(call["cid"], []).append(call)
    for cid, (first, second) in by_client.items():
        # the first training starts from the model's initial BatchNorm, the second from exactly what the
        # first left on the client (not the server's average, which the fit message never carries)
        kept = {k.removeprefix(PREFIX + "bn/"): v for k, v in first["state"].items()}
        assert starts[cid][0] == {} and starts[cid][1].keys() == kept.keys() == bn
        assert all(torch.equal(starts[cid][1][k], kept[k]) for k in bn)
        key = sorted(k for k in first["state"] if k.endswith("running_mean"))[0]
        assert not torch.equal(first["state"][key], second["state"][key])
    assert res.summary["final"]["acc"] is not None  # global_bn: the averaged BatchNorm makes a GM
    strict = fedlt.run({**cfg, "method_args": {"global_bn": False}, "run": {**cfg["run"], "name": "strict"}},
                       quiet=True)
    assert strict.summary["final"]["acc"] is None and strict.summary["final"]["pm_acc"] is not None
    strict_fits = [c for c in calls if c["kind"] == "fit"][len(fits):]
    assert all(not bn & set(c["reply"].weights) for c in strict_fits)


def test_fedbn_on_a_model_without_batchnorm_is_fedavg_and_keeps_nothing_on_its_clients(tmp_path):
    """On the small CNN FedBN has no BatchNorm to keep: its clients hold no state, it declares none (a Flower
    run of it may resume on new nodes), and every metric equals FedAvg's."""
    from fedlt.methods.registry import parse_method_args
    from fedlt.results import new_run_dir

    runs = {}
    for method in ("fedavg", "fedbn"):
        sim = prepare(build_config(tiny(tmp_path, method, method, eval__every=1)))
        runs[method] = sim.run(new_run_dir(sim.cfg), quiet=True).metrics
        assert sim.client_states == {} and batchnorm_keys(sim.server_model) == []
    spec = METHODS["fedbn"]
    assert not spec.clients_keep_state(parse_method_args(spec, {}), sim.server_model)
    assert spec.clients_keep_state(parse_method_args(spec, {}), small_bn_model(None, 10, 3, 16))
    strip = lambda metrics: [{k: v for k, v in m.items() if k != "time_s"} for m in metrics]  # noqa: E731
    assert strip(runs["fedbn"]) == strip(runs["fedavg"])


def test_fedbn_personalized_model_uses_its_own_batchnorm(tmp_path, fedbn_small):
    """The personalized model of a trained client uses its stored BatchNorm, not the server's."""
    cfg = build_config(tiny(tmp_path, "fedbn", "bn", rounds=1))
    sim = prepare(cfg)
    ctx = sim._context(0, 1)
    sim.client.fit(ctx, sim.server.fit_message(1, 0))
    stored = {k.removeprefix(PREFIX + "bn/"): v for k, v in sim.client_states[0].items()}
    ctx = sim._context(0, 1)
    sim.client.personalize(ctx, sim.server.eval_message(0))
    state = ctx.model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in stored.items())
    # a client that never trained: the GM's averaged BatchNorm (global_bn), or the initial one without it
    server_bn = {k: v for k, v in sim.server.model.state_dict().items() if k in stored}
    with torch.no_grad():
        for k, v in server_bn.items():
            v.fill_(0.5) if v.is_floating_point() else v.fill_(7)
    initial = {k: v.clone() for k, v in sim._context(1, 1).model.state_dict().items() if k in stored}
    for global_bn, expected in ((True, server_bn), (False, initial)):
        sim.server.args = sim.server.args.model_copy(update={"global_bn": global_bn})
        ctx = sim._context(1, 1)
        sim.client.personalize(ctx, sim.server.eval_message(1))
        state = ctx.model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in expected.items()), global_bn


def test_ditto_personal_model_moves_towards_the_global_with_larger_mu(tmp_path):
    sim = prepare(build_config(tiny(tmp_path, "ditto", rounds=1)))
    msg = sim.server.fit_message(1, 0)
    distances = []
    for mu in (0.0, 1.0, 20.0):
        client = DittoClient(DittoArgs(mu=mu))
        ctx = sim._context(0, 1)
        ctx.state = {}
        reply = client.fit(ctx, msg)
        personal = {k.removeprefix(PREFIX + "model/"): v for k, v in ctx.state.items()}
        distances.append(sum(((personal[k] - msg.weights[k]) ** 2).sum().item()
                             for k, _ in sim.worker.named_parameters()))
        if mu == 0.0:
            # mu = 0: the personal model is plain local training, i.e. the same as the global update
            assert all(torch.equal(personal[k], reply.weights[k]) for k in reply.weights)
    assert distances[0] > distances[1] > distances[2] > 0


def test_fedbabu_never_changes_the_head(tmp_path):
    cfg = build_config(tiny(tmp_path, "fedbabu"))
    sim = prepare(cfg)
    head = {k: v.clone() for k, v in sim.server.model.head.state_dict().items()}
    body = sim.server.model.encoder.state_dict()["0.weight"].clone()
    from fedlt.results import new_run_dir

    res = sim.run(new_run_dir(cfg), quiet=True)
    assert all(torch.equal(sim.server.model.head.state_dict()[k], v) for k, v in head.items())
    assert not torch.equal(sim.server.model.encoder.state_dict()["0.weight"], body)
    up = res.summary["messages"]["fit"]["from_client"]
    assert up["model_entries"] == len(sim.server.model.encoder.state_dict())
    assert json.loads((res.run_dir / "summary.json").read_text())["final"]["pm_acc"] is not None


def test_a_calibrated_personalized_method_is_evaluated_on_its_personal_models(tmp_path):
    """Tau-normalisation rescales the global head only: FedRoD's personal models, and so PM, stay
    those of the uncalibrated run while the global model changes."""
    from fedlt.calibration.wrapper import with_calibration

    assert with_calibration(METHODS["fedrod"], ["taunorm"]).client.personalized is True
    assert with_calibration(METHODS["fedavg"], ["taunorm"]).client.personalized is False
    plain = fedlt.run(tiny(tmp_path, "fedrod", "plain", rounds=3), quiet=True)
    calibrated = fedlt.run(tiny(tmp_path, "fedrod", "taunorm", rounds=3, calibration=["taunorm"]), quiet=True)
    assert calibrated.summary["final"]["pm_acc"] == plain.summary["final"]["pm_acc"]
    assert calibrated.summary["final"]["loss"] != plain.summary["final"]["loss"]  # the global head did change
    assert calibrated.summary["final"]["variants"]["uncalibrated"]["loss"] == plain.summary["final"]["loss"]


def test_fine_tuning_at_evaluation_steps_at_the_runs_lr_not_the_decayed_one(tmp_path, monkeypatch):
    """FedBABU's fine-tuning and FedETF's local training before its adaptation step at fl.lr, not at
    the round's scheduled lr (near 0 at the last evaluation under a decaying schedule)."""
    from dataclasses import replace

    import fedlt.methods.fedetf as fedetf

    sim = prepare(build_config(tiny(tmp_path, "fedbabu", rounds=1)))
    msg = sim.server.eval_message(0)
    tuned = []
    for lr, base_lr in ((0.05, None), (1e-6, 0.05), (1e-6, None)):
        ctx = sim._context(0, 1)
        ctx.train = replace(ctx.train, lr=lr, base_lr=base_lr)
        sim.client.personalize(ctx, msg)
        tuned.append(ctx.model.state_dict()["head.weight"].clone())
    assert torch.equal(tuned[0], tuned[1]) and not torch.equal(tuned[0], tuned[2])

    seen = []
    real = fedetf.train_local
    monkeypatch.setattr(fedetf, "train_local", lambda ctx, loss, epochs: seen.append((ctx.train.lr, epochs)) or
                        real(ctx, loss, epochs=epochs))
    for args, epochs in (({}, 1), ({"adapt_local_epochs": 2}, 2), ({"adapt_local_epochs": 0}, None)):
        seen.clear()
        sim = prepare(build_config(tiny(tmp_path, "fedetf", rounds=1, method_args={**FAST["fedetf"], **args})))
        ctx = sim._context(0, 1)
        ctx.train = replace(ctx.train, lr=1e-6, base_lr=0.05)
        sim.client.personalize(ctx, sim.server.eval_message(0))
        assert seen == ([] if epochs is None else [(0.05, epochs)]), args


@pytest.mark.parametrize("method,shared", [("fedrep", True), ("fedloge", True), ("fedbn", False)])
def test_personal_heads_on_one_encoder_are_evaluated_on_its_features_made_once(tmp_path, monkeypatch, method, shared):
    """FedRep's and FedLoGe's personalized models keep the encoder the server sent: the test set goes
    through it once an evaluation, not once per client, and PM is what the whole models give (to
    rounding; no near-tie here). FedBN's encoders are personal (its BatchNorm in a ResNet): every
    client's local test set goes through its own model."""
    from fedlt import evaluation

    over = dict(data__num_clients=5, method_args={"sse_steps": 20} if method == "fedloge" else FAST[method])
    if method == "fedbn":
        over.update(model__name="resnet8", data__image_size=8)
    encoded = []
    real_encode = evaluation.encode
    monkeypatch.setattr(evaluation, "encode", lambda *a: encoded.append(1) or real_encode(*a))
    run = fedlt.run(tiny(tmp_path, method, "shared", **over), quiet=True)
    variants = "variants" in run.metrics[-1]  # FedLoGe's: the global model's features made once for them too
    assert len(encoded) == (1 if shared else 0) + variants  # one evaluation (round 2)
    monkeypatch.setattr(evaluation.SharedEncoderFeatures, "of", lambda self, *a: None)
    whole = fedlt.run(tiny(tmp_path, method, "whole", **over), quiet=True)
    assert run.summary["final"]["pm_acc"] == whole.summary["final"]["pm_acc"]
    assert run.summary["final"]["acc"] == whole.summary["final"]["acc"]


@pytest.mark.parametrize(("overrides", "declared"), [
    (["method=fedper"], True), (["method=fedrep", "method_args.global_head=false"], True),
    (["method=fedbn", "method_args.global_bn=false", "model.name=resnet8"], False),  # known once the model is built
])
def test_a_method_without_a_global_model_refuses_to_measure_nothing(tmp_path, overrides, declared):
    """No global model: eval.personalized=false would leave no accuracy at all. Refused before any file,
    and by fedlt bench's validation (check_config) where the method's settings declare it."""
    from typer.testing import CliRunner

    from fedlt.cli import app
    from fedlt.run_parts import check_config

    base = ["data.dataset=synthetic", "data.image_size=8", "data.num_clients=4", "fl.rounds=1",
            f"run.out_dir={tmp_path / 'runs'}", *overrides]
    message = ("has no global model under these settings, so eval.personalized=false leaves the run nothing to "
               "measure; set eval.personalized=true")
    result = CliRunner().invoke(app, ["run", *base, "eval.personalized=false"])
    assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    if declared:
        with pytest.raises(ConfigError, match=message):
            check_config(fedlt.load_config(None, [*base, "eval.personalized=false"]))
    prepare(fedlt.load_config(None, [*base, "data.val_per_class=2"]))  # a validation set shapes the federation


def test_local_validation_sets_are_drawn_like_local_tests_and_measure_pm_on_validation_data(tmp_path):
    """Each client's local validation set: rows of the balanced validation set in its training
    proportions (the local test draw, on its own stream); ``val_pm_acc`` is the mean over clients of
    accuracy on them, of the global model for a method without personal models (FedAvg)."""
    import numpy as np

    from fedlt.data.local_test import local_test_indices
    from fedlt.evaluation import mean_local_accuracy, predict
    from fedlt.seeding import numpy_rng

    sim = prepare(build_config(tiny(tmp_path, "fedavg", data__val_per_class=20, data__num_clients=5)))
    data = sim.eval_data
    assert data.local_val is not None and len(data.local_val) == 5
    expected = local_test_indices(data.partition.counts, data.val.labels.numpy(), numpy_rng(5, "local_val"))
    assert all(np.array_equal(a, b) for a, b in zip(data.local_val, expected))
    for cid, rows in enumerate(data.local_val):  # every class the client holds, none it does not
        held = set(np.flatnonzero(data.partition.counts[cid]))
        assert rows.size and set(data.val.labels[torch.as_tensor(rows)].tolist()) <= held
    sim.setup()
    metrics = sim.evaluate(0)
    correct, _ = predict(sim.server.global_model(), data.val, sim.cfg.eval.batch_size)  # the engine's batches
    assert metrics["val_pm_acc"] == pytest.approx(mean_local_accuracy([correct[torch.as_tensor(r)] for r in
                                                                        data.local_val]), abs=1e-12)
    assert "val_pm_acc" not in prepare(build_config(tiny(tmp_path, "fedavg"))).evaluate(0)
    assert prepare(build_config(tiny(tmp_path, "fedavg"))).eval_data.local_val is None


def test_fedloges_other_personal_heads_are_evaluated_beside_its_own_as_their_own_runs_give_them(tmp_path):
    """``pm_variants``: each other reading of FedLoGe's personalized model, evaluated in the same run,
    gives the PM (and validation PM) that a run with that reading as its own gives, exactly: they are
    evaluation-time readings of one training."""
    from fedlt.methods.fedloge import PERSONAL_READINGS

    base = dict(data__val_per_class=20, data__num_clients=5, method_args={"sse_steps": 20})
    runs = {"released_realignment": fedlt.run(tiny(tmp_path, "fedloge", "default", **base), quiet=True)}
    for name, reading in PERSONAL_READINGS.items():
        if name not in runs:
            args = {**base["method_args"], **{k: v for k, v in reading.items() if k != "finetune_epochs"}}
            runs[name] = fedlt.run(tiny(tmp_path, "fedloge", name, **{**base, "method_args": args}), quiet=True)
    for name, run in runs.items():
        final = run.summary["final"]
        assert sorted(final["pm_variants"]) == sorted(set(PERSONAL_READINGS) - {name})
        assert final["acc"] == runs["released_realignment"].summary["final"]["acc"]  # one training
        for other, figures in final["pm_variants"].items():
            own = runs[other].summary["final"]
            assert figures == {"pm_acc": own["pm_acc"], "val_pm_acc": own["val_pm_acc"]}
    pms = {run.summary["final"]["pm_acc"] for run in runs.values()}
    assert len(pms) == 3  # three different heads, so the equalities above could fail


def test_a_calibration_keeps_the_methods_other_personal_readings():
    """A calibration changes the global model only: FedLoGe's personalized models, and so its other
    readings of them, are the method's own under it."""
    from fedlt.calibration.wrapper import with_calibration
    from fedlt.methods.registry import get_method, parse_method_args

    spec = get_method("fedloge")
    wrapped = with_calibration(spec, ["taunorm"])
    plain = spec.client(parse_method_args(spec, {})).personal_readings()
    assert sorted(wrapped.client(parse_method_args(wrapped, {})).personal_readings()) == sorted(plain) \
        == ["la_fr", "psi_plus_phi"]
