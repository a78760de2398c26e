"""Secure aggregation (SecAgg+): the server gets the sum and nothing else, the masks cancel, and
dropouts between the stages are recovered from Shamir shares — in-process and over Flower."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

pytest.importorskip("flwr")
os.environ["FLWR_TELEMETRY_ENABLED"] = "0"

import fedlt  # noqa: E402
from fedlt.api import prepare  # noqa: E402
from fedlt.config import SecAggConfig, build_config  # noqa: E402
from fedlt.engine.secure_aggregation import (  # noqa: E402
    AGGREGATE, ENTRY, SecureAggregation, client_step, connected, mask_reply, neighbour_groups,
)
from fedlt.errors import FedltError  # noqa: E402
from fedlt.messages import Message, Reply  # noqa: E402
from fedlt.methods.registry import get_method  # noqa: E402
from test_flower import LoopbackGrid, flower_run, tiny  # noqa: E402

CPU = torch.device("cpu")
#: secure vs plain runs, percentage points of accuracy: the secure aggregate is the plain one
#: rounded to fixed point (2^-24, on every CPU), a perturbation the size of float32 rounding; after
#: two rounds the clients' mean training losses are <= 1.2e-7 apart (measured with AVX2 kernels and
#: with ATEN_CPU_CAPABILITY=default), and only a test sample whose top two logits nearly tie can
#: flip (measured: none with AVX2, one local test sample = 0.31 points of PM accuracy with the
#: default kernels). 1 point allows a few such flips on any CPU; a phase aggregated wrongly costs tens.
FLIPS = 1.0


class Clients:
    """A transport to clients with fixed replies; ``drop[kind]`` never answer that exchange."""

    def __init__(self, replies: dict[int, Reply], drop: dict[str, set[int]] | None = None):
        self.replies, self.drop = replies, drop or {}
        self.states: dict[int, dict] = {}
        self.uploads: dict[int, np.ndarray] = {}

    def __call__(self, kind: str, rnd: int, items: list[tuple[int, Message]]) -> dict[int, Reply]:
        out = {}
        for cid, msg in items:
            if cid in self.drop.get(kind, set()):
                continue
            state = self.states.setdefault(cid, {})
            if kind.startswith("secagg:"):
                out[cid] = client_step(kind, cid, msg, state)
            else:
                out[cid] = mask_reply(cid, self.replies[cid], msg.payload[ENTRY], state)
                self.uploads[cid] = out[cid].payload["masked"]
        return out


def replies(n: int, seed: int = 0) -> dict[int, Reply]:
    g = torch.Generator().manual_seed(seed)
    return {c: Reply(weights={"w": torch.randn(3, 4, generator=g), "steps": torch.tensor(c + 1)},
                     num_samples=10 * (c + 1), payload={"counts": torch.arange(5, dtype=torch.float64) * c},
                     metrics={"train_loss": float(c)}) for c in range(n)}


def secure(mode: str = "weighted_mean", **cfg) -> SecureAggregation:
    return SecureAggregation(SecAggConfig(enabled=True, **cfg), {"phase": mode}, seed=0, device=CPU)


def test_the_server_gets_exactly_the_weighted_mean_and_every_upload_looks_random():
    data = replies(5)
    clients = Clients(data)
    (cid, agg), = secure().exchange(clients, "phase", 1, [(c, Message()) for c in data]).items()
    n = torch.tensor([r.num_samples for r in data.values()], dtype=torch.float64)
    expected = sum(r.weights["w"].double() * r.num_samples for r in data.values()) / n.sum()
    assert cid == AGGREGATE and agg.num_samples == int(n.sum()) == 150
    assert agg.weights["w"].dtype == torch.float32
    assert torch.allclose(agg.weights["w"].double(), expected, atol=1e-6)
    assert agg.weights["steps"].dtype == torch.int64  # integer entries come back rounded, as FedAvg's
    assert agg.metrics["train_loss"] == pytest.approx(float((n * torch.arange(5)).sum() / n.sum()), abs=1e-6)
    # what a client uploads: uniform 64-bit noise, far from its fixed-point values (< 2^32 here)
    for upload in clients.uploads.values():
        assert upload.dtype == np.uint64 and np.median(np.abs(upload.view(np.int64).astype(float))) > 2.0 ** 58
    assert all(state == {} for state in clients.states.values())  # secrets dropped after unmasking


def test_dropouts_after_sharing_keys_are_unmasked_from_shares_on_a_secagg_plus_ring():
    data = replies(7, seed=1)
    # client 2 drops before sharing keys, 4 after sharing them (its pairwise masks must be removed)
    clients = Clients(data, drop={"secagg:shares": {2}, "phase": {4}})
    agg = secure("sum", neighbours=5).exchange(clients, "phase", 1, [(c, Message()) for c in data])[AGGREGATE]
    survivors = [0, 1, 3, 5, 6]
    assert sorted(clients.uploads) == survivors
    assert torch.allclose(agg.weights["w"], sum(data[c].weights["w"] for c in survivors), atol=1e-5)
    assert torch.equal(agg.payload["counts"], sum(data[c].payload["counts"] for c in survivors))
    assert agg.num_samples == sum(data[c].num_samples for c in survivors)


def test_neighbour_groups_are_symmetric_rings_of_the_requested_size():
    rng = np.random.default_rng(0)
    groups = neighbour_groups(list(range(9)), 5, rng)
    assert all(len(g) == 5 and c in g for c, g in groups.items())
    assert all(c in groups[j] for c, g in groups.items() for j in g)
    assert neighbour_groups([3, 5], 5, rng) == {3: [3, 5], 5: [3, 5]}
    # a ring 0-1-2-3-0: without 1 and 3, clients 0 and 2 share no mask (each sum would be revealed)
    ring = {0: [3, 0, 1], 1: [0, 1, 2], 2: [1, 2, 3], 3: [2, 3, 0]}
    assert connected({0, 1, 2}, ring) and not connected({0, 2}, ring)


def test_what_secure_aggregation_refuses():
    data = replies(4)
    with pytest.raises(FedltError, match=r"round 1 \(phase\): 3 of the 4 shares needed to unmask client 0 can arrive"):
        secure(threshold=1.0).exchange(Clients(data, drop={"phase": {3}}), "phase", 1,
                                       [(c, Message()) for c in data])
    odd = dict(data)
    odd[1] = Reply(weights={"w": torch.zeros(2)}, num_samples=5)
    with pytest.raises(FedltError, match="differ in entries or shapes"):
        secure().exchange(Clients(odd), "phase", 1, [(c, Message()) for c in odd])
    huge = {c: Reply(payload={"x": torch.tensor([1e12])}, num_samples=1) for c in range(2)}
    with pytest.raises(FedltError, match=r"beyond the .* secagg.fraction_bits=24 allows for 2 clients"):
        secure("sum").exchange(Clients(huge), "phase", 1, [(c, Message()) for c in huge])
    nan = {c: Reply(weights={"w": torch.zeros(3)}, metrics={"a": 1.0, "b": float("nan")}, num_samples=1)
           for c in range(2)}  # not a precision setting: lowering fraction_bits would never help
    with pytest.raises(FedltError, match=r"client 0's reply metrics entry 'b' is not finite \(nan\), which no masked "
                                         r"sum can carry: its local training diverged; lower fl.lr"):
        secure("sum").exchange(Clients(nan), "phase", 1, [(c, Message()) for c in nan])
    text = {c: Reply(payload={"name": "x"}, num_samples=1) for c in range(2)}
    with pytest.raises(FedltError, match="payload entry 'name' is a str"):
        secure("sum").exchange(Clients(text), "phase", 1, [(c, Message()) for c in text])
    with pytest.raises(FedltError, match="needs at least 2 clients"):
        secure().exchange(Clients(data), "phase", 1, [(0, Message())])
    with pytest.raises(FedltError, match=r"1 client\(s\) answered the key exchange; secure aggregation needs at least 2"):
        secure().exchange(Clients(data, drop={"secagg:keys": {1, 2, 3}}), "phase", 1, [(c, Message()) for c in data])


def test_a_client_uploads_once_per_key_set_and_unmasks_only_what_it_may():
    data = replies(3)
    clients = Clients(data)
    state: dict = {}
    keys = {c: client_step("secagg:keys", c, Message(), clients.states.setdefault(c, {})) for c in data}
    group = {c: [keys[c].payload["pk_c"], keys[c].payload["pk_s"]] for c in data}
    shares = {c: client_step("secagg:shares", c, Message(payload={"t": 2, "group": group}), clients.states[c])
              for c in data}
    spec = {"mode": "sum", "bits": 24, "clients": 3, "cts": {c: shares[c].payload["cts"][0] for c in data}}
    mask_reply(0, data[0], spec, clients.states[0])
    with pytest.raises(FedltError, match="client 0 refuses to upload: it already did"):
        mask_reply(0, data[0], spec, clients.states[0])
    with pytest.raises(FedltError, match="both secrets of clients \\[1\\]"):
        client_step("secagg:unmask", 0, Message(payload={"alive": [0, 1], "dropped": [1]}), clients.states[0])
    with pytest.raises(FedltError, match="client 1 refuses to unmask: it uploaded nothing"):
        client_step("secagg:unmask", 1, Message(payload={"alive": [0, 1, 2], "dropped": []}), clients.states[1])
    with pytest.raises(FedltError, match="refuses to share its keys"):
        client_step("secagg:shares", 2, Message(payload={"t": 1, "group": group}), state | {ENTRY: {"sk_c": "", "sk_s": "", "seed": ""}})


def test_secure_fedavg_matches_plain_fedavg_and_its_server_never_sees_a_client_reply(tmp_path, monkeypatch):
    from fedlt.methods.base import Server

    seen: list[list[int]] = []
    original = Server.aggregate  # FedAvg's
    monkeypatch.setattr(Server, "aggregate", lambda self, rnd, r: (seen.append(sorted(r)), original(self, rnd, r))[1])
    loss = {"name": "bsm", "prior": "global"}  # adds a summed query (the global class counts)
    plain = fedlt.run(tiny(tmp_path, "fedavg", "plain", loss=loss), quiet=True)
    seen.clear()
    sim = prepare(build_config(tiny(tmp_path, "fedavg", "secure", loss=loss, secagg={"enabled": True})))
    from fedlt.results import new_run_dir

    sec = sim.run(new_run_dir(sim.cfg), quiet=True)
    assert seen == [[AGGREGATE], [AGGREGATE]]
    assert torch.equal(sim.server.global_counts.cpu(), torch.as_tensor(sim.eval_data.train_counts).to(torch.int64))
    for a, b in zip(plain.metrics, sec.metrics):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-6)
        assert b["acc"] == pytest.approx(a["acc"], abs=FLIPS)
        assert b["comm"]["up_model"] == 0 and b["comm"]["up_payload"] > a["comm"]["up_model"]
    assert sec.summary["secure_aggregation"]["phases"] == {"fit": "weighted_mean", "query:class_counts": "sum"}
    assert sec.summary["secure_aggregation"]["in_clear"] == []
    fit = sec.summary["messages"]["fit"]["from_client"]
    assert sorted(fit["payload"]) == ["masked", "schema"] and fit["model_bytes"] == 0 and fit["metrics"] == []
    # the record names everything the masked vector sums: the model, the metrics and the sample count
    model = [f"weights/{key} {list(value.shape)}" for key, value in sorted(sim.server.model.state_dict().items())]
    assert fit["secure_sum_of"] == [*model, "metrics/steps []", "metrics/train_loss []", "num_samples []"]
    assert sec.summary["messages"]["query:class_counts"]["from_client"]["secure_sum_of"] == [
        "payload/class_counts [10]", "num_samples []"]


def test_the_raw_feature_oracle_is_refused_under_secure_aggregation(tmp_path):
    from fedlt.errors import ConfigError

    with pytest.raises(ConfigError, match="calibration oracle uploads real features"):
        fedlt.run(tiny(tmp_path, "ccvr", "oracle", calibration=["oracle"], secagg={"enabled": True}), quiet=True)


def test_a_calibration_that_reads_fit_replies_is_named_as_what_secure_aggregation_refuses():
    """CReFF's calibration reads each client's per-class gradients: the refusal names it, not the method it
    was added to; CReFF the method (FedAvg + its calibration) is refused as a method."""
    from fedlt.config import load_config
    from fedlt.errors import ConfigError
    from fedlt.run_parts import check_config

    base = ["data.dataset=synthetic", "data.num_clients=6", "fl.participation=0.5", "secagg.enabled=true"]
    for method in ("fedavg", "sfd", "ccvr"):
        with pytest.raises(ConfigError) as info:
            check_config(load_config(None, [*base, f"method={method}", "calibration=creff"]))
        message = str(info.value)
        assert message.startswith("secagg.enabled: calibration=creff reads each client's fit reply"), message
        assert "drop creff from calibration" in message and "secagg.enabled=false" in message
        assert f"method {method}" not in message
    with pytest.raises(ConfigError, match="method creff's server reads each client's fit reply"):
        check_config(load_config(None, [*base, "method=creff", "calibration=ccvr"]))
    for name in ("ccvr", "fedncm", "fed3r", "taunorm", "safs"):  # they only sum statistics
        check_config(load_config(None, [*base, "method=fedavg", f"calibration={name}"]))


def test_secure_sfd_aggregates_its_statistics_and_matches_the_plain_run(tmp_path):
    extra = {"calibration_args": {"safs_max_per_class": 100, "safs_min_per_class": 50, "safs_steps": 5,
                                  "safs_rff_dim": 50, "safs_finetune_epochs": 1}}
    plain = fedlt.run(tiny(tmp_path, "sfd", "plain", **extra), quiet=True)
    sec = fedlt.run(tiny(tmp_path, "sfd", "secure", secagg={"enabled": True, "neighbours": 3}, **extra), quiet=True)
    assert sec.summary["secure_aggregation"]["phases"] == {"fit": "weighted_mean", "query:calibration_stats": "sum"}
    assert "query:calibration_stats" in sec.summary["messages"]
    assert sec.summary["final"]["acc"] == pytest.approx(plain.summary["final"]["acc"], abs=FLIPS)
    unc = [r["final"]["variants"]["uncalibrated"]["acc"] for r in (plain.summary, sec.summary)]
    assert unc[1] == pytest.approx(unc[0], abs=FLIPS)


SECURE_METHODS = ["fedprox", "fedlc", "feddecorr", "fedavgm", "fedloge", "fedetf", "fedbabu", "fedrod", "fedrep",
                  "fedper", "ditto", "fedbn", "ccvr", "fedncm", "fed3r", "taunorm"]  # fedavg and sfd: above


#: the methods' own steps outside federated training, made short: aggregation is what is compared. FedDecorr's
#: default (released) term divides by each feature's batch deviation, which for the tiny model's near-dead
#: units amplifies the fixed point's 2^-24 to ~2e-4 of train loss within one round; the formula's term,
#: N times weaker, keeps it at ~1e-6, so the comparison of the aggregation stays sharp
CHEAP_ARGS = {"fedloge": {"sse_steps": 50}, "fedetf": {"adapt_iterations": 1, "adapt_epochs": 1},
              "fedbabu": {"finetune_epochs": 1}, "fedrep": {"head_epochs": 2}, "feddecorr": {"normalization": "paper"}}


@pytest.mark.parametrize("method", SECURE_METHODS)
def test_every_method_that_accepts_secure_aggregation_matches_its_plain_run(tmp_path, method):
    args = {"method_args": CHEAP_ARGS[method]} if method in CHEAP_ARGS else {}
    plain = fedlt.run(tiny(tmp_path, method, "plain", **args), quiet=True)
    sec = fedlt.run(tiny(tmp_path, method, "secure", secagg={"enabled": True}, **args), quiet=True)
    assert sec.summary["secure_aggregation"]["phases"]["fit"] == "weighted_mean"
    personalized = get_method(method).client.personalized  # a personal model per client: `evaluate` messages
    # only the personalized evaluation (a measurement of the simulation) stays in the clear
    assert sec.summary["secure_aggregation"]["in_clear"] == (["evaluate"] if personalized else [])
    for a, b in zip(plain.metrics, sec.metrics):
        assert b["train_loss"] == pytest.approx(a["train_loss"], abs=1e-4)
    for key in ("acc", "pm_acc"):
        if plain.summary["final"].get(key) is not None:
            assert sec.summary["final"][key] == pytest.approx(plain.summary["final"][key], abs=FLIPS), key


def test_flower_secure_aggregation_survives_a_supernode_dying_between_stages(tmp_path, monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)
    data = {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 4}
    fl = {"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05}
    cfg = tiny(tmp_path, "fedavg", "flower-secure", data=data, fl=fl, secagg={"enabled": True})
    local = fedlt.run({**cfg, "run": {**cfg["run"], "name": "local-secure"}}, quiet=True)
    # node 101 (clients 1 and 3) shares its keys in round 2, then dies before the masked fit
    res = flower_run(cfg, LoopbackGrid(nodes=2, die_after_fits=2))
    # both secure, both in this process (the grid is a loopback): the same arithmetic, bit for bit
    assert res.metrics[0]["train_loss"] == local.metrics[0]["train_loss"]
    assert res.metrics[1]["dropped"] == [{"round": 2, "kind": "fit", "clients": [1, 3], "cause": "timeout"}]
    assert res.summary["final"]["round"] == 2 and res.summary["secure_aggregation"]["in_clear"] == []


def test_engines_benchmark_reports_the_cost_of_secure_aggregation(tmp_path, monkeypatch):
    import tempfile

    from fedlt.bench.engines import run_engine_bench
    from fedlt.errors import ConfigError, FedltError

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the runs' scratch folder goes here
    progress = []
    text = run_engine_bench("configs/synthetic_smoke.yaml", ["fl.rounds=1", "data.num_clients=4", "run.threads=1"],
                            engines=("inprocess",), secagg=True, echo=progress.append)
    assert [line.split(" done in ")[0] for line in progress] == [
        "fedlt bench engines: inprocess, 1 round(s) ...", "fedlt bench engines: inprocess",
        "fedlt bench engines: inprocess + secagg, 1 round(s) ...", "fedlt bench engines: inprocess + secagg"]
    with pytest.raises(ConfigError, match="fl.rounds"):
        run_engine_bench("configs/synthetic_smoke.yaml", ["fl.rounds=abc"], engines=("inprocess",))
    with pytest.raises(FedltError, match="data.num_clients"):  # fails inside the first run
        run_engine_bench("configs/synthetic_smoke.yaml", ["data.num_clients=100000"], engines=("inprocess",))
    assert list(tmp_path.glob("fedlt-engines-*")) == []  # no scratch folder left, after success or failure
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| in")}
    assert sorted(rows) == ["inprocess", "inprocess + secagg"]
    # masked uploads are 64-bit integers: about twice the float32 model's bytes
    up_plain, up_secure = float(rows["inprocess"][3]), float(rows["inprocess + secagg"][3])
    assert 1.9 * up_plain < up_secure < 2.3 * up_plain
