"""``fedlt bench engines``' plain-Flower baseline and its argument checks, without any deployment:
the plain app's ClientApp and ServerApp run in this process on an exported synthetic federation,
through a grid that hands each message straight to the ClientApp."""

from __future__ import annotations

import importlib
import io
import json
import os
import shutil
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")

from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord, RecordDict  # noqa: E402

from fedlt.bench import plain_flower as pf  # noqa: E402
from fedlt.config import load_config  # noqa: E402
from fedlt.errors import ConfigError  # noqa: E402

OVERRIDES = ["data.num_clients=3", "fl.participation=1.0", "fl.rounds=2", "fl.local_epochs=1", "run.threads=1",
             "eval.every=1"]


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> Path:
    """A 3-node synthetic federation as ``fedlt data export`` writes it."""
    from fedlt.data.export import export_federation

    cfg = load_config("configs/synthetic_smoke.yaml", OVERRIDES)
    return export_federation(cfg, tmp_path_factory.mktemp("plain") / "export")


@pytest.fixture
def identity(monkeypatch):
    """What Flower sets in an app's process before messages can be created."""
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


def node_context(export: Path, node: Path, node_id: int = 7) -> Context:
    return Context(run_id=1, node_id=node_id, node_config={"data": str(node)}, state=RecordDict(),
                   run_config={"config": str(export / "federation.yaml")})


def train_message(arrays: ArrayRecord, server_round: int = 1, node_id: int = 7) -> Message:
    return Message(RecordDict({"arrays": arrays, "config": ConfigRecord({"server-round": server_round})}),
                   dst_node_id=node_id, message_type=MessageType.TRAIN)


class InProcessGrid:
    """A Flower Grid whose nodes are Contexts answered by the plain ClientApp in this process."""

    def __init__(self, export: Path):
        nodes = sorted((export / "nodes").iterdir())
        self.contexts = {100 + i: node_context(export, node, 100 + i) for i, node in enumerate(nodes)}
        self.sent: list[tuple[str, list[int], list[int]]] = []  # (type, destination nodes, server-round values)

    def get_node_ids(self):
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout):
        messages = list(messages)
        if messages:
            self.sent.append((messages[0].metadata.message_type, sorted(m.metadata.dst_node_id for m in messages),
                              [int(m.content["config"]["server-round"]) for m in messages]))
        return [pf.clientapp(message=m, context=self.contexts[m.metadata.dst_node_id]) for m in messages]


def images_in(folder: Path) -> int:
    return sum(1 for p in folder.rglob("*.png"))


def test_client_trains_its_own_folder_with_plain_sgd(export, identity, tmp_path):
    cfg = load_config(str(export / "federation.yaml"), [])
    node = export / "nodes" / "client-1"
    torch.manual_seed(0)
    start = pf.build_model(cfg).state_dict()
    reply = pf.clientapp(message=train_message(ArrayRecord(start)), context=node_context(export, node))
    assert not reply.has_error()
    assert reply.content["metrics"]["num-examples"] == images_in(node / "train")  # its own rows, not its test/
    trained = reply.content["arrays"].to_torch_state_dict()
    assert trained.keys() == start.keys()
    assert any(not torch.equal(trained[k], start[k]) for k in start)
    again = pf.clientapp(message=train_message(ArrayRecord(start)), context=node_context(export, node))
    assert all(torch.equal(again.content["arrays"].to_torch_state_dict()[k], trained[k]) for k in start)  # seeded
    moved = shutil.copytree(node, tmp_path / "elsewhere" / node.name)
    there = pf.clientapp(message=train_message(ArrayRecord(start)), context=node_context(export, moved))
    assert all(torch.equal(there.content["arrays"].to_torch_state_dict()[k], trained[k]) for k in start)
    other_round = pf.clientapp(message=train_message(ArrayRecord(start), server_round=2),
                               context=node_context(export, node))
    assert any(not torch.equal(other_round.content["arrays"].to_torch_state_dict()[k], trained[k]) for k in start)


def test_training_lowers_the_loss_and_drops_a_single_trailing_row(export):
    cfg = load_config(str(export / "federation.yaml"), [])
    data = pf.node_train_set(str(export / "nodes" / "client-0"), str(export / "federation.yaml"))
    torch.manual_seed(0)
    model = pf.build_model(cfg)
    kw = dict(batch_size=16, lr=0.05, momentum=0.9, weight_decay=0.0, generator=torch.Generator().manual_seed(0))
    first = pf.train_model(model, data, epochs=1, **kw)
    later = pf.train_model(model, data, epochs=3, **kw)
    assert later < first

    one_extra = data.subset(torch.arange(17))  # batches of 16 and 1: the lone row would break BatchNorm
    bn = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(one_extra.images[0].numel(), 8),
                             torch.nn.BatchNorm1d(8), torch.nn.Linear(8, one_extra.num_classes))
    pf.train_model(bn, one_extra, epochs=1, **kw)
    assert int(bn[2].num_batches_tracked) == 1


def test_fedavg_weights_replies_by_their_examples_and_counts_the_upload(identity):
    cfg = load_config("configs/synthetic_smoke.yaml", OVERRIDES)
    uploads: list[int] = []
    strategy = pf.make_strategy(cfg, uploads)
    asked = train_message(ArrayRecord({"w": torch.zeros(4)}))

    def reply(value: float, n: int) -> Message:
        content = RecordDict({"arrays": ArrayRecord({"w": torch.full((4,), value)}),
                              "metrics": MetricRecord({"train_loss": value, "num-examples": n})})
        return Message(content, reply_to=asked)

    arrays, metrics = strategy.aggregate_train(1, [reply(1.0, 1), reply(4.0, 3)])
    assert torch.allclose(arrays.to_torch_state_dict()["w"], torch.full((4,), 3.25))
    assert metrics["train_loss"] == pytest.approx(3.25)
    serialised = len(ArrayRecord({"w": torch.zeros(4)})["w"].data)  # .npy: 16 bytes and a header
    assert serialised >= 16 and uploads == [2 * serialised]
    assert (strategy.fraction_train, strategy.fraction_evaluate, strategy.min_available_nodes) == (1.0, 0.0, 3)


def test_server_app_runs_fedavg_over_every_node_and_writes_the_result(export, identity, tmp_path):
    grid = InProcessGrid(export)
    result = tmp_path / "result.json"
    context = Context(run_id=1, node_id=1, node_config={}, state=RecordDict(),
                      run_config={"config": str(export / "federation.yaml"),
                                  "server-test": str(export / "server" / "test"), "result": str(result)})
    pf.main(grid, context)
    nodes = sorted(grid.contexts)
    assert grid.sent == [("train", nodes, [1, 1, 1]), ("train", nodes, [2, 2, 2])]  # no federated evaluation
    got = json.loads(result.read_text())
    model = ArrayRecord(pf.build_model(load_config(str(export / "federation.yaml"), [])).state_dict())
    assert got["up_bytes"] == [3 * sum(len(array.data) for array in model.values())] * 2
    assert len(got["round_s"]) == 2 and all(t > 0 for t in got["round_s"])
    tests = images_in(export / "server" / "test")
    assert 0 <= got["acc"] <= 100 and round(got["acc"] * tests / 100, 6) == round(got["acc"] * tests / 100)


def test_the_app_folder_builds_a_fab_whose_components_are_the_plain_apps(tmp_path):
    from flwr.cli.build import build_fab_from_disk
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp

    fab = zipfile.ZipFile(io.BytesIO(build_fab_from_disk(pf.write_app(tmp_path / "app"))))
    components = tomllib.loads(fab.read("pyproject.toml").decode())["tool"]["flwr"]["app"]["components"]
    loaded = {}
    for role, ref in components.items():
        module, attr = ref.split(":")
        loaded[role] = getattr(importlib.import_module(module), attr)
    assert isinstance(loaded["serverapp"], ServerApp) and isinstance(loaded["clientapp"], ClientApp)
    assert loaded["clientapp"] is pf.clientapp


@pytest.mark.parametrize("override, fragment", [("method=fedprox", "method=fedprox"), ("loss.name=bsm", "loss.name=bsm"),
                                                ("data.augment=weak", "data.augment=weak")])
def test_plain_app_refuses_what_it_would_compute_differently(override, fragment):
    with pytest.raises(ConfigError, match=fragment):
        pf.check_plain(load_config("configs/synthetic_smoke.yaml", [override]))


BENCH = ["bench", "engines", "configs/synthetic_smoke.yaml", "data.num_clients=3"]


@pytest.mark.parametrize("args, fragments", [
    ([*BENCH, "--engines", "inprocess,nosuch"], ["unknown engine 'nosuch'", "node-data, plain-flower"]),
    ([*BENCH, "--nodes", "2", "--engines", "node-data"], ["--nodes 2", "one SuperNode per client",
                                                          "data.num_clients=3"]),
    ([*BENCH, "--engines", "plain-flower", "--secagg"], ["--secagg", "no secure aggregation"]),
    ([*BENCH, "method=fedprox", "--engines", "inprocess,plain-flower"], ["method=fedprox", "method=fedavg"]),
    ([*BENCH, "--nodes", "0", "--engines", "deployment"], ["--nodes 0", "1 or more SuperNodes"]),
    # the deploy command's own checks, before any run (they used to come after the in-process runs)
    ([*BENCH, "--nodes", "5", "--engines", "deployment"], ["--nodes 5", "3 clients", "--nodes 3 or fewer"]),
    ([*BENCH, "method=centralized", "--engines", "inprocess,deployment"], ["centralized", "pooled data"]),
    ([*BENCH, "method=centralized", "--engines", "flower"], ["centralized", "pooled data"]),
], ids=["unknown-engine", "nodes-vs-clients", "plain-secagg", "plain-not-fedavg", "zero-nodes",
        "more-nodes-than-clients", "pooled-deployment", "pooled-flower"])
def test_bench_engines_refuses_bad_arguments_in_one_line(args, fragments, monkeypatch, capsys):
    import fedlt
    from fedlt import cli

    def no_run(*a, **k):
        raise AssertionError("a refused invocation started a run")

    monkeypatch.setattr(fedlt, "run", no_run)
    monkeypatch.setattr(sys, "argv", ["fedlt", *args])
    with pytest.raises(SystemExit) as done:
        cli.main()
    out, err = capsys.readouterr()
    assert done.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("fedlt: error: "), err
    for fragment in fragments:
        assert fragment in err, (fragment, err)
