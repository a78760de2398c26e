"""The Flower engine: lossless encoding, equivalence with the in-process engine (Flower's
simulation engine), and a real SuperLink with SuperNodes on 127.0.0.1, one of which dies."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"

from flower_loopback import LoopbackGrid, deployment_pids, stop_deployment  # noqa: E402

import fedlt  # noqa: E402
from fedlt.config import build_config  # noqa: E402
from fedlt.engine.flower_codec import decode_reply, encode_message, get_tree, put_tree  # noqa: E402
from fedlt.errors import FedltError  # noqa: E402
from fedlt.messages import Reply  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_codec_round_trips_any_message_exactly_and_refuses_what_cannot_travel():
    from flwr.app import RecordDict

    payload = {"counts": torch.tensor([3, 0, 7]), "mask": torch.tensor([True, False]), "np": np.arange(4.0),
               "per_class": {0: torch.ones(2, 2, dtype=torch.float64), "b": [1, 2.5, None, "x"]},
               "pair": (torch.zeros(1), False), "scalar": torch.tensor(1.5)}
    reply = Reply(weights={"fc.weight": torch.randn(3, 4)}, num_samples=17, payload=payload, metrics={"train_loss": 0.25})
    back = decode_reply(encode_message(reply, {"cid": 3}), torch.device("cpu"))
    assert back.num_samples == 17 and back.metrics == {"train_loss": 0.25}
    assert torch.equal(back.weights["fc.weight"], reply.weights["fc.weight"])
    assert back.payload["counts"].dtype == torch.int64 and torch.equal(back.payload["counts"], payload["counts"])
    assert back.payload["mask"].dtype == torch.bool
    assert isinstance(back.payload["np"], np.ndarray) and np.array_equal(back.payload["np"], payload["np"])
    assert list(back.payload["per_class"]) == [0, "b"]  # int keys stay ints
    assert back.payload["per_class"][0].dtype == torch.float64
    assert back.payload["per_class"]["b"] == [1, 2.5, None, "x"]
    assert isinstance(back.payload["pair"], tuple) and back.payload["pair"][1] is False
    assert back.payload["scalar"].shape == () and back.payload["scalar"].item() == 1.5

    records = RecordDict()
    with pytest.raises(TypeError, match=r"client 2's ctx.state\['opt'\] is a SGD, which cannot cross a network"):
        put_tree(records, "c2.", {"opt": torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)},
                 where="client 2's ctx.state")
    put_tree(records, "c2.", {"head": torch.ones(2)})
    assert torch.equal(get_tree(records, "c2.", torch.device("cpu"))["head"], torch.ones(2))


def test_codec_carries_what_numpy_has_no_type_for_and_numpy_scalars_exactly():
    """A bfloat16 or float8 tensor (mixed precision) failed in numpy's conversion with no name of the entry;
    a numpy scalar, which the in-process engine passes on, was refused; a 0-d array came back 1-d."""
    from flwr.app import RecordDict

    tree = {"bf16": torch.randn(3, 2).to(torch.bfloat16), "f8": torch.randn(4).to(torch.float8_e4m3fn),
            "f32": np.float32(1.25), "i64": np.int64(-7), "flag": np.bool_(True), "zero_d": np.array(3.5)}
    records = RecordDict()
    put_tree(records, "c.", tree)
    back = get_tree(records, "c.", torch.device("cpu"))
    for key in ("bf16", "f8"):  # bit for bit
        assert back[key].dtype == tree[key].dtype and back[key].shape == tree[key].shape
        assert torch.equal(back[key].view(torch.uint8), tree[key].view(torch.uint8))
    for key in ("f32", "i64", "flag"):
        assert type(back[key]) is type(tree[key]) and back[key] == tree[key]
    assert isinstance(back["zero_d"], np.ndarray) and back["zero_d"].shape == () and back["zero_d"] == 3.5


def test_codec_refuses_a_list_or_tuple_subclass_it_would_give_back_as_its_skeleton():
    """A torch.Size or namedtuple in a message is named, not decoded as a list of the codec's own records."""
    from collections import namedtuple

    from flwr.app import RecordDict

    pair = namedtuple("Pair", "a b")
    for value, kind in ((torch.Size([2, 3]), "Size"), (pair(1, 2), "Pair")):
        refusal = rf"message\['shape'\] is a {kind}, which cannot cross a network.*e\.g\. tuple\(\.\.\.\)"
        with pytest.raises(TypeError, match=refusal):
            put_tree(RecordDict(), "", {"shape": value})


def tiny(tmp_path, method: str, name: str, **top) -> dict:
    cfg = {
        "seed": 3, "method": method,
        "data": {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 6},
        "fl": {"rounds": 2, "participation": 0.5, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 1},
        "run": {"out_dir": str(tmp_path), "name": name, "checkpoint_every": 0, "threads": 1},
    }
    cfg.update(top)
    return cfg


EQUIVALENT = {  # FedAvg, two methods with extra query phases, one with per-client state, secure FedAvg
    "fedavg": {},
    "fedavg+secagg": {"secagg": {"enabled": True}},
    "creff": {"calibration_args": {"creff_feature_steps": 5, "creff_retrain_steps": 20}},
    "sfd": {"calibration_args": {"safs_max_per_class": 100, "safs_min_per_class": 50, "safs_steps": 5,
                                 "safs_rff_dim": 50, "safs_finetune_epochs": 1}},
    "fedper": {},
}


def test_flower_simulation_equals_in_process_for_methods_with_phases_and_state(tmp_path):
    """One Flower simulation (one Ray start) runs five methods in turn over the same virtual
    SuperNodes; each must give what the in-process engine gives: same partition, same clients
    (same traffic), identical metrics (secure aggregation's masks cancel exactly, so its sums too)."""
    from flwr.app import Context
    from flwr.serverapp import Grid, ServerApp
    from flwr.simulation import run_simulation

    from fedlt.engine.flower_app import clientapp, run_on_grid

    configs = {m: build_config(tiny(tmp_path, m.split("+")[0], f"flower-{m}", **extra)) for m, extra in EQUIVALENT.items()}
    flower: dict = {}
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        for method, cfg in configs.items():
            flower[method] = run_on_grid(cfg, grid, quiet=True)

    run_simulation(app, clientapp, num_supernodes=6,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"include_dashboard": False}})
    assert set(flower) == set(EQUIVALENT)
    for method, extra in EQUIVALENT.items():
        local = fedlt.run(tiny(tmp_path, method.split("+")[0], f"local-{method}", **extra), quiet=True)
        remote = flower[method]
        assert (remote.run_dir / "partition.json").read_text() == (local.run_dir / "partition.json").read_text()
        assert len(remote.metrics) == len(local.metrics) == 2
        for a, b in zip(local.metrics, remote.metrics):
            assert b["comm"] == a["comm"], method  # the same messages to the same number of clients
            assert b["dropped"] == [] and "dropped" not in a
            # bit-identical, not close: every Ray worker builds the client runtime from the same config
            # (run.threads=1) and inherits this process's environment (ATEN_CPU_CAPABILITY), so it runs
            # the same kernels in the same order, and the codec is lossless
            for key in ("train_loss", "acc", "per_class_acc", "pm_acc"):
                assert b.get(key) == a.get(key), (method, key)
        assert remote.summary["messages"] == local.summary["messages"]
        assert remote.summary["engine"] == "flower" and remote.summary["dropped"] == []
    assert flower["fedper"].summary["final"]["acc"] is None  # no global model: pm_acc came over Flower
    assert flower["fedper"].summary["final"]["pm_acc"] > 0


@pytest.fixture
def server_identity(monkeypatch):
    """What Flower sets in a ServerApp process before messages can be created."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


def flower_run(cfg: dict, grid: LoopbackGrid):
    from fedlt.engine.flower_app import run_on_grid

    return run_on_grid(build_config(cfg), grid, quiet=True)


def test_two_supernodes_host_four_clients_with_their_state_and_match_in_process(tmp_path, server_identity):
    """K > N: clients k live on node k % 2; FedPer's personal heads persist in the nodes'
    context.state between rounds, so personalized accuracy equals the in-process run's."""
    cfg = tiny(tmp_path, "fedper", "grid", data={"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5,
                                                  "num_clients": 4},
               fl={"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05})
    grid = LoopbackGrid(nodes=2)
    remote = flower_run(cfg, grid)
    local = fedlt.run({**cfg, "run": {**cfg["run"], "name": "local"}}, quiet=True)
    assert [m["pm_acc"] for m in remote.metrics] == [m["pm_acc"] for m in local.metrics]
    assert [m["train_loss"] for m in remote.metrics] == [m["train_loss"] for m in local.metrics]
    states = {node: sorted(k for k in ctx.state if k.endswith("tree")) for node, ctx in grid.contexts.items()}
    assert states == {100: ["client0.tree", "client2.tree"], 101: ["client1.tree", "client3.tree"]}
    assert set(grid.timeouts) == {600.0}  # every send is bounded by flower.timeout_s


def test_a_dead_supernode_is_recorded_and_the_minimum_reply_fraction_enforced(tmp_path, server_identity):
    """A silent node is a timeout, a node Flower reports unavailable (heartbeat) is a lost node:
    the record and the error say which; an aborted run still writes its summary."""
    from fedlt.errors import FedltError

    data = {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 4}
    fl = {"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05}
    res = flower_run(tiny(tmp_path, "fedavg", "drop", data=data, fl=fl), LoopbackGrid(nodes=2, die_after_fits=2))
    assert res.metrics[0]["dropped"] == []
    assert res.metrics[1]["dropped"] == [{"round": 2, "kind": "fit", "clients": [1, 3], "cause": "timeout"}]
    assert res.summary["dropped"] == res.metrics[1]["dropped"] and res.summary["final"]["round"] == 2
    assert res.summary["final"]["server_metrics"] == {}  # dropouts are the engine's record, not a method metric
    assert "status" not in res.summary
    strict = {"min_reply_fraction": 0.75}
    with pytest.raises(FedltError, match=r"round 2 \(fit\): 2 of 4 clients answered, fewer than flower.min_reply_"
                                         r"fraction=0.75 requires \(clients \[1, 3\] on partition-1 \(SuperNode "
                                         r"101\): no reply within "
                                         r"flower.timeout_s=600\)$"):
        flower_run(tiny(tmp_path, "fedavg", "strict", data=data, fl=fl, flower=strict),
                   LoopbackGrid(nodes=2, die_after_fits=2))
    with pytest.raises(FedltError, match=r"\(clients \[1, 3\] on partition-1 \(SuperNode 101\): Flower's "
                                         r"heartbeat lost their SuperNode\)$"):
        flower_run(tiny(tmp_path, "fedavg", "lost", data=data, fl=fl, flower=strict),
                   LoopbackGrid(nodes=2, lost_after_fits=2))
    summary = json.loads((tmp_path / "lost" / "summary.json").read_text())
    assert summary["status"] == "aborted" and summary["rounds_done"] == 1 and summary["final"]["round"] == 1
    assert summary["reason"].startswith("round 2 (fit): 2 of 4 clients answered")
    assert summary["dropped"] == [{"round": 2, "kind": "fit", "clients": [1, 3], "cause": "node lost"}]

    from fedlt.reporting.collect import collect

    rows = collect(tmp_path / "lost").settings[0].rows
    assert rows[0].label == "fedavg (aborted after 1 of 2 rounds)" and not rows[0].ranked


@pytest.mark.parametrize("fault, message", [
    ("missing", r"only partitions \[0, 1\] connected within flower.connect_timeout_s=1; start the missing SuperNodes"),
    ("disagree", r"SuperNodes disagree on num-partitions \(\[3, 4\]\); start all with the same N"),
    ("duplicate", r"two SuperNodes share a partition-id \(\[0, 1, 1\]\); give each its own"),
])
def test_supernodes_that_cannot_form_the_federation_stop_the_run_with_the_fix(tmp_path, server_identity, fault, message):
    from fedlt.errors import FedltError

    grid = LoopbackGrid(nodes=3)
    if fault == "missing":
        grid.left.add(102)  # partition 2's SuperNode never registers
    else:
        grid.contexts[102].node_config.update({"num-partitions": 4} if fault == "disagree" else {"partition-id": 1})
    started = time.monotonic()
    with pytest.raises(FedltError, match=message):
        flower_run(tiny(tmp_path, "fedavg", fault, flower={"connect_timeout_s": 1}), grid)
    assert time.monotonic() - started < 30
    assert not [b for b in grid.batches if b[0] == "train"]  # nothing was trained


def test_a_deregistered_supernode_is_not_sent_to_and_a_clientapp_exception_ends_the_run(tmp_path, server_identity):
    from fedlt.errors import FedltError

    data = {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 4}
    fl = {"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05}
    # node 101 answers round 1's fit, then leaves the SuperLink's node list before evaluation
    grid = LoopbackGrid(nodes=2, leave_after_fits=1)
    res = flower_run(tiny(tmp_path, "fedper", "left", data=data, fl=fl), grid)
    first_fit = [kind for kind, _ in grid.batches].index("train")
    assert 101 in grid.batches[first_fit][1]
    assert all(101 not in nodes for _, nodes in grid.batches[first_fit + 1:])
    assert res.metrics[0]["dropped"] == [{"round": 1, "kind": "evaluate", "clients": [1, 3], "cause": "node lost"}]
    assert {d["kind"] for d in res.summary["dropped"]} == {"evaluate", "fit"}
    with pytest.raises(FedltError, match=r"a ClientApp failed \(fit\) on partition-1 \(SuperNode 101\): "
                                         "ValueError: boom"):
        flower_run(tiny(tmp_path, "fedavg", "fails", data=data, fl=fl), LoopbackGrid(nodes=2, fail_after_fits=2))


def test_engine_flower_refuses_what_it_cannot_do(tmp_path):
    from fedlt.errors import ConfigError

    with pytest.raises(ConfigError, match="pooled data; run it with engine=inprocess"):
        fedlt.run(tiny(tmp_path, "centralized", "c", engine="flower"), quiet=True)
    with pytest.raises(ConfigError, match=r"invalid config value flower.min_reply_fraction: must be in \(0, 1\]"):
        build_config({"flower": {"min_reply_fraction": 0}})


@pytest.mark.parametrize("gpus, present, device, message", [
    (1, 0, "auto", r"flower.gpus_per_client=1 but this machine has 0 CUDA device\(s\); use at most 0"),
    (2, 1, "auto", r"flower.gpus_per_client=2 but this machine has 1 CUDA device\(s\); use at most 1"),
    (0.5, 1, "cpu", r"flower.gpus_per_client=0.5 reserves GPUs but run.device=cpu keeps training on the CPU"),
])
def test_gpus_for_simulated_clients_are_refused_beyond_the_devices_present(monkeypatch, gpus, present, device,
                                                                          message):
    from fedlt.errors import ConfigError
    from fedlt.run_parts import check_config

    monkeypatch.setattr(torch.cuda, "device_count", lambda: present)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: present > 0)
    cfg = build_config({"engine": "flower", "data": {"dataset": "synthetic"}, "run": {"device": device},
                        "flower": {"gpus_per_client": gpus}})
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)


def test_simulated_clients_reserve_the_gpus_and_cpus_the_config_asks_for(monkeypatch):
    from fedlt.engine.flower_app import simulation_backend
    from fedlt.run_parts import check_config

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    cfg = build_config({"engine": "flower", "data": {"dataset": "synthetic"},
                        "flower": {"gpus_per_client": 0.25, "cpus_per_client": 2}})
    check_config(cfg)  # a quarter of the one GPU present: four clients share it
    assert simulation_backend(cfg)["client_resources"] == {"num_cpus": 2, "num_gpus": 0.25}
    assert simulation_backend(build_config({}))["client_resources"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    # a client running 3 torch threads is given 3 cores: Ray runs no more clients at once than fit
    assert simulation_backend(build_config({"run": {"threads": 3}}))["client_resources"]["num_cpus"] == 3


def test_a_simulation_asking_more_cpus_than_the_machine_has_is_refused_before_ray_starts(tmp_path):
    """Ray would start no client and wait for one (then end with a traceback)."""
    from fedlt.engine.flower_app import simulate
    from fedlt.engine.process_pool import cpu_cores
    from fedlt.errors import ConfigError

    n = cpu_cores()
    for asked in ({"flower": {"cpus_per_client": n + 1}}, {"run": {"threads": n + 1}}):  # Ray reserves the larger
        tree = {"engine": "flower", "data": {"dataset": "synthetic"}, "run": {"out_dir": str(tmp_path)}}
        cfg = build_config({**tree, **asked, "run": {**tree["run"], **asked.get("run", {})}})
        with pytest.raises(ConfigError, match=rf"^each simulated client asks for {n + 1} CPU cores "
                                              rf"\(flower.cpus_per_client=.*, run.threads=.*\) but this machine has "
                                              rf"{n}; set both to at most {n}$"):
            simulate(cfg)
    assert not any(tmp_path.iterdir())


def test_a_deployed_serverapp_takes_replies_as_they_come_and_waits_out_a_silent_node():
    """Flower's deployed grid asks the SuperLink for replies every 3 s; the deployed ServerApp asks
    every REPLY_POLL_S: replies are taken as soon as they are there, a silent node is waited for
    until the timeout (then the others' replies are returned)."""
    from types import SimpleNamespace

    from fedlt.engine.flower_app import REPLY_POLL_S, poll_replies

    class Grid:  # the replies to ``answered`` are there from the third request on
        def __init__(self, answered):
            self.answered, self.pulls = answered, 0

        def push_messages(self, messages):
            return ["a", "b"]

        def pull_messages(self, ids):
            self.pulls += 1
            ready = [i for i in ids if i in self.answered] if self.pulls >= 3 else []
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id=i)) for i in ready]

    grid, started = Grid({"a", "b"}), time.monotonic()
    assert len(poll_replies(grid, [], timeout=60)) == 2 and grid.pulls == 3
    assert time.monotonic() - started < 2 * 3.0  # Flower's grid: two 3 s waits
    grid, started = Grid({"a"}), time.monotonic()
    got = poll_replies(grid, [], timeout=1.0)
    assert [r.metadata.reply_to_message_id for r in got] == ["a"]
    assert time.monotonic() - started >= 1.0 and grid.pulls >= 1.0 / REPLY_POLL_S / 2


def test_the_supernode_waits_are_capped_and_object_pulls_back_off_from_50_ms(monkeypatch):
    """Flower's SuperNode sleeps 3 s when idle and its pulls first back off 1 s: in fedlt's SuperNode and
    ServerApp every sleep of that loop lasts at most the cap, and a pull's first pause 50 ms; Flower's
    other pull settings and the loop's other uses of time stay."""
    import functools
    import time as clock

    from flwr.superlink.grid import http_grid
    from flwr.supernode import start_client_internal as loop

    from fedlt.engine.flower_waits import PULL_BACKOFF_S, CappedSleep, cap_supernode_waits, quick_object_pulls

    slept = []

    class Clock:
        def sleep(self, seconds):
            slept.append(seconds)

        def monotonic(self):
            return 7.0

    capped = CappedSleep(0.2, Clock())
    capped.sleep(3)
    capped.sleep(0.5)
    capped.sleep(0.01)
    assert slept == [0.2, 0.2, 0.01] and capped.monotonic() == 7.0
    monkeypatch.setattr(loop, "time", clock)
    monkeypatch.setattr(loop, "pull_objects", loop.pull_objects)
    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)
    flowers = loop.pull_objects
    cap_supernode_waits(0.1)
    cap_supernode_waits(0.1)  # twice: still one cap, one partial
    assert isinstance(loop.time, CappedSleep) and loop.time.cap_s == 0.1 and loop.time.time is clock.time
    assert isinstance(loop.pull_objects, functools.partial) and loop.pull_objects.func is flowers
    assert loop.pull_objects.keywords == {"initial_backoff": PULL_BACKOFF_S} == {"initial_backoff": 0.05}
    quick_object_pulls(http_grid)
    assert http_grid.pull_objects.keywords == {"initial_backoff": 0.05}
    tries = []

    def unavailable_twice(object_id):
        tries.append(clock.monotonic())
        if len(tries) < 3:
            from flwr.supercore.inflatable.inflatable_utils import ObjectUnavailableError

            raise ObjectUnavailableError(object_id)
        return b"x"

    assert http_grid.pull_objects(["a"], unavailable_twice) == {"a": b"x"}
    assert tries[-1] - tries[0] < 0.5  # 50 + 100 ms (+-20%), where Flower's own back-off waits 1 + 2 s
    monkeypatch.setattr(loop, "time", object())
    with pytest.raises(RuntimeError, match="does not wait with the time module; start flower-supernode itself"):
        cap_supernode_waits()


def test_a_bad_supernode_poll_is_refused_before_the_deployment_starts(tmp_path):
    """fedlt deploy's SuperNodes read $FEDLT_SUPERNODE_POLL: a bad one made each exit at once, and the run wait
    out flower.connect_timeout_s for nodes that never came, then blame them."""
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FEDLT_SUPERNODE_POLL": "abc"}
    proc = subprocess.run([sys.executable, "-m", "fedlt.cli", "deploy", "--nodes", "2", str(ROOT / "configs" /
                           "synthetic_smoke.yaml"), "fl.rounds=1", f"run.out_dir={tmp_path / 'runs'}"], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [
        "fedlt: error: $FEDLT_SUPERNODE_POLL=abc is not a number of seconds in (0, 3]; give e.g. "
        "$FEDLT_SUPERNODE_POLL=0.2 (the SuperNodes' poll)"], proc.stderr
    assert list(tmp_path.iterdir()) == []  # no workdir, no run folder


def test_the_deployed_serverapp_pulls_replies_with_the_short_back_off(monkeypatch):
    """The ServerApp's own pulls of reply objects start their back-off at 50 ms before anything else runs
    (Flower's start at 1 s, up to 3 s more per phase whose replies lag their messages)."""
    import functools

    from flwr.app import Context, RecordDict
    from flwr.superlink.grid import http_grid

    from fedlt.engine import flower_app
    from fedlt.errors import ConfigError

    monkeypatch.setattr(http_grid, "pull_objects", http_grid.pull_objects)
    monkeypatch.delenv("FEDLT_OUTCOME_FILE", raising=False)

    def refuse(*_):
        raise ConfigError("stop here")

    monkeypatch.setattr(flower_app, "app_dir", lambda grid: None)
    monkeypatch.setattr(flower_app, "deployed_config", refuse)
    with pytest.raises(ConfigError, match="stop here"):
        flower_app.main(object(), Context(run_id=1, node_id=0, node_config={}, state=RecordDict(), run_config={}))
    assert isinstance(http_grid.pull_objects, functools.partial)
    assert http_grid.pull_objects.keywords == {"initial_backoff": 0.05}


@pytest.mark.parametrize(("args", "env", "where"), [
    (["--poll", "0"], None, "--poll=0"), (["--poll", "5"], "0.5", "--poll=5"), (["--poll", "x"], None, "--poll=x"),
    ([], "-1", "$FEDLT_SUPERNODE_POLL=-1"), ([], "nan", "$FEDLT_SUPERNODE_POLL=nan")])
def test_the_supernode_launcher_refuses_a_poll_outside_its_range_in_one_line(args, env, where, capsys, monkeypatch):
    """--poll, else $FEDLT_SUPERNODE_POLL (how fedlt deploy's nodes get it); the line names the one read."""
    from fedlt.engine.flower_supernode import POLL_ENV, main

    monkeypatch.delenv(POLL_ENV, raising=False)
    if env is not None:
        monkeypatch.setenv(POLL_ENV, env)
    assert main([*args, "--insecure"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    given = where.split("=")[0]
    assert err == [f"python -m fedlt.engine.flower_supernode: error: {where} is not a number of seconds in (0, 3]; "
                   f"give e.g. {given}=0.2"]


def test_a_deployed_serverapp_stops_waiting_for_a_node_known_to_be_gone():
    """A node whose process exited never answers, and Flower keeps it listed until its heartbeat expires
    (up to 60 s): once ``gone()`` names it, its reply is no longer waited for."""
    from types import SimpleNamespace

    from fedlt.engine.flower_app import GONE_POLL_S, poll_replies

    class Grid:  # node 2 ("b") never answers
        def push_messages(self, messages):
            return ["a", "b"]

        def pull_messages(self, ids):
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="a"))] if "a" in ids else []

    sent = [SimpleNamespace(metadata=SimpleNamespace(message_id=i, dst_node_id=n)) for i, n in (("a", 1), ("b", 2))]
    started = time.monotonic()
    got = poll_replies(Grid(), sent, timeout=60, gone=lambda: {2})
    assert [r.metadata.reply_to_message_id for r in got] == ["a"]
    assert time.monotonic() - started < GONE_POLL_S + 2


class ExitingNode(LoopbackGrid):
    """Node 101 dies after the first fit (silent, still listed) and fedlt.deploy, which saw its process
    exit, names its site in ``lost``."""

    def __init__(self, lost: Path):
        super().__init__(nodes=2, die_after_fits=2)
        self.lost = lost

    def push_messages(self, messages):
        ids = super().push_messages(messages)
        if self.dead and not self.lost.exists():
            self.lost.write_text("partition-1\n")
        return ids


def test_a_node_whose_process_exited_is_given_up_at_once_and_named_by_its_site(tmp_path, server_identity,
                                                                               monkeypatch, capsys):
    """Without being told, the round waits flower.timeout_s for the dead node (Flower's heartbeat takes up
    to 60 s more); told by fedlt.deploy, it goes on at once, records the node as lost and names its site."""
    from fedlt.engine.flower_app import run_on_grid
    from fedlt.results import LOST_NODES_ENV

    lost = tmp_path / "lost-nodes.txt"
    monkeypatch.setenv(LOST_NODES_ENV, str(lost))
    data = {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 4}
    fl = {"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05}
    cfg = tiny(tmp_path, "fedavg", "exited", data=data, fl=fl, flower={"timeout_s": 20})
    started = time.monotonic()
    res = run_on_grid(build_config(cfg), ExitingNode(lost), quiet=True, prompt=True)
    assert time.monotonic() - started < 20
    assert res.metrics[1]["dropped"] == [{"round": 2, "kind": "fit", "clients": [1, 3], "cause": "node lost"}]
    err = capsys.readouterr().err
    assert ("fedlt: round 2 (fit): clients [1, 3] on partition-1 (SuperNode 101): their SuperNode's process exited; "
            "going on without them") in err
    assert "fedlt: 2/2 SuperNodes connected (partitions 0, 1)" in err


def test_the_deploy_relays_the_run_log_in_its_order_without_colour_unless_to_a_terminal(tmp_path):
    """Flower's lines and the ServerApp's go to one stream as they come (Flower's used to follow the
    rounds, at the end), colour codes only to a terminal; the result line is kept for stdout."""
    import io

    from fedlt.deploy import GrowingFile, is_result, show_progress

    log = tmp_path / "flwr-run.log"
    lines = ["Successfully started run 7", "\x1b[92mINFO \x1b[0m:      Start `flwr-serverapp` process",
             "fedlt: 2/2 SuperNodes connected (client-0, client-1)", "[fedavg/ce sequential] round 1/2 | acc 10.00",
             "\x1b[92mINFO \x1b[0m:      ", "[fedavg/ce sequential] round 2/2 | acc 12.00",
             "fedlt: runs/x: finished; final acc 12.00"]
    log.write_text("\n".join(lines[:3]) + "\n")
    relay, out = GrowingFile(log), io.StringIO()
    show_progress(relay, out)
    with log.open("a") as more:
        more.write("\n".join(lines[3:]) + "\n")
    show_progress(relay, out)
    assert out.getvalue().splitlines() == ["Successfully started run 7", "INFO :      Start `flwr-serverapp` process",
                                           "fedlt: 2/2 SuperNodes connected (client-0, client-1)",
                                           "[fedavg/ce sequential] round 1/2 | acc 10.00",
                                           "[fedavg/ce sequential] round 2/2 | acc 12.00"]
    assert is_result(lines[-1]) and not is_result(lines[2])

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    # a benchmark's relay: fedlt's lines and Flower's warnings, not Flower's routine lines
    chatty = tmp_path / "chatty.log"
    chatty.write_text("Using SuperLink: deploy (127.0.0.1:9093)\nSuccessfully installed fedlt to /x/apps/fedlt.\n"
                      + "\n".join(lines) + "\n\x1b[93mWARNING \x1b[0m:   node 3 is slow\n")
    quiet = io.StringIO()
    show_progress(GrowingFile(chatty), quiet, flower_lines=False)
    assert quiet.getvalue().splitlines() == ["fedlt: 2/2 SuperNodes connected (client-0, client-1)",
                                             "[fedavg/ce sequential] round 1/2 | acc 10.00",
                                             "[fedavg/ce sequential] round 2/2 | acc 12.00",
                                             "WARNING :   node 3 is slow"]

    terminal = Terminal()
    show_progress(GrowingFile(log), terminal)
    assert "\x1b[92mINFO \x1b[0m:      Start `flwr-serverapp` process" in terminal.getvalue().splitlines()
    # a failed ServerApp's traceback, split across two reads: its frames stay in the file, its exception is relayed
    failed, out = tmp_path / "failed.log", io.StringIO()
    failed.write_text("ERROR :     ServerApp raised an exception\nTraceback (most recent call last):\n"
                      '  File "x.py", line 1, in main\n')
    relay = GrowingFile(failed)
    show_progress(relay, out)
    with failed.open("a") as more:
        more.write("    run()\nfedlt.errors.FedltError: round 3 (fit): 0 of 1 clients answered\nERROR :     Exit Code: 201\n")
    show_progress(relay, out)
    assert out.getvalue().splitlines() == ["ERROR :     ServerApp raised an exception", f"(a traceback, in {failed})",
                                           "fedlt.errors.FedltError: round 3 (fit): 0 of 1 clients answered",
                                           "ERROR :     Exit Code: 201"]


def wait_for(condition, seconds: float, what: str, every: float = 0.25, since: float | None = None) -> None:
    """Wait until ``condition()``, at most ``seconds`` from now (or from the monotonic time ``since``)."""
    deadline = (time.monotonic() if since is None else since) + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what} within {seconds:g} s"
        time.sleep(every)


def deploy_config(tmp_path: Path, name: str, **flower) -> Path:
    cfg = tiny(tmp_path, "fedavg", name, data={"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5,
                                               "num_clients": 2},
               fl={"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
               flower={"min_reply_fraction": 0.5, **flower})
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(cfg))  # JSON is YAML
    return path


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:  # gone meanwhile
        return []


def _pid_of(work: Path, *words: str) -> int:
    for pid in deployment_pids(work):
        args = _cmdline(pid)
        if args and all(any(w in a for a in args) for w in words):
            return pid
    raise AssertionError(f"no process {words} in the deployment")


def test_deployment_over_tls_survives_a_dead_supernode_and_reports_a_dead_superlink(tmp_path):
    """``python -m fedlt.deploy --tls``: a real SuperLink and 2 SuperNodes on 127.0.0.1 run FedAvg
    on 2 clients (one per node). Round 1 equals the in-process run, and each node's one ClientApp
    process has served every message so far (the handshake and the fit). After round 1 SuperNode
    1's ClientApp process crashes (SIGKILL): the SuperNode is stopped within 15 s, round 2 goes on
    with the other node and records client 1 as dropped because its node left (not by a timeout).
    After round 2 SuperNode 0 crashes (SIGKILL): its ClientApp process goes within 15 s too. Then the SuperLink is
    killed: the ServerApp notices by itself and writes the aborted summary
    (rounds done, dropouts, reason), the deploy exits 1 with one line naming the cause, and no
    process of the deployment is left within 15 s. Each ClientApp process is held (SIGSTOP) once it has
    served its last round before its crash, and the ServerApp from round 2's end until the SuperLink is
    gone: no step of the test races the federation's next one."""
    import subprocess
    import sys

    config, work = deploy_config(tmp_path, "deployed", timeout_s=120), tmp_path / "federation"
    cfg = json.loads(config.read_text())
    local = fedlt.run(tiny(tmp_path, "fedavg", "local", data=cfg["data"], fl={**cfg["fl"], "rounds": 3}), quiet=True)
    metrics = tmp_path / "deployed" / "metrics.jsonl"

    def rows() -> list[dict]:
        return [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.is_file() else []

    def served() -> list[list[tuple[str, str]]]:  # (ClientApp process, task) of each task served, per node
        logs = [work / f"clientapp{i}.log" for i in (0, 1)]
        return [re.findall(r"fedlt worker (\d+): task (\d+) served", log.read_text() if log.is_file() else "")
                for log in logs]

    def hold_after(node: int, tasks: int) -> int:
        """Stop (SIGSTOP) node's ClientApp process once it has served ``tasks`` (its replies are with its
        SuperNode then): it serves nothing more, however long the test's next steps take; its pid."""
        wait_for(lambda: len(served()[node]) >= tasks or proc.poll() is not None, 240,
                 f"task {tasks} served on node {node}", every=0.02)
        os.kill(worker := int(served()[node][0][0]), signal.SIGSTOP)
        return worker

    # Flower's own idle wait (3 s): a node asks for its next task seconds after a reply, time to hold its ClientApp
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FEDLT_SUPERNODE_POLL": "3"}
    proc = subprocess.Popen([sys.executable, "-m", "fedlt.deploy", "--nodes", "2", "--tls", "--workdir", str(work),
                             str(config), "fl.rounds=3"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        held = hold_after(1, 2)  # the handshake and round 1's fit: round 2's fit cannot finish on node 1
        wait_for(lambda: len(rows()) >= 1 or proc.poll() is not None, 240, "round 1")
        wait_for(lambda: min(map(len, served())) >= 2, 15, "the handshake and round 1's fit served on each node")
        assert [len({pid for pid, _ in tasks}) for tasks in served()] == [1, 1], served()  # by one process per node
        workers = [int(tasks[0][0]) for tasks in served()]
        assert held == workers[1]
        assert not [p for p in deployment_pids(work) if "flwr-clientapp" in " ".join(_cmdline(p))]
        node = _pid_of(work, "fedlt.engine.flower_supernode", "partition-id=1")
        crashed = _pid_of(work, "fedlt.engine.flower_supernode", "partition-id=0")
        server = _pid_of(work, "flwr-serverapp")
        os.kill(workers[1], 9)  # the ClientApp process crashes: its SuperNode is the deploy's to stop
        killed = time.monotonic()
        hold_after(0, 3)  # round 2's fit too: round 3's cannot finish
        wait_for(lambda: not [p for p in deployment_pids(work) if p == workers[1] or os.getpgid(p) == node], 15,
                 "the SuperNode of the crashed ClientApp process gone", since=killed)
        wait_for(lambda: len(rows()) >= 2 or proc.poll() is not None, 120, "round 2")
        os.kill(server, signal.SIGSTOP)  # until the SuperLink is gone: round 3 cannot fail on the crash below first
        os.kill(crashed, 9)  # a crash: the SuperNode cannot stop anything itself
        os.kill(workers[0], signal.SIGCONT)  # for the deploy's SIGTERM
        wait_for(lambda: not [p for p in deployment_pids(work) if p == workers[0] or os.getpgid(p) == crashed], 15,
                 "the crashed SuperNode's processes gone")
        os.kill(_pid_of(work, "flower-superlink"), 9)
        os.kill(server, signal.SIGCONT)
        out, err = proc.communicate(timeout=60)
    finally:
        stop_deployment(proc, work)
    assert proc.returncode == 1, err
    *relayed, error = err.strip().splitlines()  # the run's log as it came, then one error
    assert "fedlt deploy: the ClientApp process of partition-1 exited (code -9); the run goes on without it" in relayed
    shown = [line for line in relayed if re.match(r"\[[^\]]+\] round \d+/\d+ \|", line)]  # the rounds that reached it
    rounds = [line.split(" | ")[0] for line in shown]
    assert rounds == [f"[fedavg/ce sequential] round {r}/3" for r in range(1, len(rounds) + 1)] and len(rounds) <= 2, err
    assert error.startswith("fedlt: error: the SuperLink exited (code -9) during the run (the run was aborted after "
                            "2 round(s): the SuperLink is gone"), err
    wait_for(lambda: deployment_pids(work) == [], 15, "every process of the deployment gone")
    assert (work / "certs" / "server.pem").is_file()
    done = rows()
    assert [r["round"] for r in done] == [1, 2]
    assert done[0]["dropped"] == [] and done[0]["acc"] == local.metrics[0]["acc"]
    assert done[0]["train_loss"] == local.metrics[0]["train_loss"]
    assert done[1]["dropped"] == [{"round": 2, "kind": "fit", "clients": [1], "cause": "node lost"}]
    summary = json.loads((tmp_path / "deployed" / "summary.json").read_text())
    assert summary["status"] == "aborted" and summary["rounds_done"] == 2 and summary["final"]["round"] == 2
    assert summary["reason"].startswith("the SuperLink is gone") and summary["dropped"] == done[1]["dropped"]
    assert (tmp_path / "deployed" / "partition.json").read_text() == (local.run_dir / "partition.json").read_text()


def test_the_closing_sweep_stops_a_helper_that_escaped_the_process_groups(tmp_path):
    """A process of the federation that is in none of the noted groups (started in a session of its
    own as the signal arrived) and ignores SIGTERM still goes: found by the FLWR_HOME it inherited."""
    import subprocess
    import sys

    from fedlt.deploy import _stop_inheritors

    home = str(tmp_path / "flwr-home")
    code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('up', flush=True); time.sleep(60)"
    helper = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, "FLWR_HOME": home},
                              start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert helper.stdout.readline().strip() == "up" and deployment_pids(tmp_path) == [helper.pid]
        _stop_inheritors(home)
        assert helper.wait(5) == -9 and deployment_pids(tmp_path) == []  # SIGKILL after the ignored SIGTERM
    finally:
        helper.kill()


@pytest.mark.parametrize("signum", [15, 2])
def test_a_signalled_deploy_stops_every_process_and_says_so(tmp_path, signum):
    """SIGTERM or SIGINT (Ctrl-C) once the SuperLink, its superexec and the SuperNodes run: one
    error line, no traceback, exit 128+N, no process of the deployment left within 15 s."""
    import signal
    import subprocess
    import sys

    config, work = deploy_config(tmp_path, "signalled"), tmp_path / "federation"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "fedlt.deploy", "--nodes", "2", "--workdir", str(work), str(config)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        wait_for(lambda: (work / "supernode1.log").is_file() or proc.poll() is not None, 120, "SuperNodes started")
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        stop_deployment(proc, work)
    assert proc.returncode == 128 + signum, err
    name = signal.Signals(signum).name
    *steps, error = err.strip().splitlines()  # the start-up steps it had named, then one error line, no traceback
    assert error == f"fedlt: error: stopped by {name}; every process of the federation was stopped"
    assert steps and all(line.startswith("fedlt deploy: ") for line in steps), err
    wait_for(lambda: deployment_pids(work) == [], 15, "every process of the deployment gone")


def test_the_readiness_check_does_not_take_a_foreign_listener_for_the_superlink(tmp_path, monkeypatch, capsys):
    import socket

    from fedlt import deploy
    from fedlt.errors import FedltError

    with socket.socket() as held:
        held.bind((deploy.HOST, 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(deploy, "free_port", lambda: port)
        tried = ", ".join([f"127.0.0.1:{port}"] * deploy.PORT_TRIES)
        with pytest.raises(FedltError, match=re.escape(f"another program took each port chosen for the SuperLink "
                                                       f"({tried}) before it could listen on it; find what takes free "
                                                       "ports on this machine (`ss -ltnp`)")):
            with deploy.local_federation(tmp_path / "federation", nodes=1, startup_s=60):
                pass
    assert capsys.readouterr().err.count("starting a SuperLink on") == deploy.PORT_TRIES  # each on a fresh port
    assert deployment_pids(tmp_path / "federation") == []


def test_a_supernode_whose_every_port_is_taken_ends_the_deployment_naming_them(tmp_path, monkeypatch):
    import socket

    from fedlt import deploy
    from fedlt.errors import FedltError

    free = deploy.free_port
    with socket.socket() as held:
        held.bind((deploy.HOST, 0))
        held.listen()
        port = held.getsockname()[1]
        chosen = iter([free(), *[port] * deploy.PORT_TRIES])  # the SuperLink's port, then the SuperNode's
        monkeypatch.setattr(deploy, "free_port", lambda: next(chosen, None) or free())
        tried = ", ".join([f"127.0.0.1:{port}"] * deploy.PORT_TRIES)
        with pytest.raises(FedltError, match=re.escape(f"another program took each port chosen for the SuperNode "
                                                       f"of partition-0 ({tried}) before it could listen")):
            with deploy.local_federation(tmp_path / "federation", nodes=1, startup_s=60):
                pass
    assert deployment_pids(tmp_path / "federation") == []


@pytest.mark.parametrize("taken", ["SuperLink", "SuperNode"])
def test_a_port_taken_before_its_process_binds_it_is_replaced_by_a_fresh_one(tmp_path, monkeypatch, taken):
    """free_port's number is free only until the process binds it: another program that took it first
    ended the deployment (SuperLink) or left a SuperNode exited, its ClientApp process asking that program
    for tasks. Each starts again on a fresh port, and the federation comes up."""
    import socket

    from fedlt import deploy

    free = deploy.free_port
    with socket.socket() as held:
        held.bind((deploy.HOST, 0))
        held.listen()
        port = held.getsockname()[1]
        chosen = iter([port] if taken == "SuperLink" else [free(), port])  # the SuperLink's port comes first
        monkeypatch.setattr(deploy, "free_port", lambda: next(chosen, None) or free())
        with deploy.local_federation(tmp_path / "federation", nodes=1, startup_s=60) as fed:
            asks = _cmdline(fed.workers[0].pid)  # the ClientApp process asks its SuperNode for tasks there
            node_port = int(asks[asks.index("--runtime-api-address") + 1].rsplit(":", 1)[1])
            assert port not in (fed.port, node_port)
            assert deploy._listens(fed.superlink, fed.port) and deploy._listens(fed.nodes[0], node_port)
    assert deployment_pids(tmp_path / "federation") == []

@pytest.mark.parametrize("ends", ["normally", "with an error"])
def test_a_stop_signal_landing_as_the_federation_stops_waits_for_the_clean_up(tmp_path, monkeypatch, ends):
    """A SIGTERM landing at the clean-up's first call, before its mask takes hold, no longer skips the
    clean-up: the deploy command's handler keeps it for after, and raises it there unless an error is on
    its way already (that error says how the run ended)."""
    from fedlt import deploy
    from fedlt.errors import FedltError

    cleaned, sent = [], []
    monkeypatch.setattr(deploy.Federation, "start", lambda self, log, *args: None)  # no SuperLink, no SuperNode
    monkeypatch.setattr(deploy.Federation, "start_node", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(deploy, "_wait_for_port", lambda *args: None)
    monkeypatch.setattr(deploy, "_stop_groups", lambda groups: cleaned.append("groups"))
    monkeypatch.setattr(deploy, "_stop_inheritors", lambda home: cleaned.append("inheritors"))
    mask = signal.pthread_sigmask

    def signal_first(how, signals):
        if how == signal.SIG_BLOCK and not sent:
            sent.append(how)
            signal.raise_signal(signal.SIGTERM)  # its handler runs here, as at the clean-up's first call
        return mask(how, signals)

    monkeypatch.setattr(signal, "pthread_sigmask", signal_first)
    previous = signal.signal(signal.SIGTERM, deploy._raise_stopped)
    try:
        with pytest.raises(deploy.Stopped if ends == "normally" else FedltError) as raised:
            with deploy.local_federation(tmp_path / "federation", nodes=1, startup_s=60):
                if ends != "normally":
                    raise FedltError("the run failed")
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sent and cleaned == ["groups", "inheritors"]
    assert ends != "normally" or raised.value.signum == signal.SIGTERM
    assert deploy._CLEANUP == {"running": 0, "late": None}


def test_the_serverapp_reports_its_outcome_and_resolves_paths_against_the_app(tmp_path, server_identity, monkeypatch):
    """``flwr run`` exits 0 when the ServerApp raises, so the ServerApp itself writes how the run
    ended where fedlt.deploy reads it; relative paths in the run config mean the app's files."""
    from flwr.app import Context, RecordDict

    from fedlt.engine.flower_app import deployed_config, main
    from fedlt.errors import FedltError
    from fedlt.results import OUTCOME_ENV

    app = tmp_path / "app"
    (app / "configs").mkdir(parents=True)
    cfg = tiny(tmp_path, "fedavg", "served", data={"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5,
                                                   "num_clients": 4},
               fl={"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05})
    cfg["run"]["out_dir"] = "runs"
    (app / "configs" / "mine.yaml").write_text(json.dumps(cfg))
    monkeypatch.chdir(tmp_path)  # the SuperLink's working directory: neither config nor runs are here
    resolved = deployed_config({"config": "configs/mine.yaml", "overrides": "fl.rounds=3"}, app)
    assert resolved.fl.rounds == 3 and resolved.run.out_dir == str(app / "runs")
    assert resolved.engine == "flower"  # the engine it runs on, though the file leaves the default

    outcome = tmp_path / "outcome.json"
    monkeypatch.setenv(OUTCOME_ENV, str(outcome))
    context = Context(run_id=1, node_id=0, state=RecordDict(), node_config={},
                      run_config={"config": str(app / "configs" / "mine.yaml"), "overrides": ""})
    from flwr.common.logger import console_handler

    monkeypatch.setattr(console_handler, "colored", True)
    grid = LoopbackGrid(nodes=2)
    main(grid, context)
    assert grid.timeouts == [] and grid.pulls > 0  # a deployed ServerApp polls (poll_replies)
    assert not console_handler.colored  # fedlt deploy relays its log, in colour only to a terminal
    assert json.loads(outcome.read_text()) == {"status": "finished", "run_dir": str(tmp_path / "runs" / "served"),
                                               "rounds_done": 2}
    context.run_config["overrides"] = "run.name=broken"
    with pytest.raises(FedltError, match="a ClientApp failed"):
        main(LoopbackGrid(nodes=2, fail_after_fits=2), context)
    told = json.loads(outcome.read_text())
    assert told["status"] == "aborted" and told["rounds_done"] == 1 and not told["config_error"]
    assert told["reason"] == "a ClientApp failed (fit) on partition-1 (SuperNode 101): ValueError: boom"
    assert json.loads((tmp_path / "runs" / "broken" / "summary.json").read_text())["reason"] == told["reason"]


def test_deploy_refuses_a_config_before_starting_anything_and_pyproject_admits_flwr(tmp_path, capsys):
    import importlib.metadata
    import tomllib

    from packaging.specifiers import SpecifierSet

    from fedlt.deploy import main

    work = tmp_path / "work"
    assert main(["--workdir", str(work), str(ROOT / "configs" / "synthetic_smoke.yaml"), "method=centralized"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedlt: error: method centralized trains on pooled data")
    assert not work.exists()  # no process, no folder

    ours = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"]
    flwr_needs = SpecifierSet(importlib.metadata.metadata("flwr")["Requires-Python"])
    lowest = min(s.version for s in SpecifierSet(ours) if s.operator == ">=")
    assert lowest in flwr_needs, (ours, str(flwr_needs))  # `flwr run .` installs on what pyproject promises


def test_a_signal_while_deploy_checks_its_config_stops_the_deploy(tmp_path, capsys, monkeypatch):
    """A signal landing in code that catches any error (here the check that Flower's run config carries the
    config's path) became that code's failure: exit 2 naming a quote the path does not hold."""
    import signal

    import flwr.common.config

    from fedlt import deploy

    monkeypatch.setattr(flwr.common.config, "parse_config_args",
                        lambda *args, **kwargs: deploy._raise_stopped(signal.SIGINT, None))
    work = tmp_path / "work"
    assert deploy.main(["--workdir", str(work), str(ROOT / "configs" / "synthetic_smoke.yaml")]) == 130
    err = capsys.readouterr().err
    assert err == "fedlt: error: stopped by SIGINT; every process of the federation was stopped\n", err
    assert not work.exists()


def test_a_stop_ends_the_wait_for_supernodes_that_have_not_connected(tmp_path):
    """A simulation's first Ctrl-C asks the ServerApp's thread to stop at its next wait; the wait for
    SuperNodes still missing read no stop and went on for up to flower.connect_timeout_s."""
    import threading

    from fedlt.engine import flower_app

    class NodelessGrid:  # no SuperNode has come yet
        def get_node_ids(self):
            return []

    stop = threading.Event()
    cfg = build_config({**tiny(tmp_path, "fedavg", "waiting"), "engine": "flower",
                        "flower": {"timeout_s": 600, "connect_timeout_s": 40}})
    threading.Timer(1.0, stop.set).start()
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        flower_app.run_on_grid(cfg, NodelessGrid(), quiet=True, stop=stop)
    assert time.monotonic() - started < 30  # not flower.connect_timeout_s


def test_ctrl_c_stops_a_flower_simulation_at_once_and_its_summary_says_so(tmp_path, monkeypatch):
    """Ctrl-C reaches a simulation's main thread (Flower's runtime), not the ServerApp's, which waited
    out flower.timeout_s for replies that no longer came and then recorded the round as dropouts: it
    now stops at its next wait for replies, and the summary says the run was stopped (no dropout).
    Flower's runtime is replaced by its two threads: the ServerApp's on a grid of silent nodes, and
    the main one, interrupted."""
    import json
    import threading

    import flwr.simulation

    from fedlt.engine import flower_app

    class SilentGrid:  # nodes that never answer
        def get_node_ids(self):
            return [1, 2]

        def push_messages(self, messages):
            return [str(i) for i, _ in enumerate(messages)]

        def pull_messages(self, ids):
            return []

    def runtime(server_app, client_app, num_supernodes, backend_config):
        server = threading.Thread(target=server_app._main, args=(SilentGrid(), None))
        server.start()
        wait_for(lambda: (tmp_path / "stopped" / "config.yaml").is_file(), 60, "the ServerApp's run directory")
        started["at"], started["server"] = time.monotonic(), server
        raise KeyboardInterrupt  # what Ctrl-C raises in the main thread; Flower's runtime joins no thread

    from flwr.supercore.task_identity import TaskIdentity

    started: dict = {}
    monkeypatch.setattr(flwr.simulation, "run_simulation", runtime)
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)  # what Flower's runtime sets before messages are made
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    monkeypatch.setitem(__import__("sys").modules, "ray", type("ray", (), {"shutdown": staticmethod(lambda: None)}))
    cfg = build_config({**tiny(tmp_path, "fedavg", "stopped"), "engine": "flower",
                        "flower": {"timeout_s": 600, "connect_timeout_s": 600}})
    with pytest.raises(KeyboardInterrupt):
        flower_app.simulate(cfg, quiet=True)
    assert time.monotonic() - started["at"] < 10 and not started["server"].is_alive()  # not flower.timeout_s
    summary = json.loads((tmp_path / "stopped" / "summary.json").read_text())
    assert summary["status"] == "aborted" and summary["reason"] == "the ServerApp was stopped by a signal"
    assert summary["dropped"] == [] and summary["rounds_done"] == 0


def test_a_signal_while_a_simulation_imports_ray_stops_it_as_an_interrupt(tmp_path, monkeypatch):
    """SIGTERM while Flower's runtime imported Ray: the stop imported Ray again to shut it down, that import
    of a module cut short failed (AttributeError: partially initialized module 'ray'), and the command failed
    with a traceback where it should stop as interrupted."""
    import sys

    import flwr.simulation

    from fedlt.engine import flower_app
    from fedlt.errors import Terminated

    def runtime(*args, **kwargs):
        raise Terminated  # SIGTERM in the main thread, amid the runtime's import of Ray

    monkeypatch.setattr(flwr.simulation, "run_simulation", runtime)
    monkeypatch.setitem(sys.modules, "ray", None)  # not imported: `import ray` fails
    cfg = build_config({**tiny(tmp_path, "fedavg", "cut"), "engine": "flower"})
    with pytest.raises(Terminated):
        flower_app.simulate(cfg, quiet=True)


def test_a_simulation_drops_the_runtime_notices_its_user_cannot_act_on_and_keeps_the_others(tmp_path, monkeypatch):
    """Flower's deprecation of run_simulation and Ray's GPU-masking tip were printed by every simulation;
    Flower's runtime is replaced by one that emits them beside a warning and a log line that must stay."""
    import warnings

    import flwr.simulation
    from flwr.common.logger import log, warn_deprecated_feature

    from fedlt.engine import flower_app

    def runtime(server_app, client_app, num_supernodes, backend_config):
        warn_deprecated_feature("The `run_simulation` function is deprecated and will be removed")
        warnings.warn("Tip: In future versions of Ray, Ray will no longer override accelerator", FutureWarning)
        warnings.warn("a warning of the run", FutureWarning)
        log(logging.WARNING, "a line of Flower's own")
        # a ClientApp that raised a FedltError: fedlt's error line says it; another exception's traceback stays
        log(logging.ERROR, "An exception was raised when processing a message by RayBackend")
        log(logging.ERROR, "ray::ClientAppActor.run()\n  File \"x.py\"\nfedlt.errors.PluginError: S.fit returned dict")
        log(logging.ERROR, "Traceback (most recent call last):\nfedlt.errors.ConfigError: unknown method 'x'")
        log(logging.ERROR, "Traceback (most recent call last):\nZeroDivisionError: division by zero")
        log(logging.ERROR, chained)  # a bug raised while handling a FedltError: its traceback stays
        log(logging.ERROR, "The actor died unexpectedly before finishing this task.\n\tpid: 7\nThe actor is dead "
                           "because its owner has died. Owner Id: 01")  # a client a stop ended

    class Lines(logging.Handler):
        def emit(self, record):
            shown.append(record.getMessage())

    chained = ("ray::ClientAppActor.run()\nfedlt.errors.PluginError: S.fit returned dict\n\nDuring handling of the "
               "above exception, another exception occurred:\n\nKeyError: 'missing'\n\nThe above exception was the "
               "direct cause of the following exception:\n\n    raise ClientAppException(str(ex)) from ex\n"
               "flwr.clientapp.client_app.ClientAppException: \nfedlt.errors.PluginError: quoted later")
    shown: list[str] = []
    monkeypatch.setattr(flwr.simulation, "run_simulation", runtime)
    flower_log = logging.getLogger("flwr")
    before = list(flower_log.filters)
    flower_log.addHandler(lines := Lines())
    try:
        with pytest.raises(FedltError, match="ended without a result"), pytest.warns(FutureWarning) as caught:
            flower_app.simulate(build_config({**tiny(tmp_path, "fedavg", "noticed"), "engine": "flower"}), quiet=True)
    finally:
        flower_log.removeHandler(lines)
    assert [str(w.message) for w in caught] == ["a warning of the run"]
    assert shown == ["a line of Flower's own",
                     "Traceback (most recent call last):\nZeroDivisionError: division by zero", chained]
    assert flower_log.filters == before  # Flower's logger as it was


def test_the_warning_a_client_actor_logs_as_the_simulation_ends_it_is_not_shown():
    """Each simulated client's actor logged `WARNING: Manually terminating ClientAppActor` when a finished
    simulation ended it, and Ray forwarded it to the run's output. The actors import the module that holds
    the ClientApp, which keeps Flower's logger from passing it on; Flower's other warnings still pass."""
    from flwr.simulation.ray_transport.ray_actor import VirtualClientEngineActor

    from fedlt.engine import flower_app

    flower_log = logging.getLogger("flwr")
    assert flower_app.without_termination_notice in flower_log.filters  # on import, as in an actor
    kept: list[str] = []

    class Lines(logging.Handler):
        def emit(self, record):
            kept.append(record.getMessage())

    flower_log.addHandler(lines := Lines())
    try:
        with pytest.raises(TypeError, match="exit_actor"):  # outside an actor, after the notice
            VirtualClientEngineActor.terminate(type("ClientAppActor", (), {})())  # the actor Flower ends
        flower_log.warning("a warning of Flower's own")
    finally:
        flower_log.removeHandler(lines)
    assert kept == ["a warning of Flower's own"]


def test_a_client_apps_failure_is_one_line_without_rays_wrapping():
    """Flower's simulation passes on Ray's report of a failed ClientApp (colour codes, the actor's traceback,
    then the error); the run's error line showed all of it."""
    from fedlt.engine.flower_app import client_failure

    ray = ("<class 'ray.exceptions.RayTaskError(ClientAppException)'>:<'\x1b[36mray::ClientAppActor.run()\x1b[39m "
           "(pid=4242, ip=10.0.0.1)\n  File \"/x/flwr/simulation/ray_transport/ray_actor.py\", line 65, in run\n"
           "    raise ClientAppException(str(ex)) from ex\n\nException ClientAppException occurred. Message: unknown "
           "method 'squeeze'; use method=<one of fedavg, fedprox>'>")  # Flower 1.41 closes its <'...'> wrapping
    assert client_failure(ray) == "unknown method 'squeeze'; use method=<one of fedavg, fedprox>"
    assert client_failure(ray[:-2] + "\n'>") == client_failure(ray[:-2]) == client_failure(ray)
    assert client_failure("Traceback (most recent call last):\n  File \"a.py\", line 1\nValueError: boom\n") == \
        "ValueError: boom"
    assert client_failure("ValueError: boom") == "ValueError: boom" and client_failure("\n") == "no reason given"


def test_sigterm_during_a_flower_simulation_stops_it_as_ctrl_c_does(tmp_path, monkeypatch):
    """ray.init replaces the SIGTERM handler with one that calls sys.exit(15): `fedlt run engine=flower`
    then ended with exit code 15, no line, and Ray left up. It now stops as after Ctrl-C, as Terminated."""
    import flwr.simulation
    import ray

    from fedlt.engine.flower_app import simulate
    from fedlt.errors import Terminated

    shut = []
    monkeypatch.setattr(ray, "shutdown", lambda: shut.append(True))
    cfg = fedlt.load_config(None, ["engine=flower", "data.dataset=synthetic", "data.num_clients=3", "run.threads=1",
                                   f"run.out_dir={tmp_path}"])
    for code, raised in ((signal.SIGTERM, Terminated), (3, SystemExit)):  # another exit is not a signal's: it goes on
        monkeypatch.setattr(flwr.simulation, "run_simulation",
                            lambda *args, code=code, **kwargs: (_ for _ in ()).throw(SystemExit(code)))
        with pytest.raises(raised):
            simulate(cfg, quiet=True)
    assert shut == [True]


def test_a_stopped_simulation_leaves_out_rays_reports_of_the_clients_it_ended(tmp_path, monkeypatch):
    """After a SIGTERM (or a second Ctrl-C), Flower's threads logged an error and Ray's 30-line traceback for
    each client actor that the stop ended ("its owner has died"), below the run's own line on how it goes
    on. Those go, also once the simulation has returned; an actor that died of anything else is still
    reported."""
    import flwr.simulation
    import ray

    from fedlt.engine.flower_app import simulate
    from fedlt.errors import Terminated

    flower_log = logging.getLogger("flwr")
    monkeypatch.setattr(flower_log, "filters", list(flower_log.filters))  # as it was, after the test
    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(flwr.simulation, "run_simulation",
                        lambda *args, **kwargs: (_ for _ in ()).throw(SystemExit(signal.SIGTERM)))
    cfg = fedlt.load_config(None, ["engine=flower", "data.dataset=synthetic", "data.num_clients=3", "run.threads=1",
                                   f"run.out_dir={tmp_path}"])
    with pytest.raises(Terminated):
        simulate(cfg, quiet=True)

    def record(text: str, level: int = logging.ERROR) -> logging.LogRecord:
        return flower_log.makeRecord("flwr", level, __file__, 1, text, None, None)

    died = ("The actor died unexpectedly before finishing this task.\n\tclass_name: ClientAppActor\n\tpid: 12247\n"
            "The actor is dead because its owner has died. Owner Id: 01000000ff Owner worker exit type: "
            "INTENDED_USER_EXIT Worker exit detail: Owner's worker process has crashed.")
    traceback = ("Traceback (most recent call last):\n  File \"ray/_private/worker.py\", line 1025, in get_objects\n"
                 f"    raise value\nray.exceptions.ActorDiedError: {died}")
    assert not flower_log.filter(record(died)) and not flower_log.filter(record(traceback))
    crashed = died.split("The actor is dead")[0] + "The actor is dead because its worker process has died."
    assert flower_log.filter(record(crashed)) and flower_log.filter(record(died, logging.INFO))


def test_a_serverapp_stopped_by_the_deployments_timeout_records_why(tmp_path, monkeypatch):
    """fedlt deploy stops the ServerApp when its --timeout runs out; the aborted summary said only 'a signal'."""
    from fedlt.engine.flower_app import describe_error
    from fedlt.results import STOP_REASON_ENV

    told = tmp_path / "stop-reason.txt"
    monkeypatch.setenv(STOP_REASON_ENV, str(told))
    assert describe_error(KeyboardInterrupt()) == "the ServerApp was stopped by a signal"  # nothing written: a Ctrl-C
    told.write_text("the deployment's --timeout of 40 s ran out")
    assert describe_error(KeyboardInterrupt()) == ("the ServerApp was stopped by a signal: the deployment's --timeout "
                                                   "of 40 s ran out")
    monkeypatch.delenv(STOP_REASON_ENV)
    assert describe_error(SystemExit()) == "the ServerApp was stopped by a signal"


def _interrupted_flower_run(cfg: dict, grid: LoopbackGrid, at: int, monkeypatch) -> tuple[Path, str]:
    """``cfg`` on ``grid``, stopped by Ctrl-C at the start of round ``at``: its folder and the resume hint."""
    from fedlt.engine.flower_app import FlowerSimulation

    original = FlowerSimulation.fit_round
    monkeypatch.setattr(FlowerSimulation, "fit_round", lambda self, rnd: (_ for _ in ()).throw(KeyboardInterrupt)
                        if rnd == at else original(self, rnd))
    with pytest.raises(KeyboardInterrupt) as stop:
        flower_run(cfg, grid)
    monkeypatch.setattr(FlowerSimulation, "fit_round", original)  # not undo(): the server identity stays set
    return Path(cfg["run"]["out_dir"]) / cfg["run"]["name"], stop.value.resume_hint


def _resume_is_refused(cfg: dict, run_dir: Path, nodes: int, message: str) -> None:
    """A resume of ``run_dir`` on new nodes is refused with ``message`` before anything is sent, and the
    folder stays byte for byte as it was."""
    from fedlt.engine.flower_app import run_on_grid
    from fedlt.errors import ConfigError

    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    grid = LoopbackGrid(nodes=nodes)
    with pytest.raises(ConfigError, match=re.escape(message)):
        run_on_grid(build_config(cfg), grid, quiet=True, resume=run_dir)
    assert grid.batches == [] and {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


@pytest.mark.parametrize("method", ["fedavg", "fedavg+secagg", "fedbn"])
def test_a_flower_run_of_stateless_clients_resumes_on_new_nodes_as_if_uninterrupted(tmp_path, server_identity,
                                                                                       monkeypatch, method):
    """A deployment's server that stopped (a crash, a reboot) lost the run: a Flower run could not resume.
    With clients that keep nothing between rounds, new SuperNodes serve the rest of the run from the
    checkpoint, and every metric equals the uninterrupted run's, its comm counts too. FedBN on a model
    without BatchNorm (the small CNN) is such a method: its clients have no BatchNorm to keep."""
    from fedlt.engine.flower_app import run_on_grid
    from fedlt.results import read_summary

    base, extra = method.partition("+")[0], ({"secagg": {"enabled": True}} if "secagg" in method else {})
    fl = {"rounds": 4, "participation": 0.5, "local_epochs": 1, "batch_size": 32, "lr": 0.05}
    run = {"out_dir": str(tmp_path), "checkpoint_every": 2, "threads": 1}
    full = flower_run(tiny(tmp_path, base, "full", fl=fl, run={**run, "name": "full"}, **extra), LoopbackGrid(nodes=2))
    cut = tiny(tmp_path, base, "cut", fl=fl, run={**run, "name": "cut"}, **extra)
    run_dir, hint = _interrupted_flower_run(cut, LoopbackGrid(nodes=2), 4, monkeypatch)
    assert hint == f"`fedlt run --resume {run_dir}` goes on from its checkpoint of round 2"  # not prompted: simulation
    assert read_summary(run_dir)["status"] == "aborted" and read_summary(run_dir)["rounds_done"] == 2
    resumed = run_on_grid(build_config(cut), LoopbackGrid(nodes=3), quiet=True, resume=run_dir)  # other nodes
    assert [{k: v for k, v in m.items() if k != "time_s"} for m in resumed.metrics] == \
        [{k: v for k, v in m.items() if k != "time_s"} for m in full.metrics]
    assert resumed.summary["final"] == full.summary["final"] and "status" not in resumed.summary
    assert [s["from_round"] for s in resumed.summary["segments"]] == [1, 3]


def test_a_flower_run_whose_clients_kept_state_on_their_nodes_is_refused_a_resume(tmp_path, server_identity,
                                                                                   monkeypatch):
    """Ditto's personal models live on the SuperNodes: new nodes would train the clients without them, so the
    resume is refused before anything is sent, with the reason, and the folder stays as it was."""
    from fedlt.errors import ConfigError

    cfg = tiny(tmp_path, "ditto", "cut", fl={"rounds": 3, "participation": 1.0, "local_epochs": 1, "batch_size": 32,
                                             "lr": 0.05}, run={"out_dir": str(tmp_path), "name": "cut",
                                                               "checkpoint_every": 1, "threads": 1})
    cfg["data"]["num_clients"], cfg["engine"] = 3, "flower"  # as the deploy and simulation commands write it
    run_dir, hint = _interrupted_flower_run(cfg, LoopbackGrid(nodes=3), 3, monkeypatch)
    assert hint == (f"{run_dir} cannot resume: clients [0, 1, 2] keep state between rounds on their nodes, which "
                    "SuperNodes started again would lack; start the run again")
    _resume_is_refused(cfg, run_dir, 3, f"clients [0, 1, 2] of {run_dir} kept state between rounds on their nodes "
                                        "(method ditto: ")
    with pytest.raises(ConfigError, match="kept state between rounds"):  # Flower's simulation: before Ray starts
        fedlt.resume(run_dir, quiet=True)


def test_a_stateful_method_whose_state_showing_replies_were_all_lost_is_refused_a_resume(tmp_path, server_identity,
                                                                                        monkeypatch):
    """Whether clients keep state on their nodes was read only from the replies that arrived: where every reply of a
    client that kept state came too late (its node slow), the run was taken as stateless and resumed on new nodes
    without that state. The method's own declaration (``MethodSpec.keeps_state``) is recorded and refuses it;
    here in the form of the ``method_args`` alone, which declarations written before the model was passed have."""
    from fedlt.methods.fedavg import FedAvgClient
    from fedlt.methods.registry import METHODS

    class OddClientsKeep(FedAvgClient):
        """Keeps a count of its rounds on odd clients only, as a method keeps state only where data call for it."""

        def fit(self, ctx, msg):
            if ctx.cid % 2:
                ctx.state["rounds"] = ctx.state.get("rounds", 0) + 1
            return super().fit(ctx, msg)

    monkeypatch.setitem(METHODS, "oddkeeps", dataclasses.replace(METHODS["fedavg"], name="oddkeeps",
                                                                 client=OddClientsKeep, keeps_state=lambda args: True))
    monkeypatch.setattr(METHODS, "in_code_only", lambda name: False)  # the loopback's nodes live in this process
    data = {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 4}
    cfg = tiny(tmp_path, "oddkeeps", "cut", engine="flower", data=data,
               fl={"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
               run={"out_dir": str(tmp_path), "name": "cut", "checkpoint_every": 1, "threads": 1})
    grid = LoopbackGrid(nodes=2, late_after_fits=1)  # node 101, the odd clients', answers too late from round 1
    run_dir, hint = _interrupted_flower_run(cfg, grid, 2, monkeypatch)
    assert [k for k in grid.contexts[101].state if k.endswith("tree")] == ["client1.tree", "client3.tree"]
    assert hint == (f"{run_dir} cannot resume: the clients of method oddkeeps keep state between rounds on their "
                    "nodes, which SuperNodes started again would lack; start the run again")
    _resume_is_refused(cfg, run_dir, 2, f"the clients of {run_dir} kept state between rounds on their nodes "
                                        "(method oddkeeps: ")


def test_every_method_declares_whether_its_clients_keep_state_as_they_do(tmp_path):
    """``MethodSpec.keeps_state`` refuses a Flower resume whatever replies arrived, so it must say what the
    clients do: one round of each method in-process, whose checkpoint holds every client's ``ctx.state``."""
    from fedlt.api import prepare
    from fedlt.docs_ledger import tiny as ledger_tiny
    from fedlt.engine.checkpoint import load_checkpoint
    from fedlt.methods.registry import METHODS, parse_method_args
    from fedlt.results import new_run_dir

    cases = [(name, {}, {}) for name, spec in METHODS.items() if not spec.pooled]
    for name, knobs, top in [*cases, ("fedyoyo", {"prior_source": "counts"}, {}),  # it keeps only its own estimate
                             ("fedbn", {}, {"model": {"name": "resnet8"}})]:  # BatchNorm to keep (the CNN has none)
        spec, tree = METHODS[name], ledger_tiny(name, tmp_path)
        tree["method_args"].update(knobs)
        tree.update(top)
        tree["fl"]["rounds"], tree["run"]["name"] = 1, f"{name}{len(knobs)}{len(top)}"
        sim = prepare(build_config(tree))
        kept = bool(load_checkpoint(sim.run(new_run_dir(sim.cfg), quiet=True).run_dir, "cpu")["clients"])
        assert spec.clients_keep_state(parse_method_args(spec, tree["method_args"]), sim.server_model) == kept, name


def test_ctrl_c_in_a_flower_simulation_names_how_its_run_goes_on(tmp_path, monkeypatch):
    """Ctrl-C reaches the main thread while the ServerApp's thread runs the rounds: the interrupt the command
    reported was the main thread's, without the run's resume hint, so it said there was nothing to resume."""
    import threading

    import flwr.simulation
    import ray

    import fedlt.engine.flower_app as flower_app

    monkeypatch.setattr(ray, "shutdown", lambda: None)

    entered = threading.Event()

    def rounds(cfg, grid, quiet, stop, resume, on_start):  # the ServerApp's thread: stopped at its next wait
        entered.set()
        stop.wait(30)
        interrupted = KeyboardInterrupt()
        interrupted.resume_hint = "RUN_DIR goes on from its checkpoint of round 2"
        raise interrupted

    def run_simulation(app, clientapp, **kwargs):  # Flower's runtime: the app in a thread, Ctrl-C in this one
        threading.Thread(target=app, args=(None, None), daemon=True).start()
        entered.wait(30)  # the rounds are under way
        raise KeyboardInterrupt

    monkeypatch.setattr(flower_app, "run_on_grid", rounds)
    monkeypatch.setattr(flwr.simulation, "run_simulation", run_simulation)
    cfg = fedlt.load_config(None, ["engine=flower", "data.dataset=synthetic", "data.num_clients=3", "run.threads=1",
                                   f"run.out_dir={tmp_path}"])
    with pytest.raises(KeyboardInterrupt) as stop:
        flower_app.simulate(cfg, quiet=True)
    assert stop.value.resume_hint == "RUN_DIR goes on from its checkpoint of round 2"


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_lets_flower_end_a_simulation_as_after_a_run_and_twice_stops_at_once(tmp_path, monkeypatch, capsys,
                                                                                     presses):
    """Ctrl-C raised in the main thread, where Flower waits for its client threads, had Flower shut Ray down
    under those threads' calls, and Ray now and then ended the process (exit code 1, no resume line). The
    first Ctrl-C now asks the ServerApp's thread to stop at its next wait for replies and lets Flower's
    runtime end as after a run; a second stops at once. Either way the run stops with how it goes on."""
    import threading

    import flwr.simulation
    import ray

    import fedlt.engine.flower_app as flower_app

    monkeypatch.setattr(ray, "shutdown", lambda: None)
    entered, runtime = threading.Event(), {}

    def rounds(cfg, grid, quiet, stop, resume, on_start):  # the ServerApp's thread, waiting for replies
        entered.set()
        assert stop.wait(30)
        interrupted = KeyboardInterrupt()
        interrupted.resume_hint = "RUN_DIR goes on from its checkpoint of round 2"
        raise interrupted

    def run_simulation(app, clientapp, **kwargs):  # Flower's runtime: the app in a thread, joined
        server = threading.Thread(target=app, args=(None, None), daemon=True)
        server.start()
        entered.wait(30)
        for _ in range(presses):
            signal.raise_signal(signal.SIGINT)
        server.join(30)
        runtime["ended"] = True  # as after a run: its threads joined, then Ray shut down

    monkeypatch.setattr(flower_app, "run_on_grid", rounds)
    monkeypatch.setattr(flwr.simulation, "run_simulation", run_simulation)
    cfg = fedlt.load_config(None, ["engine=flower", "data.dataset=synthetic", "data.num_clients=3", "run.threads=1",
                                   f"run.out_dir={tmp_path}"])
    handler = signal.getsignal(signal.SIGINT)
    with pytest.raises(KeyboardInterrupt) as stop:
        flower_app.simulate(cfg)
    assert stop.value.resume_hint == "RUN_DIR goes on from its checkpoint of round 2"
    assert runtime.get("ended", False) is (presses == 1) and signal.getsignal(signal.SIGINT) is handler
    assert capsys.readouterr().err == ("fedlt: stopping at the next wait for the clients' replies, once those "
                                       "training now have answered; Ctrl-C again stops at once\n")


@pytest.mark.parametrize("ends", ["finished", "busy"])
def test_ctrl_c_while_a_simulations_server_computes_names_the_folders_checkpoint_or_its_result(tmp_path, monkeypatch,
                                                                                               ends):
    """The ServerApp's thread reads a stop only while it waits for replies: stopped while it computed (an
    evaluation, the summary) past the wait for it, the command said there was nothing to resume, beside a
    checkpoint; stopped as the run ended, it said so of a finished run. The folder's checkpoint now names
    the resume, and a run that finished meanwhile is its result."""
    import threading
    from types import MethodType, SimpleNamespace

    import flwr.simulation
    import ray

    import fedlt.engine.flower_app as flower_app

    monkeypatch.setattr(ray, "shutdown", lambda: None)
    monkeypatch.setattr(flower_app, "STOP_WAIT_S", 2.0)
    cfg = fedlt.load_config(None, ["engine=flower", "data.dataset=synthetic", "data.num_clients=3", "run.threads=1",
                                   f"run.out_dir={tmp_path}"])
    run_dir, entered, done = tmp_path / "r", threading.Event(), threading.Event()
    sim = SimpleNamespace(kept_state={}, keeps_state=False, prompt=None, cfg=cfg)
    sim._resume_hint = MethodType(flower_app.FlowerSimulation._resume_hint, sim)
    monkeypatch.setattr(flower_app, "resume_point", lambda folder: ({}, 3) if folder == run_dir else None)

    def rounds(cfg, grid, quiet, stop, resume, on_start):  # the ServerApp's thread, computing when stopped
        on_start(sim, run_dir)
        entered.set()
        if ends == "busy":
            done.wait(30)
        return "the run's result"

    def run_simulation(app, clientapp, **kwargs):
        threading.Thread(target=app, args=(None, None), daemon=True).start()
        entered.wait(30)
        raise KeyboardInterrupt

    monkeypatch.setattr(flower_app, "run_on_grid", rounds)
    monkeypatch.setattr(flwr.simulation, "run_simulation", run_simulation)
    try:
        if ends == "finished":
            assert flower_app.simulate(cfg, quiet=True) == "the run's result"
            return
        with pytest.raises(KeyboardInterrupt) as stop:
            flower_app.simulate(cfg, quiet=True)
        assert stop.value.resume_hint == f"`fedlt run --resume {run_dir}` goes on from its checkpoint of round 3"
    finally:
        done.set()


def test_a_resume_that_stops_before_it_trains_leaves_the_runs_folder_as_it_was(tmp_path, server_identity):
    """A resume whose nodes do not all come, or of a folder another process is writing (a second resume), wrote
    an aborted summary over the folder's own: a finished run read as aborted, a stopped one lost why it stopped."""
    import subprocess
    import sys

    from fedlt.engine.flower_app import run_on_grid
    from fedlt.errors import ConfigError, FedltError

    cfg = tiny(tmp_path, "fedavg", "done", run={"out_dir": str(tmp_path), "name": "done", "checkpoint_every": 1,
                                                "threads": 1}, flower={"connect_timeout_s": 1})
    done = flower_run(cfg, LoopbackGrid(nodes=2))
    before = {p.name: p.read_bytes() for p in done.run_dir.iterdir()}
    grid = LoopbackGrid(nodes=3)
    grid.left.add(102)  # partition 2's SuperNode never comes
    with pytest.raises(FedltError, match="only partitions"):
        run_on_grid(build_config(cfg), grid, quiet=True, resume=done.run_dir)
    assert {p.name: p.read_bytes() for p in done.run_dir.iterdir()} == before
    hold = ("import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_EX); "
            "print('held', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", hold, str(done.run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "held"
        grid = LoopbackGrid(nodes=2)
        with pytest.raises(ConfigError, match="is being written by another fedlt process"):
            run_on_grid(build_config(cfg), grid, quiet=True, resume=done.run_dir)
    finally:
        other.kill()
        other.wait()
    assert grid.batches == [] and {p.name: p.read_bytes() for p in done.run_dir.iterdir()} == before


def test_a_deployed_run_is_resumed_on_a_deployment_not_on_flowers_simulation(tmp_path, server_identity, monkeypatch):
    """`fedlt run --resume` of a deployed run went on with Ray's virtual nodes where the user ran real ones; it is
    refused naming fedlt deploy --resume, while the deployment's own resume takes it."""
    from fedlt.engine.flower_app import FlowerSimulation, run_on_grid
    from fedlt.errors import ConfigError

    cfg = tiny(tmp_path, "fedavg", "deployed", engine="flower", run={"out_dir": str(tmp_path), "name": "deployed",
                                                                     "checkpoint_every": 1, "threads": 1})
    original = FlowerSimulation.fit_round
    monkeypatch.setattr(FlowerSimulation, "fit_round", lambda self, rnd: (_ for _ in ()).throw(KeyboardInterrupt)
                        if rnd == 2 else original(self, rnd))
    with pytest.raises(KeyboardInterrupt) as stop:
        run_on_grid(build_config(cfg), LoopbackGrid(nodes=2), quiet=True, prompt=True)  # as the deployed ServerApp
    monkeypatch.setattr(FlowerSimulation, "fit_round", original)
    run_dir = tmp_path / "deployed"
    assert stop.value.resume_hint == (f"`fedlt deploy --resume {run_dir}` with the same options goes on from its "
                                      "checkpoint of round 1")
    with pytest.raises(ConfigError, match=re.escape(f"{run_dir} ran on a deployment's SuperNodes; resume it there, "
                                                    f"with fedlt deploy --resume {run_dir}")):
        fedlt.resume(run_dir, quiet=True)
    assert run_on_grid(build_config(cfg), LoopbackGrid(nodes=2), quiet=True, prompt=True,
                       resume=run_dir).summary["final"]["round"] == 2
