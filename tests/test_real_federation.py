"""A real federation (``flower.node_data``): SuperNodes that each hold one client's exported folder
and a server that holds no training data give what the in-process engine gives on the same
federation; federated evaluation gives the server test set's accuracy."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
pytest.importorskip("flwr")

import fedlt  # noqa: E402
from fedlt.config import build_config  # noqa: E402
from fedlt.data.export import export_federation  # noqa: E402
from fedlt.errors import ConfigError, FedltError  # noqa: E402
from flwr.app import Context, RecordDict  # noqa: E402


class NodeGrid:
    """A Flower Grid in this process whose nodes each hold one folder (``data=PATH name=SITE``)
    and answer through fedlt's real ClientApp handler."""

    def __init__(self, folders: dict[str, Path], late: dict[str, Path] | None = None,
                 restart: tuple[str, int] | None = None, lost_file: Path | None = None, same_id: bool = False,
                 silent_after_hello: int = 0, restart_folder: Path | None = None):
        """``restart=(SITE, N)``: after the N-th send SITE's node leaves and a fresh node of that site (new
        id 400, no state) joins, as a SuperNode killed and started again. With ``lost_file`` the old node stays
        listed, silent (as until Flower's heartbeat drops it), and its site is written there, as fedlt
        deploy does when it sees the process exit. With ``same_id`` the fresh node keeps the old one's id, as a
        SuperNode with a registered key does; with ``restart_folder`` the fresh node serves that folder. The last ``silent_after_hello`` nodes answer the first send (the
        sites' hellos) and nothing after it, as SuperNodes stopped or hung once the federation was formed."""
        from flwr.app import Context, RecordDict

        def context(i: int, name: str, folder: Path):
            return Context(run_id=1, node_id=200 + i, state=RecordDict(), run_config={},
                           node_config={"data": str(folder), "name": name})

        self.contexts = {200 + i: context(i, n, f) for i, (n, f) in enumerate(sorted(folders.items()))}
        self.late = {300 + i: context(100 + i, n, f) for i, (n, f) in enumerate(sorted((late or {}).items()))}
        self.sends, self.restart, self.lost_file, self.same_id, self.restarted = 0, restart, lost_file, same_id, False
        self.dead: set[int] = set()  # listed, never answering
        self.unheard: set[int] = set()  # their fits run (state kept) but the replies are lost
        self.silent_after_hello, self.restart_folder = silent_after_hello, restart_folder
        self.targets: list[set[int]] = []  # the nodes of each send
        self.sent_kinds: list[str] = []  # the kind of each send
        self.kinds: list[str] = []
        self.waiting: dict[str, object] = {}  # message id -> its reply, until pulled

    def get_node_ids(self):
        if self.sends > 2:  # late nodes show up once the run is under way
            self.contexts.update(self.late)
        if self.restart and self.sends >= self.restart[1] and not self.restarted:
            self.restarted = True
            old = next(n for n, ctx in self.contexts.items() if ctx.node_config["name"] == self.restart[0])
            config = dict(self.contexts[old].node_config)
            if self.restart_folder is not None:
                config["data"] = str(self.restart_folder)
            if self.same_id:
                self.contexts[old] = Context(run_id=1, node_id=old, state=RecordDict(), run_config={}, node_config=config)
                return list(self.contexts)
            if self.lost_file is None:
                del self.contexts[old]
            else:
                self.dead.add(old)
                with self.lost_file.open("a") as lost:
                    lost.write(self.restart[0] + "\n")
            self.contexts[400] = Context(run_id=1, node_id=400, state=RecordDict(), run_config={}, node_config=config)
        return list(self.contexts)

    def send_and_receive(self, messages, *, timeout):
        from fedlt.engine.flower_app import handle
        from fedlt.engine.flower_codec import decode_meta

        self.sends += 1
        if self.silent_after_hello and self.sends > 1:
            self.dead.update(sorted(self.contexts)[-self.silent_after_hello:])
        self.targets.append({m.metadata.dst_node_id for m in messages})
        self.sent_kinds.append(decode_meta(messages[0].content)["kind"] if messages else "")
        out = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            self.kinds.append(decode_meta(m.content)["kind"])
            if m.metadata.dst_node_id not in self.dead:
                reply = handle(m, self.contexts[m.metadata.dst_node_id])
                if not (m.metadata.dst_node_id in self.unheard and self.kinds[-1] == "fit"):
                    out.append(reply)
        return out

    def push_messages(self, messages):
        """As Flower's grid: the replies wait to be pulled (the late nodes' hellos go this way), and come no
        sooner than the next exchange, so a server that waited for them there would never get them."""
        replies = self.send_and_receive(messages, timeout=0)
        self.waiting.update((r.metadata.reply_to_message_id, (r, self.sends)) for r in replies)
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids):
        ready = [i for i in message_ids if i in self.waiting and self.waiting[i][1] < self.sends]
        return [self.waiting.pop(i)[0] for i in ready]


@pytest.fixture
def server_identity(monkeypatch):
    from flwr.supercore.task_identity import TaskIdentity

    for attr in ("_run_id", "_task_id", "_node_id"):
        monkeypatch.setattr(TaskIdentity, attr, 1)


def tree(tmp_path: Path, name: str, method: str = "fedavg", **top) -> dict:
    cfg = {
        "seed": 1, "method": method, "loss": {"name": "bsm"},
        "data": {"dataset": "synthetic", "imbalance_factor": 10, "alpha": 0.5, "num_clients": 3},
        "fl": {"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
        "eval": {"every": 1},
        "run": {"out_dir": str(tmp_path / "runs"), "name": name, "checkpoint_every": 0, "threads": 1},
    }
    for key, value in top.items():
        cfg[key] = {**cfg.get(key, {}), **value} if isinstance(value, dict) else value
    return cfg


def node_run(cfg: dict, grid: NodeGrid):
    from fedlt.engine.flower_app import run_on_grid

    return run_on_grid(build_config(cfg), grid, quiet=True)


def node_run_stopped_in(cfg: dict, exported: Path, rnd: int, monkeypatch) -> None:
    """``cfg`` on every exported site, interrupted (Ctrl-C) as round ``rnd`` begins."""
    from fedlt.engine.flower_app import FlowerSimulation

    original = FlowerSimulation.fit_round
    monkeypatch.setattr(FlowerSimulation, "fit_round", lambda self, r: (_ for _ in ()).throw(KeyboardInterrupt)
                        if r == rnd else original(self, r))
    with pytest.raises(KeyboardInterrupt):
        node_run(cfg, NodeGrid(nodes_of(exported)))
    monkeypatch.setattr(FlowerSimulation, "fit_round", original)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("export") / "federation"
    export_federation(build_config(tree(out.parent, "export")), out)
    return out


#: the resolution of secure aggregation's fixed point (secagg.fraction_bits=24): the engine's counts and
#: evaluation sums are secure phases, which round each node's value to it
RESOLUTION = 2.0 ** -24


def tolerance(metric: str, nodes: int = 3, classes: int = 10) -> float:
    """How far a node run's figure may be from the in-process one. Accuracies from per-class hits and
    totals are integers, exact; personalized accuracy is the mean of the nodes' own, each rounded by
    at most half the resolution; the loss is a sum of each node's per-class loss sums, each rounded so,
    over at least one sample."""
    return {"pm_acc": RESOLUTION / 2, "loss": nodes * classes * RESOLUTION / 2}.get(metric, 1e-9)


def node_tree(tmp_path: Path, name: str, exported: Path, **top) -> dict:
    extra = {"engine": "flower", "flower": {"node_data": True, "min_nodes": 3, "connect_timeout_s": 5},
             "data": {"classes": [f"class{i}" for i in range(10)]}}
    for key, value in top.items():
        extra[key] = {**extra.get(key, {}), **value} if isinstance(value, dict) else value
    return tree(tmp_path, name, **extra)


def nodes_of(exported: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted((exported / "nodes").iterdir())}


SAFS_SMALL = {"safs_max_per_class": 20, "safs_min_per_class": 5, "safs_steps": 3, "safs_rff_dim": 16,
              "safs_finetune_epochs": 1}


@pytest.mark.parametrize(("method", "extra"), [
    ("fedavg", {}),  # FedAvg (BSM)
    ("sfd", {"calibration_args": SAFS_SMALL, "loss": {"name": "ce"}}),
    ("gbme", {"fl": {"rounds": 2}}),
    ("fedrod", {"loss": {"name": "ce"}}),
    ("scaffold", {"loss": {"name": "ce"}}),  # server state over the client set
    ("fedyoyo", {"loss": {"name": "ce"}}),  # per-client memory on the server
])
def test_nodes_with_their_own_data_give_the_in_process_run(tmp_path, exported, server_identity, method, extra):
    local = fedlt.run(tree(tmp_path, "local", method, **extra), quiet=True)
    remote = node_run(node_tree(tmp_path, "nodes", exported, method=method,
                                eval={"test_data": str(exported / "server" / "test")}, **extra),
                      NodeGrid(nodes_of(exported)))
    assert len(remote.metrics) == len(local.metrics) == 2
    for a, b in zip(local.metrics, remote.metrics):
        for key in ("acc", "many_acc", "medium_acc", "few_acc", "pm_acc"):
            assert b[key] == (None if a[key] is None else pytest.approx(a[key], abs=tolerance(key))), (method, key)
        assert b["per_class_acc"] == a["per_class_acc"]
    assert remote.summary["train_class_counts"] == local.summary["train_class_counts"]
    assert remote.summary["shot_groups"] == local.summary["shot_groups"]
    assert remote.summary["nodes"] == sorted(nodes_of(exported))
    assert not (remote.run_dir / "partition.json").exists()  # the server does not know the partition
    assert "counts" in remote.summary["messages"]


@pytest.mark.parametrize(("method", "extra"), [
    ("fedavg", {}),
    ("sfd", {"calibration_args": SAFS_SMALL, "loss": {"name": "ce"}}),  # calibrated heads travel as data
])
def test_federated_evaluation_gives_the_server_test_sets_accuracy(tmp_path, exported, server_identity, method, extra):
    """Nodes whose test splits together are the server's balanced test set: the class-balanced
    mean of the summed per-class counts is the server's plain accuracy, for the global model and
    every variant."""
    split = tmp_path / "split"
    shutil.copytree(exported / "nodes", split)
    server_test = exported / "server" / "test"
    names = sorted(p.name for p in split.iterdir())
    for name in names:
        shutil.rmtree(split / name / "test")
    for cls in sorted(server_test.iterdir()):
        for i, image in enumerate(sorted(cls.iterdir())):
            target = split / names[i % len(names)] / "test" / cls.name
            target.mkdir(parents=True, exist_ok=True)
            shutil.copy(image, target / image.name)
    folders = {n: split / n for n in names}
    on_server = node_run(node_tree(tmp_path, "server-test", exported, method=method,
                                   eval={"test_data": str(server_test)}, **extra), NodeGrid(folders))
    federated = node_run(node_tree(tmp_path, "federated", exported, method=method, **extra), NodeGrid(folders))
    for a, b in zip(on_server.metrics, federated.metrics):
        assert set(b.get("variants", {})) == set(a.get("variants", {}))
        for name, variant in a.get("variants", {}).items():
            assert b["variants"][name]["acc"] == pytest.approx(variant["acc"], rel=1e-9), name
        for key in ("acc", "many_acc", "medium_acc", "few_acc", "loss"):
            assert (b[key] is None) == (a[key] is None), key
            if a[key] is not None:
                assert b[key] == pytest.approx(a[key], rel=1e-9, abs=tolerance(key)), key
        assert a["acc"] is not None and a["few_acc"] is not None
        assert b["per_class_acc"] == a["per_class_acc"]
    assert "federated" in federated.summary["evaluation"]


def test_the_engines_counts_and_evaluation_reach_the_server_as_sums_unless_leaks_are_allowed(tmp_path, exported, server_identity):
    """The class counts and the federated evaluation are secure phases whether or not the method's own
    are (secagg.enabled): the server sees the nodes' sums only, the same figures to the fixed-point
    resolution. privacy.allow_leaks=true sends them in the clear."""
    runs, kinds = {}, {}
    for name, top in [("default", {}), ("clear", {"privacy": {"allow_leaks": True}}),
                      ("secure", {"secagg": {"enabled": True}})]:
        grid = NodeGrid(nodes_of(exported))
        runs[name], kinds[name] = node_run(node_tree(tmp_path, name, exported, **top), grid), grid.kinds
    default = runs["default"].summary["secure_aggregation"]
    # FedAvg's class-count query is declared summed too (it runs only for loss.prior=global)
    assert default["phases"] == {"counts": "sum", "evaluate_counts": "sum", "evaluate": "sum",
                                 "query:class_counts": "sum"}
    assert "fit" in default["in_clear"]
    assert "secagg:keys" in kinds["default"]
    assert "secure_aggregation" not in runs["clear"].summary and not any(k.startswith("secagg:") for k in kinds["clear"])
    secure = runs["secure"].summary["secure_aggregation"]
    assert {"counts", "evaluate_counts", "fit"} <= set(secure["phases"])
    assert not {"counts", "evaluate_counts"} & set(secure["in_clear"])
    for name in ("default", "secure"):
        assert runs[name].summary["train_class_counts"] == runs["clear"].summary["train_class_counts"]
    for a, b in zip(runs["clear"].metrics, runs["default"].metrics):
        assert b["acc"] == pytest.approx(a["acc"], abs=tolerance("acc"))
        assert b["loss"] == pytest.approx(a["loss"], abs=tolerance("loss"))
    for a, b in zip(runs["clear"].metrics, runs["secure"].metrics):
        assert b["acc"] == pytest.approx(a["acc"], abs=1e-3)  # the models were averaged in fixed point too


class RecordingReplies(NodeGrid):
    """A grid that keeps the payload of every reply of one exchange kind the server receives."""

    def __init__(self, folders: dict[str, Path], kind: str):
        super().__init__(folders)
        self.kind, self.payloads = kind, []

    def send_and_receive(self, messages, *, timeout):
        from fedlt.engine.flower_codec import decode_meta, decode_reply

        kinds = [decode_meta(m.content)["kind"] for m in messages]
        replies = super().send_and_receive(messages, timeout=timeout)
        for kind, reply in zip(kinds, replies):
            if kind == self.kind:
                self.payloads.append(decode_reply(reply.content, torch.device("cpu")).payload)
        return replies


def test_a_nodes_personalized_accuracy_leaves_it_only_as_a_secure_sum(tmp_path, exported, server_identity):
    """A personalized method's nodes send their accuracy, never which of their test images they got
    right: in the clear (privacy.allow_leaks=true) each reply holds only summable numbers (FedLoGe:
    one pair for its own personal model and for each other reading); by default the server receives
    one secure sum, and the personalized accuracies equal the clear run's to the fixed point."""
    extra = {"method": "fedloge", "loss": {"name": "ce"}, "method_args": {"sse_steps": 5},
             "eval": {"test_data": str(exported / "server" / "test")}}
    clear_grid = RecordingReplies(nodes_of(exported), "evaluate")
    clear = node_run(node_tree(tmp_path, "clear", exported, privacy={"allow_leaks": True}, **extra), clear_grid)
    assert len(clear_grid.payloads) == 3 * 2  # three nodes, two evaluations
    readings = sorted(clear.metrics[-1]["pm_variants"])
    assert readings == ["la_fr", "psi_plus_phi"]
    for payload in clear_grid.payloads:
        suffixes = ["", *(f"/{r}" for r in readings)]
        assert set(payload) == {f"pm_{part}{suffix}" for part in ("sum", "n", "nonfinite") for suffix in suffixes}
        assert all(isinstance(v, (int, float)) for v in payload.values()), payload
        assert payload["pm_n"] == 1 and 0 <= payload["pm_sum"] <= 100 and payload["pm_nonfinite"] == 0
    secure_grid = RecordingReplies(nodes_of(exported), "evaluate")
    secure = node_run(node_tree(tmp_path, "secure", exported, **extra), secure_grid)
    assert "evaluate" in secure.summary["secure_aggregation"]["phases"]
    assert "evaluate" not in secure.summary["secure_aggregation"]["in_clear"]
    assert secure.summary["messages"]["evaluate"]["from_client"]["secure_sum_of"] == [
        *sorted(f"payload/{key} []" for key in clear_grid.payloads[0]), "num_samples []"]
    assert len(secure_grid.payloads) == 3 * 2 and all(set(p) == {"masked", "schema"} for p in secure_grid.payloads)
    for a, b in zip(clear.metrics, secure.metrics):
        assert b["pm_acc"] == pytest.approx(a["pm_acc"], abs=tolerance("pm_acc"))
        for name in readings:
            assert b["pm_variants"][name]["pm_acc"] == pytest.approx(a["pm_variants"][name]["pm_acc"],
                                                                     abs=tolerance("pm_acc"))


@pytest.mark.parametrize(("query", "top"), [
    ("query:class_counts", {"loss": {"name": "bsm", "prior": "global"}}),  # the global prior's class counts
    ("query:calibration_stats", {"method": "fedncm", "loss": {"name": "ce"}}),  # per-class feature sums and counts
])
def test_a_methods_summed_queries_reach_the_server_as_secure_sums(tmp_path, exported, server_identity, query, top):
    """A query the method only sums shows each node's label histogram; in a real federation it is a
    secure phase whatever secagg.enabled says, as the engine's counts are, and the run gives the clear
    run's figures (privacy.allow_leaks=true) to the fixed point."""
    extra = {**top, "eval": {"test_data": str(exported / "server" / "test")}}
    clear = node_run(node_tree(tmp_path, "clear", exported, privacy={"allow_leaks": True}, **extra),
                     NodeGrid(nodes_of(exported)))
    grid = RecordingReplies(nodes_of(exported), query)
    secure = node_run(node_tree(tmp_path, "secure", exported, **extra), grid)
    record = secure.summary["secure_aggregation"]
    assert record["phases"][query] == "sum" and query not in record["in_clear"] and "fit" in record["in_clear"]
    assert grid.payloads and all(set(p) == {"masked", "schema"} for p in grid.payloads)
    for a, b in zip(clear.metrics, secure.metrics):  # integer counts are exact in the fixed point: the same training
        assert (b["acc"], b["train_loss"]) == (a["acc"], a["train_loss"])
        for name, variant in a.get("variants", {}).items():  # a calibrated head from sums rounded to 2^-24
            assert b["variants"][name]["acc"] == pytest.approx(variant["acc"], abs=0.5), name


def test_a_method_that_needs_more_clients_than_nodes_came_is_refused_before_the_run_starts(tmp_path, exported,
                                                                                           server_identity):
    """The config may promise more clients than nodes join: the server checks it again against the
    nodes that came (GBME's 4 experts need 4 clients; 3 nodes), before any run folder is written."""
    cfg = node_tree(tmp_path, "g", exported, method="gbme", loss={"name": "bsm"},
                    method_args={"num_experts": 4, "joint_warmup": 0},
                    eval={"test_data": str(exported / "server" / "test"), "personalized": False})
    cfg["data"]["num_clients"] = 10
    with pytest.raises(ConfigError, match=r"num_experts=4 needs at least as many clients \(data.num_clients=3\)"):
        node_run(cfg, NodeGrid(nodes_of(exported)))
    assert not (tmp_path / "runs").exists()


class SilentInSecureRound(NodeGrid):
    """A grid whose node ``silent`` stops answering secure aggregation's messages in round ``rnd``."""

    def __init__(self, folders: dict[str, Path], silent: int, rnd: int):
        super().__init__(folders)
        self.silent, self.rnd = silent, rnd

    def send_and_receive(self, messages, *, timeout):
        from fedlt.engine.flower_codec import decode_meta

        def dropped(m) -> bool:
            meta = decode_meta(m.content)
            return m.metadata.dst_node_id == self.silent and meta["kind"].startswith("secagg:") and meta["round"] == self.rnd

        return super().send_and_receive([m for m in messages if not dropped(m)], timeout=timeout)


def test_a_secure_evaluation_left_with_one_node_skips_the_round_not_the_run(tmp_path, exported, server_identity):
    """Two nodes, one silent in round 1's secure evaluation: its sum would be the other node's own
    figures, so that round has no metrics; the run goes on, round 2 is evaluated, and the secure
    evaluation's extra exchanges are not counted as traffic."""
    two = dict(list(nodes_of(exported).items())[:2])
    top = {"flower": {"min_nodes": 2, "min_reply_fraction": 0.5}}
    clear = node_run(node_tree(tmp_path, "clear", exported, privacy={"allow_leaks": True}, **top), NodeGrid(two))
    run = node_run(node_tree(tmp_path, "silent", exported, **top), SilentInSecureRound(two, silent=201, rnd=1))
    assert [m.get("acc") is None for m in run.metrics] == [True, False]
    assert run.metrics[1]["acc"] == pytest.approx(clear.metrics[1]["acc"], abs=tolerance("acc"))
    assert {"round": 1, "kind": "secagg:keys", "clients": [1], "cause": "timeout"} in run.summary["dropped"]
    # the secure class counts (before round 1) are traffic; the secure evaluations are not
    assert run.metrics[1]["comm"] == clear.metrics[1]["comm"]
    assert run.metrics[0]["comm"]["up_payload"] > clear.metrics[0]["comm"]["up_payload"]


def test_a_run_whose_last_round_was_not_evaluated_says_so_wherever_its_result_is_read(tmp_path, exported,
                                                                                      server_identity, capsys):
    """Round 2's secure evaluation lost a node: the run finishes with round 1's figures as its headline,
    and its summary, report, last line and `fedlt report`/`fedlt table` rows name the round they are of,
    as a diverged run's name the round it diverged in. The server says what it waits for before round 1."""
    from fedlt.engine.flower_app import final_line
    from fedlt.reporting.collect import collect
    from fedlt.reporting.comparison import comparison_table

    two = dict(list(nodes_of(exported).items())[:2])
    top = {"flower": {"min_nodes": 2, "min_reply_fraction": 0.5}}
    run = node_run(node_tree(tmp_path, "short", exported, **top), SilentInSecureRound(two, silent=201, rnd=2))
    assert run.summary["final"]["round"] == 1 and run.summary["last_evaluated_round"] == 1
    assert "status" not in run.summary  # it finished
    assert "| final (last evaluated round 1 of 2) | 1 |" in (run.run_dir / "report.md").read_text()
    assert final_line(run.run_dir, run.summary).startswith(f"fedlt: {run.run_dir}: finished; last evaluated round 1 "
                                                           "of 2: acc ")
    assert collect(run.run_dir).settings[0].rows[0].label == "fedavg (last evaluated round 1 of 2)"
    assert "| short (last evaluated round 1 of 2) |" in comparison_table([("short", run.summary)])
    err = capsys.readouterr().err
    assert "fedlt: waiting for flower.min_nodes=2 SuperNodes" in err
    assert "fedlt: 2/2 SuperNodes connected (client-0, client-1)" in err
    assert "summing the class counts of 2 nodes (secure aggregation)" in err
    assert "fedlt: round 2 is not evaluated" in err
    full = node_run(node_tree(tmp_path, "full", exported, **top), NodeGrid(two))
    assert "last_evaluated_round" not in full.summary
    assert "| final (headline) | 2 |" in (full.run_dir / "report.md").read_text()
    acc = full.summary["final"]["acc"]
    assert final_line(full.run_dir, full.summary) == f"fedlt: {full.run_dir}: finished; final acc {acc:.2f}"


def test_a_node_missing_classes_keeps_the_global_labels(tmp_path, exported, server_identity):
    folders = {n: tmp_path / "nodes" / n for n in nodes_of(exported)}
    shutil.copytree(exported / "nodes", tmp_path / "nodes")
    first = folders[min(folders)] / "train"
    kept = sorted(p.name for p in first.iterdir())
    for cls in kept[:-1][:2]:
        shutil.rmtree(first / cls)
    run = node_run(node_tree(tmp_path, "missing", exported, eval={"test_data": str(exported / "server" / "test")}),
                   NodeGrid(folders))
    assert len(run.summary["train_class_counts"]) == 10
    assert run.metrics[-1]["acc"] > 10


def test_the_server_waits_for_min_nodes_and_names_who_came(tmp_path, exported, server_identity):
    two = dict(list(nodes_of(exported).items())[:2])
    with pytest.raises(FedltError, match=r"2 of flower.min_nodes=3 SuperNodes connected .* \(connected: client-0, "
                                          r"client-1\); start the missing ones"):
        node_run(node_tree(tmp_path, "few", exported, flower={"connect_timeout_s": 0.1}), NodeGrid(two))


def test_a_node_started_for_a_simulated_partition_is_refused_with_the_node_config_to_use(tmp_path, exported,
                                                                                        server_identity):
    grid = NodeGrid(nodes_of(exported))
    grid.contexts[200].node_config = {"partition-id": 0, "num-partitions": 3}
    with pytest.raises(FedltError, match="^SuperNode 200 was started with partition-id/num-partitions, but this run "
                                         "has flower.node_data=true; start every SuperNode with --node-config "
                                         "'data=\"PATH\" name=\"SITE\"'$"):
        node_run(node_tree(tmp_path, "partition", exported), grid)


def test_two_nodes_of_one_name_stop_the_run_before_it_starts(tmp_path, exported, server_identity):
    """Which of two same-named nodes answered first is chance: keeping it trained on the wrong site's data."""
    grid = NodeGrid(nodes_of(exported))
    grid.contexts[200].node_config = {**grid.contexts[201].node_config, "data": grid.contexts[200].node_config["data"]}
    with pytest.raises(FedltError, match=r"^two SuperNodes are named 'client-1' \(nodes \d+ and \d+\), so which one "
                                         "holds that site's data is unknown; give each node its own name"):
        node_run(node_tree(tmp_path, "twins", exported), grid)
    assert not (tmp_path / "runs" / "twins").exists()


def test_a_late_node_takes_no_part_and_is_named_by_its_site(tmp_path, exported, server_identity, capsys):
    """An operator knows sites, not Flower's ids; a late node of a known site's name is that site's
    SuperNode started again, which does not rejoin."""
    nodes = nodes_of(exported)
    grid = NodeGrid(nodes, late={"zz-late": nodes["client-0"], "client-1": nodes["client-1"]})
    run = node_run(node_tree(tmp_path, "late", exported, eval={"test_data": str(exported / "server" / "test")}), grid)
    assert run.summary["nodes"] == sorted(nodes)
    err = capsys.readouterr().err
    known = next(node for node, ctx in grid.contexts.items() if ctx.node_config["name"] == "client-1" and node < 300)
    for node in (300, 301):
        assert err.count(f"fedlt: SuperNode {node} joined after the federation was formed; asking which site it "
                         "serves") == 1
    assert err.count(f"fedlt: the late SuperNode 300 serves site 'client-1', which SuperNode {known} still serves; "
                     "it stands by until that node is gone\n") == 1
    assert err.count("fedlt: the late SuperNode 301 serves site 'zz-late', not one of this run's; it takes no "
                     "part\n") == 1
    assert grid.waiting == {}  # each hello was answered and read once
    assert all(kind == "hello" for kind, targets in zip(grid.sent_kinds, grid.targets) if targets & {300, 301})


@pytest.mark.parametrize(("method", "rejoins"), [("fedavg", True), ("ditto", False)])
def test_a_site_whose_supernode_is_started_again_rejoins_unless_its_client_kept_state(
        tmp_path, exported, server_identity, capsys, method, rejoins):
    """A killed SuperNode started again is a new node to Flower: a stateless client's site takes part again;
    one whose client kept state there (Ditto's personal model) stays out rather than train without it."""
    grid = NodeGrid(nodes_of(exported), restart=("client-1", 6))
    run = node_run(node_tree(tmp_path, method, exported, method=method, fl={"rounds": 3}, loss={"name": "ce"},
                             eval={"test_data": str(exported / "server" / "test")}), grid)
    assert "status" not in run.summary and len(run.metrics) == 3
    old = next(n for n, targets in enumerate(grid.targets) if 400 in targets)
    err = capsys.readouterr().err
    assert err.count("fedlt: SuperNode 400 joined after the federation was formed; asking which site it serves") == 1
    assert 201 not in set().union(*grid.targets[old:])
    if rejoins:
        assert err.count("fedlt: site 'client-1' rejoined as SuperNode 400 (it was SuperNode 201); its client takes "
                         "part again from this exchange") == 1
        assert any(400 in targets and len(targets) == 3 for targets in grid.targets[-3:])
        # its name comes back an exchange after the hello: the site misses at most that one exchange
        assert [d["clients"] for d in run.summary.get("dropped", [])] in ([], [[1]])
    else:
        assert err.count("fedlt: site 'client-1' is back as SuperNode 400, but its client's state between rounds "
                         "(kept by ditto) was on SuperNode 201, which is gone; the site stays out of this run") == 1
        assert all(kind == "hello" for kind, targets in zip(grid.sent_kinds, grid.targets) if 400 in targets)
    report = (run.run_dir / "report.md").read_text()  # the sites' data, not a partition the server never drew
    assert "\n3 sites holding their own data (flower.node_data), participation 1" in report
    assert "(each site's own test/ folder)" in report and "alpha=" not in report


def edited_copy(folder: Path, to: Path) -> None:
    """``folder`` copied to ``to`` with one training image inverted: other data under the same names and counts."""
    from PIL import Image

    shutil.copytree(folder, to)
    image = sorted((to / "train").rglob("*.png"))[0]
    Image.eval(Image.open(image), lambda v: 255 - v).save(image)


def test_a_site_started_again_on_other_data_takes_no_part(tmp_path, exported, server_identity, capsys):
    """A site's SuperNode started again mid-run on a folder whose images differ (same names, same counts)
    would train the rest of the run on data the run's records do not describe: it stays out."""
    site = "client-1"
    edited_copy(nodes_of(exported)[site], tmp_path / "edited")
    grid = NodeGrid(nodes_of(exported), restart=(site, 6), restart_folder=tmp_path / "edited")
    run = node_run(node_tree(tmp_path, "edited", exported, fl={"rounds": 3},
                             eval={"test_data": str(exported / "server" / "test")}), grid)
    assert "status" not in run.summary and len(run.metrics) == 3
    err = capsys.readouterr().err
    assert err.count(f"fedlt: the late SuperNode 400 serves site '{site}', but its training data are not those the "
                     "site began the run with (the digest of its images and labels differs); it takes no part") == 1
    assert "rejoined as SuperNode 400" not in err
    assert all(kind == "hello" for kind, targets in zip(grid.sent_kinds, grid.targets) if 400 in targets)


def test_a_restarted_site_whose_stateful_replies_were_all_lost_stays_out(tmp_path, exported, server_identity,
                                                                          capsys):
    """Whether a site's client kept state on its node was read from its replies only: a Ditto site whose fit
    replies were all lost (its node stored its personal model, the replies came too late) then rejoined on a
    new node as if it had kept nothing, and trained without that model. The method's declaration covers it."""
    from fedlt.engine.flower_app import _keeps_state
    from fedlt.engine.flower_codec import get_tree

    grid = NodeGrid(nodes_of(exported), restart=("client-1", 6))
    grid.unheard.add(201)
    first = grid.contexts[201]  # dropped from the grid when the site restarts
    run = node_run(node_tree(tmp_path, "ditto", exported, method="ditto", fl={"rounds": 3}, loss={"name": "ce"},
                             eval={"test_data": str(exported / "server" / "test")}), grid)
    assert "status" not in run.summary and len(run.metrics) == 3
    assert _keeps_state(get_tree(first.state, "client1.", torch.device("cpu")))  # what its lost fit reply hid
    err = capsys.readouterr().err
    assert err.count("fedlt: site 'client-1' is back as SuperNode 400, but its client's state between rounds "
                     "(kept by ditto) was on SuperNode 201, which is gone; the site stays out of this run") == 1
    assert "rejoined as SuperNode 400" not in err


@pytest.mark.parametrize(("top", "refusal"), [
    ({"engine": "inprocess"}, "flower.node_data=true is a real federation of SuperNodes; run it with engine=flower"),
    ({"method": "centralized"}, "trains on pooled data"),
    ({"method": "gbme", "method_args": {"grouping": "label"}}, "method_args.grouping=label shows the server"),
    ({"method": "gbme", "method_args": {"diagnose_gpi": True}}, "method_args.diagnose_gpi=true shows the server"),
    ({"calibration": ["oracle"]}, "calibration=oracle (uploads real features)"),
    ({"calibration": ["creff"]}, "calibration=creff (each client's per-class replies name the classes it holds) shows"),
    # method=creff is FedAvg with CReFF: the refusal names the option that was given, not a calibration to drop
    ({"method": "creff"}, "method=creff (each client's per-class replies name the classes it holds) shows"),
    ({"data": {"val_per_class": 5}}, "data.val_per_class draws a validation set"),
    ({"eval": {"shot_rule": "cumulative_local"}}, "eval.shot_rule=cumulative_local needs every client's class counts"),
])
def test_options_that_leak_or_need_the_servers_data_are_refused(tmp_path, top, refusal):
    from fedlt.run_parts import check_config

    cfg = node_tree(tmp_path, "refused", Path("/nonexistent"), **top)
    with pytest.raises(ConfigError) as err:
        check_config(build_config(cfg))
    assert refusal in str(err.value) and "\n" not in str(err.value)
    if "shows the server" in refusal:
        cfg["privacy"] = {"allow_leaks": True}
        check_config(build_config(cfg))


def test_the_deployment_page_carries_the_measured_ledger(tmp_path):
    """The page's table is what the code sends (python -m fedlt.docs_ledger prints it, to paste in)."""
    from fedlt.docs_ledger import method_rows

    page = (Path(__file__).parents[1] / "docs" / "deploying.md").read_text()
    table = page.split("<!-- ledger -->")[1].split("<!-- /ledger -->")[0]
    for method in ("fedavg", "gbme", "creff", "centralized"):
        for row in method_rows(method, tmp_path):
            assert row in table, row


def test_fedlt_deploy_over_exported_node_folders_gives_the_in_process_run(tmp_path, exported):
    """The CLI end to end, on a real SuperLink with one SuperNode process per exported node folder
    (127.0.0.1, --insecure): FedAvg (BSM) gives the in-process run's figures; each SuperNode read
    only its own folder and the server no training data."""
    import json
    import subprocess
    import sys

    import yaml

    local = fedlt.run(tree(tmp_path, "local"), quiet=True)
    config = tmp_path / "federation.yaml"
    deployed = yaml.safe_load((exported / "federation.yaml").read_text())
    deployed["run"].update(out_dir=str(tmp_path / "runs"), name="deployed")
    config.write_text(yaml.safe_dump(deployed))
    proc = subprocess.run([sys.executable, "-m", "fedlt.cli", "deploy", "--node-data", str(exported / "nodes"),
                           "--server-test", str(exported / "server" / "test"), "--workdir", str(tmp_path / "work"),
                           "--timeout", "240", str(config)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    rounds = local.summary["rounds"]  # shown while the run went, once each
    shown = [line for line in proc.stderr.splitlines() if re.match(r"\[fedavg/bsm [^\]]+\] round \d+/\d+ \|", line)]
    assert len(shown) == len({line.split(" | ")[0] for line in shown}) >= 1 and f"round {rounds}/{rounds}" in shown[-1]
    assert not any(line in proc.stdout.splitlines() for line in shown)
    summary = json.loads((tmp_path / "runs" / "deployed" / "summary.json").read_text())
    assert summary["nodes"] == sorted(nodes_of(exported)) and summary["engine"] == "flower"
    assert summary["train_class_counts"] == local.summary["train_class_counts"]
    for key in ("acc", "many_acc", "medium_acc", "few_acc", "pm_acc", "per_class_acc"):
        expected = local.summary["final"][key]
        assert summary["final"][key] == (expected if expected is None or isinstance(expected, list)
                                         else pytest.approx(expected, abs=tolerance(key))), key


def test_the_servers_validation_set_gives_the_in_process_validation_figures(tmp_path, server_identity):
    """An export with data.val_per_class writes server/val; eval.val_data evaluates it as a run
    with the validation split does (the exported config sets data.val_per_class=0)."""
    with_val = tree(tmp_path, "local", data={"val_per_class": 5})
    out = export_federation(build_config(with_val), tmp_path / "federation")
    local = fedlt.run(with_val, quiet=True)
    remote = node_run(node_tree(tmp_path, "nodes", out, eval={"test_data": str(out / "server" / "test"),
                                                              "val_data": str(out / "server" / "val")}),
                      NodeGrid(nodes_of(out)))
    for a, b in zip(local.metrics, remote.metrics):
        assert b["val_acc"] == pytest.approx(a["val_acc"], abs=1e-9) and b["acc"] == pytest.approx(a["acc"], abs=1e-9)


def test_a_restarted_site_rejoins_while_flower_still_lists_its_old_node(tmp_path, exported, server_identity, capsys,
                                                                       monkeypatch):
    """fedlt deploy lists the site of a SuperNode whose process exited: its new node rejoins at once, is not
    taken for lost under that same line, and the old node, still listed, is not asked its name as a newcomer."""
    from fedlt.results import LOST_NODES_ENV

    lost = tmp_path / "lost-nodes.txt"
    monkeypatch.setenv(LOST_NODES_ENV, str(lost))
    grid = NodeGrid(nodes_of(exported), restart=("client-1", 6), lost_file=lost)
    run = node_run(node_tree(tmp_path, "listed", exported, fl={"rounds": 3},
                             eval={"test_data": str(exported / "server" / "test")}), grid)
    assert "status" not in run.summary and len(run.metrics) == 3
    err = capsys.readouterr().err
    assert "fedlt: site 'client-1' rejoined as SuperNode 400 (it was SuperNode 201)" in err
    assert "SuperNode 201 joined" not in err and "stands by" not in err
    assert any(400 in targets and len(targets) == 3 for targets in grid.targets[-3:])
    took_over = next(i for i, (kind, t) in enumerate(zip(grid.sent_kinds, grid.targets)) if 400 in t and kind != "hello")
    assert all(201 not in targets for targets in grid.targets[took_over:])


class KilledDuringSecureExchange(NodeGrid):
    """``SITE``'s SuperNode is killed and started again right after it sent its shares in the first secure
    exchange of a round (the keys it made are on the old node), as a node killed while it trains under
    ``secagg.enabled`` or while it evaluates for a secure evaluation."""

    def __init__(self, folders: dict[str, Path], site: str):
        super().__init__(folders)
        self.site = site

    def send_and_receive(self, messages, *, timeout):
        from fedlt.engine.flower_codec import decode_meta

        out = super().send_and_receive(messages, timeout=timeout)
        meta = decode_meta(messages[0].content) if messages else {}
        if self.restart is None and meta.get("kind") == "secagg:shares" and meta["round"] >= 1:
            self.restart = (self.site, self.sends)
        return out


@pytest.mark.parametrize("setting", ["secure fit", "secure evaluation"])
def test_a_stateless_site_killed_during_a_secure_exchange_rejoins_once_that_exchange_is_over(
        tmp_path, exported, server_identity, capsys, setting):
    """A secure phase's secrets live in the client's ctx.state only until it unmasks: they are not state kept
    between rounds, so a FedAvg site whose node was killed in the middle of one rejoins; it takes the site's place
    at the next exchange that does not need them (not in the middle of that secure phase, whose keys were the old
    node's)."""
    extra = ({"secagg": {"enabled": True}, "eval": {"test_data": str(exported / "server" / "test")}}
             if setting == "secure fit" else {})  # without a server test set the evaluation is a secure phase
    grid = KilledDuringSecureExchange(nodes_of(exported), "client-1")
    run = node_run(node_tree(tmp_path, setting.replace(" ", "-"), exported, fl={"rounds": 3}, **extra), grid)
    assert "status" not in run.summary and len(run.metrics) == 3
    err = capsys.readouterr().err
    assert "stays out" not in err
    assert err.count("fedlt: site 'client-1' rejoined as SuperNode 400 (it was SuperNode 201)") == 1
    joined = next(i for i, targets in enumerate(grid.targets) if 400 in targets and grid.sent_kinds[i] != "hello")
    assert grid.sent_kinds[joined] not in ("secagg:shares", "secagg:unmask")  # not amid a secure phase it has no keys of
    assert any(400 in targets and len(targets) == 3 for targets in grid.targets[-3:])


class StandbyLeaves(NodeGrid):
    """A late node of site ``client-1`` stands by while the site's node serves it, leaves, and then the site's
    node leaves too."""

    def __init__(self, folders: dict[str, Path]):
        super().__init__(folders, late={"client-1": folders["client-1"]})

    def get_node_ids(self):
        if self.sends >= 8:
            self.late = {}
            self.contexts.pop(300, None)
        if self.sends >= 12:
            self.contexts.pop(201, None)
        return super().get_node_ids()


def test_a_late_node_that_left_while_it_stood_by_does_not_take_its_sites_place(tmp_path, exported, server_identity,
                                                                              capsys):
    grid = StandbyLeaves(nodes_of(exported))
    run = node_run(node_tree(tmp_path, "left", exported, fl={"rounds": 3},
                             eval={"test_data": str(exported / "server" / "test")}), grid)
    assert len(run.metrics) == 3
    err = capsys.readouterr().err
    assert "fedlt: the late SuperNode 300 serves site 'client-1', which SuperNode 201 still serves" in err
    assert "rejoined" not in err
    assert err.count("fedlt: the late SuperNode 300 of site 'client-1' left before it could take the site's place") == 1
    assert "on client-1 (SuperNode 201): their SuperNode left the federation" in err  # the site's dropouts name 201


@pytest.mark.parametrize("method", ["fedavg", "ditto"])
def test_a_supernode_started_again_under_its_old_id_is_told_by_the_state_it_lost(tmp_path, exported, server_identity,
                                                                                  capsys, method):
    """A SuperNode with a registered key comes back under its old id, with an empty context: a stateless
    client goes on as before; one whose state was there (Ditto's personal model) would train without it, so its
    reply is not used and the site takes no further part; one in the middle of a secure phase sits that phase
    out (its keys are gone) and takes part again from the next."""
    from fedlt.engine.flower_app import SECRETS_LOST, STATE_LOST

    tree = node_tree(tmp_path, method, exported, method=method, fl={"rounds": 3}, loss={"name": "ce"})
    plain = NodeGrid(nodes_of(exported))
    node_run(tree, plain)
    first_shares = plain.sent_kinds.index("secagg:shares", 8)  # a secure evaluation's second stage, after round 1
    grid = NodeGrid(nodes_of(exported), restart=("client-1", first_shares), same_id=True)
    tree["run"]["name"] = f"{method}-again"
    run = node_run(tree, grid)
    assert "status" not in run.summary and len(run.metrics) == 3
    dropped = run.summary.get("dropped", [])
    err = capsys.readouterr().err
    if method == "fedavg":
        assert f"clients [1] on client-1 (SuperNode 201): {SECRETS_LOST}; going on without them" in err
        assert [(d["kind"], d["clients"]) for d in dropped] == [("secagg:shares", [1])]  # that phase, then back
        assert STATE_LOST not in err
    else:  # the state it lost outweighs the phase's keys
        assert f"clients [1] on client-1 (SuperNode 201): {STATE_LOST}; going on without them" in err
        assert SECRETS_LOST not in err
        assert dropped[-1]["round"] == 3 and dropped[-1]["clients"] == [1]  # out for the rest of the run
        assert {d["round"] for d in dropped} == {dropped[0]["round"], *range(dropped[0]["round"], 4)}


def test_a_real_federation_resumes_from_its_checkpoint_on_the_same_sites_only(tmp_path, exported, server_identity,
                                                                              monkeypatch):
    """The server of a real federation stopped after its checkpoint of round 2: started again with the same
    sites, it sums their class counts again (the checkpoint holds only the method's setup), checks them and each
    site's digest of its training data against the run's, and the rest of the run equals the uninterrupted one.
    Other sites, or other data, are refused: another site's folder, or images changed under the same counts."""
    from fedlt.engine.flower_app import run_on_grid
    from fedlt.results import read_summary

    top = {"fl": {"rounds": 3}, "run": {"checkpoint_every": 1}, "eval": {"test_data": str(exported / "server" / "test")}}
    full = node_run(node_tree(tmp_path, "full", exported, **top), NodeGrid(nodes_of(exported)))
    cfg = build_config(node_tree(tmp_path, "cut", exported, **top))
    node_run_stopped_in(cfg.dump(), exported, 3, monkeypatch)
    run_dir = tmp_path / "runs" / "cut"
    assert read_summary(run_dir)["status"] == "aborted"

    two = dict(list(nodes_of(exported).items())[:2])
    renamed = {**two, "elsewhere": nodes_of(exported)[sorted(nodes_of(exported))[2]]}
    with pytest.raises(ConfigError, match=re.escape(f"the run's sites were {', '.join(sorted(nodes_of(exported)))}, "
                                                    f"the connected SuperNodes are {', '.join(sorted(renamed))}")):
        run_on_grid(cfg, NodeGrid(renamed), quiet=True, resume=run_dir)
    first, last = sorted(nodes_of(exported))[0], sorted(nodes_of(exported))[-1]
    swapped = {**nodes_of(exported), first: tmp_path / "other"}
    shutil.copytree(nodes_of(exported)[last], tmp_path / "other")  # a site that serves another site's data
    with pytest.raises(ConfigError, match=f"the data of site {first} are not those the run began with"):
        run_on_grid(cfg, NodeGrid(swapped), quiet=True, resume=run_dir)
    edited_copy(nodes_of(exported)[last], tmp_path / "edited")  # the same files, one image's pixels changed
    with pytest.raises(ConfigError, match=f"the data of site {last} are not those the run began with .the digest"):
        run_on_grid(cfg, NodeGrid({**nodes_of(exported), last: tmp_path / "edited"}), quiet=True, resume=run_dir)

    resumed = run_on_grid(cfg, NodeGrid(nodes_of(exported)), quiet=True, resume=run_dir)
    # the counts summed again are not the run's traffic: its comm is the uninterrupted run's
    assert [{k: v for k, v in m.items() if k != "time_s"} for m in resumed.metrics] == \
        [{k: v for k, v in m.items() if k != "time_s"} for m in full.metrics]
    assert resumed.summary["communication_bytes"] == full.summary["communication_bytes"]
    assert resumed.summary["final"] == full.summary["final"] and resumed.summary["nodes"] == full.summary["nodes"]
    assert resumed.summary["train_class_counts"] == full.summary["train_class_counts"]


@pytest.mark.parametrize(("leaks", "silent"), [(False, 1), (True, 1), (False, 2)])
def test_a_resume_names_the_site_that_did_not_answer_its_class_count_check(tmp_path, exported, server_identity,
                                                                           monkeypatch, leaks, silent):
    """A site whose SuperNode said hello to the resumed server but then did not answer its check of the class
    counts (stopped, hung) left the others' sum short of the run's, refused as if the sites' data differed (two
    such sites: too few answers to sum). The refusal names the sites and says to start them and resume again;
    the run's folder stays as it was."""
    from fedlt.engine.flower_app import run_on_grid

    top = {"fl": {"rounds": 2}, "run": {"checkpoint_every": 1},
           "eval": {"test_data": str(exported / "server" / "test")},
           **({"privacy": {"allow_leaks": True}} if leaks else {})}  # the counts in the clear, or a secure sum
    cfg = build_config(node_tree(tmp_path, "cut", exported, **top))
    node_run_stopped_in(cfg.dump(), exported, 2, monkeypatch)
    run_dir = tmp_path / "runs" / "cut"
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}

    names = sorted(nodes_of(exported))
    with pytest.raises(ConfigError) as refused:
        run_on_grid(cfg, NodeGrid(nodes_of(exported), silent_after_hello=silent), quiet=True, resume=run_dir)
    if silent == 1:
        assert str(refused.value) == (f"site {names[2]} (SuperNode 202) did not answer the resumed run's check of "
                                      "the sites' class counts; start its SuperNode (or see why it stopped), then "
                                      "run the same resume again")
    else:
        assert str(refused.value).startswith(f"sites {names[1]} (SuperNode 201), {names[2]} (SuperNode 202) did not "
                                             "answer the resumed run's check of the sites' class counts; start their "
                                             "SuperNodes (or see why they stopped)")
    assert {p.name: p.read_bytes() for p in run_dir.iterdir()} == before


@pytest.mark.parametrize("leaks", [False, True])
def test_a_new_run_whose_site_does_not_answer_the_class_counts_names_it_and_trains_nothing(tmp_path, exported,
                                                                                           server_identity, leaks):
    """A site that said hello but then did not answer the class-count exchange left the sum short of it: the
    many/medium/few groups were drawn from the other sites' counts for the whole run (only a log line said
    so), and a resume, summing every site, then took the run's data for other data."""
    from fedlt.engine.flower_app import run_on_grid

    top = {"fl": {"rounds": 2}, "eval": {"test_data": str(exported / "server" / "test")},
           **({"privacy": {"allow_leaks": True}} if leaks else {})}
    grid = NodeGrid(nodes_of(exported), silent_after_hello=1)
    with pytest.raises(FedltError) as refused:
        run_on_grid(build_config(node_tree(tmp_path, "short", exported, **top)), grid, quiet=True)
    assert str(refused.value) == (
        f"site {sorted(nodes_of(exported))[2]} (SuperNode 202) did not answer the federation's class-count exchange "
        "before round 1: the class counts and the many/medium/few groups need every site's; start its SuperNode (or "
        "see why it stopped), then start the run again")
    assert "fit" not in grid.sent_kinds and "setup" not in str(grid.sent_kinds)  # nothing trained, no setup stage


def test_fedlt_deploy_resume_of_a_finished_run_says_so_without_starting_a_federation(tmp_path, monkeypatch, capsys):
    """A deployed run that has ended all its rounds started a whole deployment again (40 s) to train nothing
    and print its result; it now prints that line at once, as `fedlt run --resume` does, whatever its
    clients kept on their nodes (nothing is asked of them)."""
    import yaml

    from fedlt import deploy
    from fedlt.engine.flower_app import final_line

    cfg = {"seed": 0, "method": "fedper", "data": {"dataset": "synthetic", "num_clients": 3, "imbalance_factor": 10},
           "fl": {"rounds": 2, "participation": 1.0, "local_epochs": 1, "batch_size": 32, "lr": 0.05},
           "eval": {"every": 1}, "run": {"out_dir": str(tmp_path), "name": "done", "threads": 1}}
    result = fedlt.run(build_config(cfg), quiet=True)
    ran = yaml.safe_load((result.run_dir / "config.yaml").read_text())
    (result.run_dir / "config.yaml").write_text(yaml.safe_dump({**ran, "engine": "flower"}))  # as deployed
    monkeypatch.setattr(deploy, "local_federation", lambda *args, **kwargs: pytest.fail("a federation was started"))
    assert deploy.deploy(None, [], resume=result.run_dir, workdir=tmp_path / "work") == 0
    out, err = capsys.readouterr()
    assert out == final_line(result.run_dir.resolve(), result.summary) + "\n" and err == ""
    assert out.startswith(f"fedlt: {result.run_dir.resolve()}: finished; final acc ")

    assert deploy.deploy(None, ["fl.rounds=3"], resume=result.run_dir, workdir=tmp_path / "work") == 2  # still checked
    assert "goes on with the run's own config" in capsys.readouterr().err


def test_a_deployed_resume_that_stops_before_its_first_round_says_its_folder_is_as_it_was(tmp_path, monkeypatch):
    """A ClientApp failing the resume's check of the class counts was reported as "the run was aborted after 0
    round(s) ...; its summary is in RUN_DIR", though the resume wrote nothing there: the folder still holds
    what it held, and the same resume goes on once the site is mended."""
    import json
    from types import SimpleNamespace

    from fedlt.deploy import _aborted
    from fedlt.engine import flower_app
    from fedlt.results import OUTCOME_ENV

    run_dir, outcome = tmp_path / "run", tmp_path / "outcome.json"

    def resumed(cfg, grid, on_start, prompt, resume):
        on_start(SimpleNamespace(resuming=True, round_started=0), resume)
        raise FedltError("setup (counts): client 2 failed: ValueError: bad labels")

    monkeypatch.setenv(OUTCOME_ENV, str(outcome))
    monkeypatch.setattr(flower_app, "run_on_grid", resumed)
    monkeypatch.setattr(flower_app, "deployed_config", lambda run_config, where: None)
    monkeypatch.setattr(flower_app, "app_dir", lambda grid: None)
    with pytest.raises(FedltError):
        flower_app.main(SimpleNamespace(), SimpleNamespace(run_config={"resume": str(run_dir)}))
    assert _aborted(json.loads(outcome.read_text())) == (
        f"the resumed run stopped before it trained a round: setup (counts): client 2 failed: ValueError: bad "
        f"labels; {run_dir.resolve()} is as it was")
    assert _aborted({"status": "aborted", "reason": "x", "run_dir": "r", "rounds_done": 3, "untouched": False}
                    ).startswith("the run was aborted after 3 round(s): x; its summary is in r")


def test_a_deployment_stopped_after_a_checkpoint_goes_on_with_deploy_resume(tmp_path, exported):
    """`fedlt deploy` stopped by SIGTERM after round 1 of 3 (say, the server's machine going down), then
    `fedlt deploy --resume RUN_DIR` with the same site folders: new SuperLink, SuperNodes and ServerApp go on
    from the last checkpoint, and the run ends as the in-process run does (one exchange a round, to be quick)."""
    import json
    import signal
    import subprocess
    import sys
    import time

    import yaml

    local = fedlt.run(tree(tmp_path, "local", fl={"rounds": 3}, eval={"personalized": False}), quiet=True)
    config = tmp_path / "federation.yaml"
    deployed = yaml.safe_load((exported / "federation.yaml").read_text())
    deployed["run"].update(out_dir=str(tmp_path / "runs"), name="deployed", checkpoint_every=1)
    deployed["fl"]["rounds"], deployed["eval"]["personalized"] = 3, False
    config.write_text(yaml.safe_dump(deployed))
    run_dir = tmp_path / "runs" / "deployed"
    sites = ["--node-data", str(exported / "nodes"), "--server-test", str(exported / "server" / "test"),
             "--workdir", str(tmp_path / "work"), "--timeout", "240"]
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0"}
    err = tmp_path / "first.err"
    with err.open("w") as stderr:  # a file, not a pipe nobody reads while the run goes
        first = subprocess.Popen([sys.executable, "-m", "fedlt.cli", "deploy", *sites, str(config)], env=env,
                                 stdout=subprocess.DEVNULL, stderr=stderr)
    deadline = time.monotonic() + 240
    while not ((run_dir / "checkpoint.pt").is_file() and (run_dir / "metrics.jsonl").is_file()):
        assert first.poll() is None and time.monotonic() < deadline, err.read_text()[-3000:]
        time.sleep(0.2)
    first.send_signal(signal.SIGTERM)
    assert first.wait(120) == 143
    last = err.read_text().splitlines()[-1]  # the stopped deploy names the command that goes on
    assert re.fullmatch(rf"fedlt: error: stopped by SIGTERM; every process of the federation was stopped; `fedlt "
                        rf"deploy --resume {re.escape(str(run_dir))}` with the same options goes on from its "
                        r"checkpoint of round [123]", last), last
    proc = subprocess.run([sys.executable, "-m", "fedlt.cli", "deploy", "--resume", str(run_dir), *sites],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert "status" not in summary and summary["segments"][-1]["from_round"] in (2, 3)  # after the last checkpoint
    for key in ("acc", "per_class_acc"):
        expected = local.summary["final"][key]
        assert summary["final"][key] == (expected if isinstance(expected, list)
                                         else pytest.approx(expected, abs=tolerance(key))), key
    refused = subprocess.run([sys.executable, "-m", "fedlt.cli", "deploy", "--resume", str(run_dir), str(config)],
                             capture_output=True, text=True, timeout=60, env=env)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        f"fedlt: error: --resume {run_dir} goes on with the run's own config; drop '{config}'"]


def test_deploy_resume_names_the_deploy_option_that_is_not_the_runs(tmp_path, exported, server_identity):
    """`fedlt deploy --resume` with another --node-data (a site missing), another --server-test, or none of them
    was refused as an edited config.yaml ('restore that value'), or, for other site names of the same count,
    only once the federation was up; each is now named by its option before anything starts."""
    from fedlt.deploy import plan_deployment

    top = {"fl": {"rounds": 1}, "run": {"checkpoint_every": 1}, "eval": {"test_data": str(exported / "server" / "test")}}
    run_dir = node_run(node_tree(tmp_path, "done", exported, **top), NodeGrid(nodes_of(exported))).run_dir
    # stopped after its last checkpoint, before its summary: a run to go on with (a finished one starts nothing)
    (run_dir / "summary.json").unlink()
    names = sorted(nodes_of(exported))
    two, renamed, test = tmp_path / "two", tmp_path / "renamed", tmp_path / "test"
    for name in names[:2]:
        shutil.copytree(nodes_of(exported)[name], two / name)
        shutil.copytree(nodes_of(exported)[name], renamed / name)
    shutil.copytree(nodes_of(exported)[names[2]], renamed / "elsewhere")
    shutil.copytree(exported / "server" / "test", test)
    refusals = {
        "no --node-data": ({}, f"{run_dir} ran on sites that hold their own data ({', '.join(names)}); resume it "
                               "with --node-data DIR"),
        "a site missing": ({"node_data": two}, f"--node-data {two} holds sites {', '.join(names[:2])}, but {run_dir} "
                                               f"ran on {', '.join(names)}; pass the folder of the run's own sites"),
        "a site renamed": ({"node_data": renamed}, f"--node-data {renamed} holds sites "),
        "another test set": ({"node_data": exported / "nodes", "server_test": test},
                             f"--server-test {test} is not the server test set {run_dir} ran with"),
    }
    for what, (options, refusal) in refusals.items():
        with pytest.raises(ConfigError, match=re.escape(refusal)):
            plan_deployment("", [], resume=run_dir, **options)
    plan = plan_deployment("", [], resume=run_dir, node_data=exported / "nodes", server_test=exported / "server" / "test")
    assert plan.resume == run_dir and [s.name for s in plan.sites] == names


def test_a_resume_refused_for_state_kept_on_sites_names_the_sites(tmp_path, exported, server_identity, monkeypatch):
    """A deployment on sites' own data refused a resume of a stateful method naming clients by number
    ("clients [0, 1, 2]"), where every other line of the deployment names the sites."""
    from fedlt.engine.flower_app import resumable_on_nodes

    cfg = node_tree(tmp_path, "kept", exported, method="ditto", loss={"name": "ce"}, fl={"rounds": 3},
                    run={"checkpoint_every": 1}, eval={"test_data": str(exported / "server" / "test")})
    node_run_stopped_in(cfg, exported, 2, monkeypatch)
    run_dir = tmp_path / "runs" / "kept"
    names = ", ".join(sorted(nodes_of(exported)))
    with pytest.raises(ConfigError, match=re.escape(f"sites {names} of {run_dir} kept state between rounds")):
        resumable_on_nodes(build_config(cfg), run_dir)


class BackOnItsOwnFolder(NodeGrid):
    """After the N-th send the restarted site's SuperNode is started again, under the same id, on its own folder."""

    def __init__(self, folders: dict[str, Path], back_after: int, **kwargs):
        super().__init__(folders, **kwargs)
        self.own, self.back_after = dict(folders), back_after

    def get_node_ids(self):
        nodes = super().get_node_ids()
        if self.restarted and self.sends >= self.back_after:
            old = next(n for n, ctx in self.contexts.items() if ctx.node_config["name"] == self.restart[0])
            if self.contexts[old].node_config["data"] != str(self.own[self.restart[0]]):
                config = {**self.contexts[old].node_config, "data": str(self.own[self.restart[0]])}
                self.contexts[old] = Context(run_id=1, node_id=old, state=RecordDict(), run_config={},
                                             node_config=config)
        return nodes


@pytest.mark.parametrize("back", [False, True])
def test_a_site_started_again_under_its_old_id_on_other_data_takes_no_part(tmp_path, exported, server_identity,
                                                                            capsys, back):
    """A SuperNode with a registered key started again on other data keeps its id, so the server asks it no
    hello: its replies say which data answered, and none from other data than the site's is used. Started
    again on the site's own folder, its (stateless) client takes part again."""
    site = "client-1"
    edited_copy(nodes_of(exported)[site], tmp_path / "edited")
    # sends: hello, the secure count sum (4), round 1's fit (6th), its secure evaluation (5), round 2's fit (11th)
    grid = BackOnItsOwnFolder(nodes_of(exported), 14 if back else 99, restart=(site, 6), same_id=True,
                              restart_folder=tmp_path / "edited")
    run = node_run(node_tree(tmp_path, "edited", exported, fl={"rounds": 3},
                             eval={"test_data": str(exported / "server" / "test")}), grid)
    assert "status" not in run.summary and len(run.metrics) == 3
    err = capsys.readouterr().err
    assert err.count(f"fedlt: SuperNode 201 serves site '{site}', but its training data are not those the site began "
                     "the run with (the digest of its images and labels differs); it takes no part (start it on the "
                     "site's own folder to rejoin)\n") == 1
    assert grid.sent_kinds.count("hello") == 1  # none asked of it: it is sent every round's fit
    assert all(201 in targets for kind, targets in zip(grid.sent_kinds, grid.targets) if kind == "fit")
    from fedlt.engine.flower_nodes import OTHER_DATA

    fits_without_it = [d["round"] for d in run.summary["dropped"] if d["kind"] == "fit" and d["clients"] == [1]]
    assert fits_without_it == ([2] if back else [2, 3])
    assert f"clients [1] on {site} (SuperNode 201): {OTHER_DATA}; going on without them" in err
    assert err.count(f"fedlt: SuperNode 201 serves site '{site}' with the site's own training data again\n") == back
