"""The Flower engine: lossless encoding, equivalence with the in-process engine (Flower's
simulation engine), and a real SuperLink with SuperNodes on 127.0.0.1, one of which dies."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"
os.environ["FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION"] = "1"

import fedlt  # noqa: E402
from fedlt.config import build_config  # noqa: E402
from fedlt.engine.flower_codec import decode_reply, encode_message, get_tree, put_tree  # noqa: E402
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


class LoopbackGrid:
    """A Flower Grid in this process: each node is a Context handed to the real ClientApp
    handler; nodes in ``dead`` stay registered but never answer (as after a crash, until the
    SuperLink's heartbeat gives up)."""

    def __init__(self, nodes: int, die_after_fits: int | None = None, leave_after_fits: int | None = None,
                 fail_after_fits: int | None = None):
        from flwr.app import Context, RecordDict

        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i, state=RecordDict(), run_config={},
                                          node_config={"partition-id": i, "num-partitions": nodes})
                         for i in range(nodes)}
        self.dead: set[int] = set()
        self.fits, self.die_after_fits = 0, die_after_fits
        self.leave_after_fits, self.fail_after_fits = leave_after_fits, fail_after_fits
        self.left: set[int] = set()
        self.batches: list[tuple[str, list[int]]] = []  # (message type, nodes) of every send
        self.timeouts: list[float] = []

    def get_node_ids(self):
        return [n for n in self.contexts if n not in self.left]

    def send_and_receive(self, messages, *, timeout):
        from fedlt.engine.flower_app import handle

        self.timeouts.append(timeout)
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode

        messages = list(messages)
        if messages and messages[0].metadata.message_type == "train":
            self.fits += 1
            if self.fits == self.die_after_fits:
                self.dead.add(max(self.contexts))
            if self.fits == self.leave_after_fits:  # de-registered after this phase (heartbeat expired)
                self.left.add(max(self.contexts))
        if messages:
            self.batches.append((messages[0].metadata.message_type, [m.metadata.dst_node_id for m in messages]))
        out = []
        for m in messages:
            node = m.metadata.dst_node_id
            if node in self.dead:
                continue
            if self.fits == self.fail_after_fits and node == max(self.contexts):
                out.append(Message(error=Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "ValueError: boom"), reply_to=m))
            else:
                out.append(handle(m, self.contexts[node]))
        return out


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
    from fedlt.errors import FedltError

    data = {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 4}
    fl = {"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05}
    res = flower_run(tiny(tmp_path, "fedavg", "drop", data=data, fl=fl), LoopbackGrid(nodes=2, die_after_fits=2))
    assert res.metrics[0]["dropped"] == []
    assert res.metrics[1]["dropped"] == [{"round": 2, "kind": "fit", "clients": [1, 3]}]
    assert res.summary["dropped"] == res.metrics[1]["dropped"] and res.summary["final"]["round"] == 2
    assert res.summary["final"]["server_metrics"] == {}  # dropouts are the engine's record, not a method metric
    with pytest.raises(FedltError, match=r"round 2 \(fit\): 2 of 4 clients answered within flower.timeout_s=600, "
                                         r"fewer than flower.min_reply_fraction=0.75 requires"):
        flower_run(tiny(tmp_path, "fedavg", "strict", data=data, fl=fl, flower={"min_reply_fraction": 0.75}),
                   LoopbackGrid(nodes=2, die_after_fits=2))


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
    assert res.metrics[0]["dropped"] == [{"round": 1, "kind": "evaluate", "clients": [1, 3]}]
    assert {d["kind"] for d in res.summary["dropped"]} == {"evaluate", "fit"}
    with pytest.raises(FedltError, match=r"a ClientApp failed \(fit\) on node 101: ValueError: boom"):
        flower_run(tiny(tmp_path, "fedavg", "fails", data=data, fl=fl), LoopbackGrid(nodes=2, fail_after_fits=2))


def test_engine_flower_refuses_what_it_cannot_do(tmp_path):
    from fedlt.errors import ConfigError

    with pytest.raises(ConfigError, match="pooled data; run it with engine=inprocess"):
        fedlt.run(tiny(tmp_path, "centralized", "c", engine="flower"), quiet=True)
    with pytest.raises(ConfigError, match=r"invalid config value flower.min_reply_fraction: must be in \(0, 1\]"):
        build_config({"flower": {"min_reply_fraction": 0}})


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="process bookkeeping reads /proc")
def test_deployment_over_tls_survives_a_supernode_killed_mid_run(tmp_path):
    """A real SuperLink and 3 SuperNodes on 127.0.0.1 with TLS run 2 rounds of FedAvg on 3 clients
    (one per node). Round 1 equals the in-process run; SuperNode 2 is killed once round 1 is
    written, round 2 goes on with the other two and records client 2 as dropped; afterwards no
    process the test started is alive."""
    import shutil
    import threading

    from fedlt.deploy import _alive, local_federation

    if shutil.which("openssl") is None:
        pytest.skip("needs openssl for the TLS certificates")
    cfg = tiny(tmp_path, "fedavg", "deployed", data={"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5,
                                                     "num_clients": 3},
               fl={"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
               flower={"timeout_s": 150, "min_reply_fraction": 0.5})
    config = tmp_path / "deployed.yaml"
    config.write_text(json.dumps(cfg))  # JSON is YAML
    local = fedlt.run(tiny(tmp_path, "fedavg", "local", data=cfg["data"], fl=cfg["fl"]), quiet=True)

    started: list[int] = []
    done: dict = {}
    metrics = tmp_path / "deployed" / "metrics.jsonl"
    with local_federation(tmp_path / "federation", nodes=3, tls=True) as fed:
        started += [fed.superlink.pid, *(n.pid for n in fed.nodes)]
        runner = threading.Thread(target=lambda: done.update(result=fed.run(config, [], timeout=480)), daemon=True)
        runner.start()
        deadline = time.monotonic() + 300
        while not (metrics.is_file() and metrics.read_text().strip()) and runner.is_alive():
            assert time.monotonic() < deadline, "round 1 did not finish in 300 s"
            time.sleep(0.5)
        fed.kill_node(2)
        assert not _alive(started[-1])
        runner.join(500)
        assert not runner.is_alive()
        assert (tmp_path / "federation" / "certs" / "server.pem").is_file()
    assert not any(_alive(pid) for pid in started)
    logs = done["result"].stdout + done["result"].stderr
    summary_file = tmp_path / "deployed" / "summary.json"
    assert summary_file.is_file(), logs[-3000:]
    summary = json.loads(summary_file.read_text())
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert rows[0]["dropped"] == [] and rows[0]["acc"] == local.metrics[0]["acc"]
    assert rows[0]["train_loss"] == local.metrics[0]["train_loss"]
    assert rows[1]["dropped"] == [{"round": 2, "kind": "fit", "clients": [2]}]
    assert summary["dropped"] == rows[1]["dropped"] and summary["engine"] == "flower"
    assert summary["final"]["round"] == 2 and summary["final"]["acc"] is not None
    assert (tmp_path / "deployed" / "partition.json").read_text() == (local.run_dir / "partition.json").read_text()
