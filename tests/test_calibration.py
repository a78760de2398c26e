"""Calibrations wired into the federation: messages, statistics, composition, resume."""

from __future__ import annotations

import math
import re

import pytest
import torch

import fedlt
from fedlt.calibration.math.stats import class_feature_sums, class_moments
from conftest import pooled_client_features, run_capturing_stats, run_until_crash_in_round_3
from fedlt.calibration.calibrators import CALIBRATORS
from fedlt.calibration.wrapper import STATS_QUERY, reads_knob
from fedlt.errors import ConfigError
from fedlt.methods.registry import METHODS
from fedlt.results import TIMING_KEYS

ALL_POST_HOC = ["ccvr", "fedncm", "fed3r", "taunorm", "oracle"]


def tiny(tmp_path, **top) -> dict:
    cfg = {
        "seed": 1,
        "data": {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 6},
        "fl": {"rounds": 4, "participation": 0.5, "local_epochs": 2, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 2},
        "calibration_args": {"creff_feature_steps": 20, "creff_retrain_steps": 60, "retrain_steps": 100},
        "run": {"out_dir": str(tmp_path), "checkpoint_every": 2, "threads": 1},
    }
    cfg.update(top)
    if "calibration_args" not in top:  # the cheap knobs of the calibrations that run (another's is refused)
        method, chosen = cfg.get("method", "fedavg"), cfg.get("calibration", [])
        names = [*METHODS[method].calibration, *([chosen] if isinstance(chosen, str) else chosen)]
        known = [name for name in names if name in CALIBRATORS]  # an unknown name is the test's refusal
        cfg["calibration_args"] = {k: v for k, v in cfg["calibration_args"].items() if reads_knob(known, k)}
    return cfg


def without_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def test_creff_backbone_is_fedavg_and_uploads_only_held_classes(tmp_path):
    fedavg = fedlt.run(tiny(tmp_path / "a", calibration_args={}), quiet=True)
    creff = fedlt.run(tiny(tmp_path / "b", method="creff", calibration=ALL_POST_HOC), quiet=True)
    # the report names the head behind its headline, and CReFF's loss as its own objective
    report = (creff.run_dir / "report.md").read_text()
    assert report.startswith("# creff on synthetic-LT\n") and "GM: global model on the balanced test set (the " \
        "backbone with creff's head; the model before it is the variant 'uncalibrated')." in report
    fedrod = fedlt.run(tiny(tmp_path / "c", method="fedrod", calibration="ccvr", eval={"every": 4}), quiet=True)
    report = (fedrod.run_dir / "report.md").read_text()
    assert report.startswith("# fedrod + ccvr on synthetic-LT\n") and ", loss the method's own, seed 1." in report
    assert fedrod.summary["loss"] == "the method's own" and fedavg.summary["loss"] == "ce"
    # CReFF broadcasts the plain FedAvg model: its uncalibrated variant is FedAvg, to the digit
    for plain, cal in zip(fedavg.metrics, creff.metrics):
        assert cal["variants"]["uncalibrated"]["acc"] == plain["acc"]
        assert cal["variants"]["uncalibrated"]["loss"] == pytest.approx(plain["loss"], abs=0)
    msgs = creff.summary["messages"]
    down = msgs["fit"]["to_client"]["payload"]
    assert down["creff/weight"]["shape"] == [10, 128] and down["creff/bias"]["shape"] == [10]
    up = msgs["fit"]["from_client"]["payload"]
    held = up["creff/classes"]["shape"][0]
    assert set(up) == {"creff/classes", "creff/grads"}
    assert up["creff/grads"]["shape"] == [held, 10, 129]  # C x (d+1) per held class, nothing else
    assert up["creff/grads"]["bytes"] == held * 10 * 129 * 4
    # one statistics query after training, to every client
    stats = msgs[f"query:{STATS_QUERY}"]["from_client"]["payload"]
    assert stats["class_sums/sum_outer"]["shape"] == [10, 128, 128]
    assert creff.metrics[-1]["variants"].keys() == {"uncalibrated", *ALL_POST_HOC}
    assert creff.summary["calibration"] == ["creff", *ALL_POST_HOC]
    report = (creff.run_dir / "report.md").read_text()
    assert "NOT PRIVATE" in report and "creff/grads" in report


def test_post_hoc_statistics_equal_pooled_features(tmp_path):
    """The merged client sums equal the statistics of the pooled training features."""
    from fedlt.api import prepare
    from fedlt.config import build_config

    sim = prepare(build_config(tiny(tmp_path, method="fedavg", calibration=["ccvr"])))
    _, captured = run_capturing_stats(sim, tmp_path / "run")
    z, y = pooled_client_features(sim, 6, 4)
    pooled = class_feature_sums(z, y, 10)
    for key in ("count", "sum", "sum_outer"):
        assert torch.allclose(captured["class_sums"][key], pooled[key], rtol=1e-9, atol=1e-6)
    mean, cov, _ = class_moments(captured["class_sums"])
    z = z.double()
    assert torch.allclose(cov[0], torch.cov(z[y == 0].T), atol=1e-6)


def test_summed_statistics_reach_the_server_as_one_aggregate_summed_as_they_arrive(tmp_path):
    """The statistics query is one the server only sums: the engine sums its replies as they arrive rather
    than hold every client's (classes x d x d each), and hands the server one aggregate reply, as secure
    aggregation does. It equals the clients' replies summed in order to the last bit, and so does the run."""
    from fedlt.api import prepare
    from fedlt.config import build_config
    from fedlt.engine.secure_aggregation import AGGREGATE

    def run(name: str, summed: bool):
        sim = prepare(build_config(tiny(tmp_path / name, method="fedavg", calibration=["ccvr", "fed3r"])))
        if not summed:
            sim.summed_queries = {}
        sent, received = [], {}
        deliver, receive = sim._deliver, sim.server.receive
        sim._deliver = lambda kind, rnd, messages: (
            sent.append(item[2]) or item for item in deliver(kind, rnd, messages)) \
            if kind == f"query:{STATS_QUERY}" else deliver(kind, rnd, messages)
        sim.server.receive = lambda query, replies: (received.update(replies) if query.name == STATS_QUERY
                                                     else None) or receive(query, replies)
        (tmp_path / name).mkdir()
        return sim.run(tmp_path / name, quiet=True), sent, received

    result, sent, received = run("summed", True)
    assert list(received) == [AGGREGATE] and len(sent) == 6
    total = received[AGGREGATE]
    assert total.num_samples == sum(r.num_samples for r in sent) and sorted(total.payload) == sorted(sent[0].payload)
    for key, value in total.payload.items():
        expected = sent[0].payload[key].clone()
        for reply in sent[1:]:
            expected = expected + reply.payload[key]
        assert torch.equal(value, expected), key
    plain, _, every = run("plain", False)
    assert sorted(every) == list(range(6))
    assert without_timing(result.metrics) == without_timing(plain.metrics)
    assert result.summary["final"] == plain.summary["final"]


def test_calibration_composes_with_other_local_objectives(tmp_path):
    local = dict(method="fedprox", method_args={"mu": 0.01}, loss={"name": "la"})
    plain = fedlt.run(tiny(tmp_path / "plain", calibration_args={}, **local), quiet=True)
    res = fedlt.run(tiny(tmp_path, calibration=["fed3r", "taunorm"], **local), quiet=True)
    final = res.summary["final"]
    # the wrapped method trains exactly as it does alone: FedProx's term and LA's prior are kept
    assert final["variants"]["uncalibrated"]["acc"] == plain.summary["final"]["acc"]
    assert final["variants"]["uncalibrated"]["loss"] == pytest.approx(plain.summary["final"]["loss"], abs=0)
    # Fed3R uploads Z^T Z and Z^T Y only, not per-class covariances
    stats = res.summary["messages"][f"query:{STATS_QUERY}"]["from_client"]["payload"]
    assert {k: v["shape"] for k, v in stats.items()} == {"ridge_sums/gram": [128, 128], "ridge_sums/cross": [128, 10]}
    assert final["variants"].keys() == {"uncalibrated", "taunorm"}
    assert res.summary["calibration"] == ["fed3r", "taunorm"]
    assert final["acc"] != final["variants"]["uncalibrated"]["acc"]


def test_calibrated_gbme_trains_the_experts_it_selects(tmp_path):
    """The wrapper keeps GBME's own client selection, and the calibrations act on the ensemble's
    combined head (one linear head over the experts' features side by side)."""
    gbme = dict(method="gbme", loss={"name": "bsm"}, fl={**tiny(tmp_path)["fl"], "rounds": 2},
                method_args={"joint_warmup": 0.0, "expert_head": "linear"})
    plain = fedlt.run(tiny(tmp_path / "plain", calibration_args={}, **gbme), quiet=True)
    res = fedlt.run(tiny(tmp_path / "cal", calibration=["ccvr", "taunorm"], **gbme), quiet=True)
    trained = [{k: v for k, v in m.items() if k.endswith("trainers")} for m in plain.metrics]
    assert trained[0] and trained == [{k: v for k, v in m.items() if k.endswith("trainers")} for m in res.metrics]
    final = res.summary["final"]
    uncalibrated, taunorm = final["variants"]["uncalibrated"], final["variants"]["taunorm"]
    assert (uncalibrated["acc"], uncalibrated["loss"]) == (plain.summary["final"]["acc"], plain.summary["final"]["loss"])
    assert final["variants"].keys() == {"uncalibrated", "taunorm"}
    # each calibration changed the combined head: its test loss moved (accuracy alone may not, at 2 rounds)
    assert len({final["loss"], taunorm["loss"], uncalibrated["loss"]}) == 3
    assert all(math.isfinite(v) for v in (final["loss"], taunorm["loss"], final["acc"], taunorm["acc"]))


def test_taunorm_on_fedloge_rescales_psi(tmp_path):
    """tau-norm acts on FedLoGe's learned head psi: at tau = 1 it is GA-FR (the paper's global model),
    at tau = 0 psi as trained, whichever head the uncalibrated global model uses."""
    cfg = tiny(tmp_path, method="fedloge", calibration=["taunorm"], method_args={"sse_steps": 10},
               calibration_args={"taunorm_tau": 1.0})
    final = fedlt.run(cfg, quiet=True).summary["final"]
    assert final["acc"] == final["variants"]["psi_ga_fr"]["acc"]
    cfg["calibration_args"] = {"taunorm_tau": 0.0}  # psi as trained: the psi_raw variant
    final = fedlt.run(cfg, quiet=True).summary["final"]
    assert final["acc"] == final["variants"]["psi_raw"]["acc"]


def test_calibration_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown calibration 'ccrv'"):
        fedlt.run(tiny(tmp_path, calibration="ccrv"), quiet=True)
    brackets = re.escape('write a list in brackets, quoted for the shell: "calibration=[ccvr,fed3r]"')
    with pytest.raises(ConfigError, match=brackets):
        fedlt.run(tiny(tmp_path, calibration="ccvr,fed3r"), quiet=True)
    with pytest.raises(ConfigError, match="calibration_args.creff_m"):
        fedlt.run(tiny(tmp_path, calibration="creff", calibration_args={"creff_m": 3}), quiet=True)
    with pytest.raises(ConfigError, match="no calibration"):
        fedlt.run(tiny(tmp_path, calibration=[], calibration_args={"fed3r_lambda": 1.0}), quiet=True)
    # a knob no chosen calibration reads would be recorded as if applied
    with pytest.raises(ConfigError, match=re.escape(
            "calibration_args.creff_retrain_steps is read by calibration=creff, which this run does not use (it uses "
            "ccvr); drop it")):
        fedlt.run(tiny(tmp_path, calibration="ccvr", calibration_args={"creff_retrain_steps": 5}), quiet=True)
    with pytest.raises(ConfigError, match=re.escape(
            "calibration_args.retrain_lr is read by calibration=ccvr or oracle, which this run does not use (it uses "
            "fedncm, fed3r); drop it")):
        fedlt.run(tiny(tmp_path, calibration=["fedncm", "fed3r"], calibration_args={"retrain_lr": 0.5}), quiet=True)
    with pytest.raises(ConfigError, match="calibration_args.ccvr_virtual_per_class is read by calibration=ccvr"):
        fedlt.run(tiny(tmp_path, method="sfd", calibration_args={"ccvr_virtual_per_class": 5}), quiet=True)
    assert not any(tmp_path.iterdir())


def test_second_moments_the_machine_cannot_hold_are_refused_before_the_first_round(tmp_path, monkeypatch):
    """CCVR's and SAFS's per-class second moments are classes x d x d float64 a client (ImageNet-LT's 1,000
    classes with a ResNet-50's 2,048-d features: 33.6 GB): a run that cannot hold them would end after its
    last round in an out-of-memory error. The small CNN's 10 x 128 x 128 are 1.3 MB, about 5.2 MB at once."""
    from fedlt.calibration import wrapper

    monkeypatch.setattr(wrapper, "available_memory", lambda: 5_000_000)
    for top, option in (({"calibration": "ccvr"}, "calibration=ccvr"), ({"method": "sfd"}, "method=sfd")):
        with pytest.raises(ConfigError, match=re.escape(
                f"{option} needs per-class second moments of the features (10 classes x 128 x 128 float64: 0.0 GB a "
                "client, about 0.0 GB at once), more than the 0.0 GB of memory available; use a model with narrower "
                "features (`fedlt models` gives each one's width) or a calibration without them (fed3r, fedncm)")):
            fedlt.run(tiny(tmp_path, fl={"rounds": 1}, **top), quiet=True)
    assert not any(tmp_path.iterdir())  # refused before any file
    monkeypatch.setattr(wrapper, "available_memory", lambda: 5_300_000)
    assert fedlt.run(tiny(tmp_path, calibration=["fed3r", "ccvr"], fl={"rounds": 1}), quiet=True).summary["final"]
    monkeypatch.setattr(wrapper, "available_memory", lambda: 1)  # neither needs classes x d x d
    assert fedlt.run(tiny(tmp_path, calibration=["fed3r", "fedncm"], fl={"rounds": 1}), quiet=True).summary["final"]
    # on a GPU a client builds its sums there: one array must fit in what the device has free
    from fedlt.config import build_config

    monkeypatch.setattr(wrapper, "available_memory", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1_000_000, 80_000_000_000))
    cuda, cfg = torch.device("cuda", 1), build_config(tiny(tmp_path, method="sfd"))
    with pytest.raises(ConfigError, match=re.escape("method=sfd needs per-class second moments of the features (10 "
                                                    "classes x 128 x 128 float64: 0.0 GB a client, about 0.0 GB at "
                                                    "once), more than the 0.0 GB free on cuda:1; use a model")):
        wrapper.check_second_moments_fit(cfg, "safs", 10, 128, cuda)
    wrapper.check_second_moments_fit(cfg, "safs", 10, 64, cuda)  # 0.26 MB fits
    wrapper.check_second_moments_fit(cfg, "safs", 10, 128, torch.device("cpu"))  # no device memory to check


def test_features_a_calibration_cannot_hold_are_refused_before_the_first_round(tmp_path, monkeypatch):
    """CCVR's virtual, SAFS's synthetic and the oracle's sampled features are built after the last round:
    ccvr_virtual_per_class=1e12 trained every round and then stopped in an out-of-memory error. The rows are
    classes x the knob (SAFS: its rarest class's bank), float32, two copies: 10 x 1000 x 128 x 4 x 2 = 10.24 MB
    (more than the 5.2 MB of the second moments, which fit here)."""
    from fedlt.calibration import wrapper

    monkeypatch.setattr(wrapper, "available_memory", lambda: 10_239_999)
    cases = [({"calibration": "ccvr"}, "calibration=ccvr", "ccvr_virtual_per_class"),
             ({"calibration": "oracle"}, "calibration=oracle", "oracle_per_class"),
             ({"method": "sfd"}, "method=sfd", "safs_max_per_class")]
    for top, option, knob in cases:
        with pytest.raises(ConfigError, match=re.escape(
                f"{option} builds up to 10,000 features of width 128 after the last round (about 10.2 MB), more than the "
                f"0.0 GB of memory available; lower calibration_args.{knob}")):
            fedlt.run(tiny(tmp_path, fl={"rounds": 1}, calibration_args={knob: 1000}, **top), quiet=True)
    assert not any(tmp_path.iterdir())  # refused before any file
    monkeypatch.setattr(wrapper, "available_memory", lambda: 10_240_000)  # exactly what they need
    assert fedlt.run(tiny(tmp_path, fl={"rounds": 1}, eval={"every": 1}, calibration="ccvr",
                          calibration_args={"ccvr_virtual_per_class": 1000, "retrain_steps": 5}), quiet=True).summary["final"]
    # on a GPU the features are built there
    from fedlt.calibration.calibrators import CCVR
    from fedlt.config import build_config

    monkeypatch.setattr(wrapper, "available_memory", lambda: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (1_023_999, 80_000_000_000))
    ccvr = CCVR.__new__(CCVR)
    ccvr.num_classes, ccvr.args = 10, wrapper.CalibrationArgs()
    cfg = build_config(tiny(tmp_path, calibration="ccvr"))
    with pytest.raises(ConfigError, match=re.escape("builds up to 1,000 features of width 128 after the last round (about "
                                                    "1.0 MB), more than the 0.0 GB free on cuda:0; lower")):
        wrapper.check_features_fit(cfg, ccvr, 128, torch.device("cuda", 0))
    wrapper.check_features_fit(cfg, ccvr, 127, torch.device("cuda", 0))


def test_creff_resume_equals_uninterrupted(tmp_path, monkeypatch):
    cfg = dict(method="creff", calibration=["ccvr"])
    full = fedlt.run(tiny(tmp_path / "a", **cfg), quiet=True)
    run_until_crash_in_round_3(tiny(tmp_path / "b", run={"out_dir": str(tmp_path / "b"), "name": "cut",
                                                          "checkpoint_every": 2, "threads": 1}, **cfg), monkeypatch)
    resumed = fedlt.resume(tmp_path / "b" / "cut", quiet=True)
    assert without_timing(resumed.metrics) == without_timing(full.metrics)
    assert resumed.summary["messages"] == full.summary["messages"]


def test_a_run_cut_off_after_its_final_checkpoint_keeps_its_saved_features(tmp_path, monkeypatch):
    """CCVR's virtual features are made after the last round and not checkpointed: they are saved before
    the final checkpoint, so a run resumed from it (nothing left to train) still has them."""
    import fedlt.engine.simulation as simulation

    full = fedlt.run(tiny(tmp_path / "a", method="ccvr"), quiet=True)
    original = simulation.save_checkpoint

    def cut_after_the_last(run_dir, state):
        original(run_dir, state)
        if state["round"] == 4:
            raise KeyboardInterrupt

    monkeypatch.setattr(simulation, "save_checkpoint", cut_after_the_last)
    with pytest.raises(KeyboardInterrupt):
        fedlt.run(tiny(tmp_path / "b", method="ccvr"), quiet=True)
    monkeypatch.setattr(simulation, "save_checkpoint", original)
    run_dir = next((tmp_path / "b").rglob("checkpoint.pt")).parent
    assert not (run_dir / "summary.json").exists()
    fedlt.resume(run_dir, quiet=True)
    saved, expected = (torch.load(d / "artifacts.pt") for d in (run_dir, full.run_dir))
    assert saved.keys() == expected.keys() and "test_features" in saved
    assert all(torch.equal(saved[k], expected[k]) for k in saved)


def test_a_method_without_a_global_model_reports_only_its_calibrated_one(tmp_path):
    """FedPer's server head never trains: before calibration there is no global model to score, and
    no "uncalibrated" variant (it would be that untrained head, at chance); the calibrated head is."""
    run = fedlt.run(tiny(tmp_path, method="fedper", calibration=["ccvr"], eval={"every": 2}), quiet=True)
    first, last = run.metrics
    assert first.get("acc") is None and last["acc"] is not None and first["pm_acc"] is not None
    assert "uncalibrated" not in last.get("variants", {})
    with_model = fedlt.run(tiny(tmp_path, method="fedavg", calibration=["ccvr"], eval={"every": 2}), quiet=True)
    assert "uncalibrated" in with_model.metrics[-1]["variants"] and with_model.metrics[0]["acc"] is not None


@pytest.mark.parametrize("method_args", [{}, {"global_head": False}])
def test_a_calibration_gives_a_method_without_a_global_model_one_to_measure_alone(tmp_path, method_args):
    """FedPer (or FedRep without its global head) plus a calibration, with eval.personalized=false, was
    refused as measuring nothing, though the calibrated head is the final round's global model."""
    method = "fedrep" if method_args else "fedper"
    run = fedlt.run(tiny(tmp_path, method=method, method_args=method_args, calibration=["ccvr"],
                         eval={"every": 2, "personalized": False}), quiet=True)
    first, last = run.metrics
    assert "acc" not in first and "pm_acc" not in first  # before the final stage: nothing to measure yet
    assert 0 < last["acc"] <= 100 and "pm_acc" not in last and run.summary["final"]["acc"] == last["acc"]
    assert "(the backbone with ccvr's head; the method has no global model of its own)" in (
        run.run_dir / "report.md").read_text()  # no variant 'uncalibrated' to point to


def test_a_client_without_data_answers_every_request(tmp_path):
    """Small alpha leaves clients empty: their gradients and statistics must be empty, not errors."""
    from fedlt.api import prepare
    from fedlt.config import build_config
    from fedlt.messages import Message

    sim = prepare(build_config(tiny(tmp_path, method="creff", calibration=ALL_POST_HOC)))
    ctx = sim._context(0, 1)
    ctx.data.indices = ctx.data.indices[:0]
    msg = sim.server.fit_message(1, 0)
    reply = sim.client.fit(ctx, msg)
    assert reply.num_samples == 0 and reply.payload["creff/classes"].numel() == 0
    needs = "class_sums,features,normalized_sums,ridge_sums"
    stats = sim.client.query(STATS_QUERY, ctx, Message(weights=msg.weights, payload={"needs": needs,
                                                                                     "oracle_per_class": 5}))
    assert stats.payload["class_sums/count"].sum() == 0 and stats.payload["features/z"].shape == (0, 128)
    assert not stats.payload["ridge_sums/gram"].any()


def test_calibrated_variants_are_evaluated_on_one_pass_through_the_encoder(tmp_path, monkeypatch):
    """A calibration changes the head only: the global model and its six variants take their test and
    validation predictions from one pass of each set through the encoder, with the figures the
    whole models give."""
    from fedlt import evaluation

    over = dict(method="creff", calibration=ALL_POST_HOC, fl={**tiny(tmp_path)["fl"], "rounds": 2},
                data={**tiny(tmp_path)["data"], "val_per_class": 5})
    encoded = []
    real_encode = evaluation.encode
    monkeypatch.setattr(evaluation, "encode",
                        lambda model, data, bs: encoded.append(len(data)) or real_encode(model, data, bs))
    shared = fedlt.run(tiny(tmp_path / "shared", **over), quiet=True)
    assert len(shared.metrics[-1]["variants"]) == 6
    assert sorted(encoded) == [50, 1000]  # the validation and the test set, once each (one evaluation)
    monkeypatch.setattr(evaluation.SharedEncoderFeatures, "of", lambda self, *a: None)
    whole = fedlt.run(tiny(tmp_path / "whole", **over), quiet=True)
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]  # noqa: E731
    assert strip(shared.metrics) == strip(whole.metrics)


def test_a_run_started_with_a_knob_no_calibration_reads_still_resumes(tmp_path):
    """A new run with such a knob is refused; one an earlier version started with it (the knob had no
    effect) resumes, since its config may not change on resume."""
    from fedlt.api import prepare
    from fedlt.config import build_config
    from fedlt.results import new_run_dir

    tree = tiny(tmp_path, calibration="ccvr", calibration_args={"retrain_steps": 20, "creff_retrain_steps": 3})
    with pytest.raises(ConfigError, match="creff_retrain_steps is read by calibration=creff"):
        fedlt.run(tree, quiet=True)
    cfg = build_config(tree)
    first = prepare(cfg).run(new_run_dir(cfg), quiet=True)  # as an earlier version ran it
    (first.run_dir / "summary.json").unlink()
    resumed = fedlt.resume(first.run_dir, quiet=True)
    assert resumed.summary["final"]["acc"] == first.summary["final"]["acc"]
