"""The Flower engine: one ``ServerApp`` and one ``ClientApp`` that run any fedlt method.

The server side is the in-process engine's round loop (:class:`Simulation`) with another
transport: each phase (fit, a method's query, personalized evaluation) becomes one RecordDict
per client, sent to the SuperNode that hosts it with ``grid.send_and_receive(..., timeout=...)``.
The client side is the in-process engine's :class:`ClientRuntime`; a client's ``ctx.state`` lives
in the SuperNode's ``context.state``. Nothing here knows any method.

Client ids map to SuperNodes by ``partition-id`` (from ``--node-config``, set by the simulation
engine too): client ``k`` lives on the node with ``partition-id == k % num-partitions``, so N
SuperNodes can host K >= N clients. Every node builds the same seeded partition from the
config it is sent and trains only its own clients' rows: no data moves.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from flwr.app import ConfigRecord, Context, Message as FlowerMessage, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid, ServerApp

from fedlt.config import Config, build_config, load_config
from fedlt.engine.clients import EVALUATE, ClientRuntime
from fedlt.engine.flower_codec import (
    decode_message, decode_meta, decode_reply, drop_tree, encode_message, get_tree, has_tree, put_tree,
)
from fedlt.engine.simulation import RunResult, Simulation
from fedlt.errors import ConfigError, FedltError
from fedlt.messages import Message, Reply

HELLO = "hello"
#: client errors that are bugs to surface, not dropouts to survive
_RAISED = (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.LOAD_CLIENT_APP_EXCEPTION)


def _message_type(kind: str) -> str:
    return {"fit": "train", EVALUATE: "evaluate"}.get(kind, "query")


# ---- client side ----------------------------------------------------------------------------
_runtime: dict[str, ClientRuntime] = {}  # one per process, rebuilt when the config changes


def _client_runtime(config_json: str) -> ClientRuntime:
    if config_json not in _runtime:
        from fedlt.api import setup_parts

        _runtime.clear()
        cfg = build_config(json.loads(config_json))
        spec, data, device = setup_parts(cfg)
        _runtime[config_json] = ClientRuntime(cfg, spec, data, device)
    return _runtime[config_json]


def _partition(context: Context) -> tuple[int, int]:
    try:
        return int(context.node_config["partition-id"]), int(context.node_config["num-partitions"])
    except KeyError:
        raise FedltError('a fedlt SuperNode needs --node-config "partition-id=I num-partitions=N"') from None


clientapp = ClientApp()


@clientapp.train()
@clientapp.evaluate()
@clientapp.query()
def handle(message: FlowerMessage, context: Context) -> FlowerMessage:
    """Answer one fedlt exchange for the client named in the message, with its state from
    ``context.state`` (stored back afterwards, or dropped when empty)."""
    meta = decode_meta(message.content)
    runtime = _client_runtime(meta["config"])
    pid, parts = _partition(context)
    if meta["kind"] == HELLO:
        return FlowerMessage(encode_message(Reply(), {"partition_id": pid, "num_partitions": parts}), reply_to=message)
    cid = meta["cid"]
    if cid % parts != pid:
        raise FedltError(f"client {cid} was sent to the node of partition {pid}, but lives on partition {cid % parts}")
    prefix = f"client{cid}."
    state = get_tree(context.state, prefix, runtime.device) if has_tree(context.state, prefix) else {}
    reply = runtime.handle(meta["kind"], cid, meta["round"], decode_message(message.content, runtime.device), state)
    if state:
        put_tree(context.state, prefix, state, where=f"client {cid}'s ctx.state")
    else:
        drop_tree(context.state, prefix)
    return FlowerMessage(encode_message(reply, {"cid": cid}), reply_to=message)


# ---- server side ----------------------------------------------------------------------------
class FlowerSimulation(Simulation):
    """The in-process round loop whose clients answer over a Flower ``Grid``."""

    engine = "flower"
    reports_dropouts = True

    def __init__(self, cfg: Config, spec, data, device: torch.device, grid: Grid):
        if spec.pooled:
            raise ConfigError(f"method {cfg.method} trains on pooled data; run it with engine=inprocess")
        self.grid = grid
        self._config_json = json.dumps(cfg.dump())
        self.nodes: dict[int, int] = {}  # client id -> node id
        super().__init__(cfg, spec, data, device)

    def _client_runtime(self) -> None:
        return None

    @property
    def worker(self):
        raise FedltError("under engine=flower the clients' models live on the SuperNodes")

    def _send(self, kind: str, targets: list[tuple[int, int, Message, int]]) -> list[FlowerMessage]:
        """Send (node, client, message, round) tuples as one batch; the replies that arrived."""
        out = [FlowerMessage(encode_message(msg, {"kind": kind, "cid": cid, "round": rnd, "config": self._config_json}),
                             dst_node_id=node, message_type=_message_type(kind))
               for node, cid, msg, rnd in targets]
        replies = list(self.grid.send_and_receive(out, timeout=self.cfg.flower.timeout_s))
        for r in replies:
            if r.has_error() and r.error.code in _RAISED:
                raise FedltError(f"a ClientApp failed ({kind}) on node {r.metadata.src_node_id}: {r.error.reason}")
        return [r for r in replies if not r.has_error()]

    def connect(self) -> None:
        """Ask every SuperNode for its partition until each partition 0..N-1 has answered, within
        ``flower.connect_timeout_s``; then map client ids to nodes."""
        deadline = time.monotonic() + self.cfg.flower.connect_timeout_s
        found: dict[int, tuple[int, int]] = {}  # node -> (partition id, partitions)
        while True:
            new = [n for n in self.grid.get_node_ids() if n not in found]
            if new:
                for r in self._send(HELLO, [(n, -1, Message(), 0) for n in new]):
                    meta = decode_meta(r.content)
                    found[r.metadata.src_node_id] = (meta["partition_id"], meta["num_partitions"])
            parts = {n for _, n in found.values()}
            if len(parts) > 1:
                raise FedltError(f"SuperNodes disagree on num-partitions ({sorted(parts)}); start all with the same N")
            ids = sorted(p for p, _ in found.values())
            if len(ids) != len(set(ids)):
                raise FedltError(f"two SuperNodes share a partition-id ({ids}); give each its own")
            if parts and set(ids) == set(range(parts.pop())):
                break
            if time.monotonic() > deadline:
                raise FedltError(f"only partitions {ids} connected within flower.connect_timeout_s="
                                 f"{self.cfg.flower.connect_timeout_s:g}; start the missing SuperNodes")
            time.sleep(0.5)
        node_of = {pid: node for node, (pid, _) in found.items()}
        self.nodes = {cid: node_of[cid % len(node_of)] for cid in self.all_clients}

    def _deliver(self, kind: str, rnd: int, messages: Iterable[tuple[int, Message]]
                 ) -> Iterator[tuple[int, Message, Reply]]:
        items = list(messages)
        if not items:
            return
        alive = set(self.grid.get_node_ids())
        targets = [(self.nodes[cid], cid, msg, rnd) for cid, msg in items if self.nodes[cid] in alive]
        got = {decode_meta(r.content)["cid"]: r for r in self._send(kind, targets)} if targets else {}
        missing = [cid for cid, _ in items if cid not in got]
        if missing:
            self.dropped.append({"round": rnd, "kind": kind, "clients": missing})
        need = math.ceil(self.cfg.flower.min_reply_fraction * len(items))
        if len(got) < need:
            raise FedltError(f"round {rnd} ({kind}): {len(got)} of {len(items)} clients answered within "
                             f"flower.timeout_s={self.cfg.flower.timeout_s:g}, fewer than flower.min_reply_fraction="
                             f"{self.cfg.flower.min_reply_fraction:g} requires; check the SuperNodes")
        for cid, msg in items:
            if cid in got:
                yield cid, msg, decode_reply(got[cid].content, self.device)

    def run(self, run_dir: Path, resume: bool = False, quiet: bool = False) -> RunResult:
        if resume:
            raise ConfigError("engine=flower cannot resume (client state lives on the SuperNodes); start a new run")
        self.connect()
        return super().run(run_dir, quiet=quiet)


def run_on_grid(cfg: Config, grid: Grid, quiet: bool = False) -> RunResult:
    """Run ``cfg`` over the SuperNodes behind ``grid`` and write a run directory as usual."""
    from fedlt.api import setup_parts
    from fedlt.results import new_run_dir

    spec, data, device = setup_parts(cfg)
    sim = FlowerSimulation(cfg, spec, data, device, grid)
    return sim.run(new_run_dir(cfg), quiet=quiet)


serverapp = ServerApp()


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run``: the fedlt config named by the run config (``config``, ``overrides``)."""
    rc = context.run_config
    cfg = load_config(str(rc.get("config", "")) or None, shlex.split(str(rc.get("overrides", ""))))
    result = run_on_grid(cfg, grid)
    print(f"fedlt: {result.run_dir}: final acc {result.summary['final'].get('acc')}", flush=True)


def simulate(cfg: Config, quiet: bool = False) -> RunResult:
    """``fedlt run ... engine=flower``: ``cfg`` on Flower's simulation engine (Ray), one virtual
    SuperNode per client."""
    from flwr.simulation import run_simulation

    result: dict[str, RunResult] = {}
    app = ServerApp()

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        result["run"] = run_on_grid(cfg, grid, quiet=quiet)

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # inherited by the Ray actors
    resources = {"num_cpus": cfg.flower.cpus_per_client, "num_gpus": 0.0}
    run_simulation(app, clientapp, num_supernodes=cfg.data.num_clients,
                   backend_config={"client_resources": resources, "init_args": {"include_dashboard": False}})
    if "run" not in result:
        raise FedltError("the Flower simulation ended without a result; its log above says why")
    return result["run"]
