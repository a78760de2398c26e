"""The Flower engine: one ``ServerApp`` and one ``ClientApp`` that run any fedlt method.

The server side is the in-process engine's round loop (:class:`Simulation`) with another
transport: each phase (fit, a method's query, personalized evaluation) becomes one RecordDict
per client, sent to the SuperNode that hosts it with ``grid.send_and_receive(..., timeout=...)``
(in a deployment :func:`poll_replies`, which asks for the replies more often).
The client side is the in-process engine's :class:`ClientRuntime`; a client's ``ctx.state`` lives
in the SuperNode's ``context.state``. Nothing here knows any method.

Client ids map to SuperNodes by ``partition-id`` (from ``--node-config``, set by the simulation
engine too): client ``k`` lives on the node with ``partition-id == k % num-partitions``, so N
SuperNodes can host K >= N clients. Every node builds the same seeded partition from the
config it is sent and trains only its own clients' rows: no data moves. A SuperNode started with
``--node-config 'data="PATH" name="SITE"'`` is instead one client of a real federation that holds only
its own folder (``flower.node_data``, :mod:`fedlt.engine.flower_nodes`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import signal
import socket
import sys
import threading
import time
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

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
from fedlt.engine.flower_waits import quick_object_pulls
from fedlt.engine.process_pool import cpu_cores
from fedlt.engine.secure_aggregation import ENTRY as SECURE_ENTRY, SHARES, UNMASK
from fedlt.engine.checkpoint import CHECKPOINT_FILE, load_checkpoint
from fedlt.engine.simulation import RunResult, Simulation, check_resumable
from fedlt.errors import ConfigError, FedltError, Terminated, TrainingDiverged
from fedlt.messages import Message, Reply
from fedlt.methods.registry import parse_method_args
from fedlt.results import (
    CONFIG_FILE, LOST_NODES_ENV, OUTCOME_ENV, STOP_REASON_ENV, model_notes, new_run_dir, write_aborted_summary,
    write_atomic, writing,
)
from fedlt.run_parts import setup_parts, setup_runtime

HELLO = "hello"
#: client errors that are bugs to surface, not dropouts to survive
_RAISED = (ErrorCode.CLIENT_APP_RAISED_EXCEPTION, ErrorCode.LOAD_CLIENT_APP_EXCEPTION)
#: dropout causes in ``dropped`` records: Flower reported the node gone, or our own timeout expired
NODE_LOST, TIMEOUT = "node lost", "timeout"
#: why a node is gone: fedlt.deploy saw its process exit, or the SuperLink no longer lists it
EXITED, LEFT = "their SuperNode's process exited", "their SuperNode left the federation"
#: why a client's reply is not used: its node lost what the client held there (a SuperNode started again under
#: its old id, as one with a registered key is): its state between rounds (for good), or a secure phase's keys
STATE_LOST = "their SuperNode lost the client's state between rounds (started again?); it takes no further part"
SECRETS_LOST = "their SuperNode lost this secure phase's keys (started again?)"


def _lost_reason(error) -> str:
    if error.code == ErrorCode.NODE_UNAVAILABLE:
        return "Flower's heartbeat lost their SuperNode"
    return f"Flower reported error {error.code}: {error.reason.splitlines()[0][:120]}"


def client_failure(reason: str) -> str:
    """The line of a ClientApp's failure that says what failed. Flower's simulation passes on Ray's
    report: terminal colour codes, the actor's traceback, then ``... occurred. Message: <the error>``."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", reason).strip()
    wrapped = "Message: " in plain
    if wrapped and plain.startswith("<class ") and plain.endswith("'>"):  # Flower's <class ...>:<'report'>
        plain = plain[:-2]
    lines = [line.strip() for line in plain.rsplit("Message: ", 1)[-1].splitlines() if line.strip()]
    if not lines:
        return "no reason given"
    return (lines[0] if wrapped else lines[-1])[:400]  # the wrapped error; else a traceback's last line


def describe_error(err: BaseException) -> str:
    """One line for an exception that ended a run (a FedltError's text is already that line)."""
    if isinstance(err, FedltError):
        return str(err)
    if isinstance(err, (KeyboardInterrupt, SystemExit)):
        told = Path(os.environ.get(STOP_REASON_ENV, "") or os.devnull)  # why fedlt.deploy stopped it, if it did
        reason = told.read_text().strip() if told.is_file() else ""
        return f"the ServerApp was stopped by a signal: {reason}" if reason else "the ServerApp was stopped by a signal"
    text = str(err).strip().splitlines()[0][:200] if str(err).strip() else ""
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


#: seconds between a deployed ServerApp's requests for replies
REPLY_POLL_S = 0.1
#: seconds between a deployed ServerApp's looks at which nodes are gone while it waits for replies
GONE_POLL_S = 1.0


def lost_sites() -> list[str]:
    """The sites whose SuperNode process :mod:`fedlt.deploy` saw exit (``$FEDLT_LOST_NODES_FILE``), once
    per exit: a site whose SuperNode was started again and rejoined can be listed a second time."""
    path = os.environ.get(LOST_NODES_ENV)
    try:
        return [line for line in Path(path).read_text().split("\n") if line] if path else []
    except OSError:  # none lost yet
        return []


def poll_replies(grid: Grid, messages: list[FlowerMessage], timeout: float,
                 every: float = REPLY_POLL_S, stop: threading.Event | None = None,
                 gone: Callable[[], set[int]] | None = None) -> list[FlowerMessage]:
    """``grid.send_and_receive(messages, timeout=timeout)`` asking for the replies every ``every``
    seconds: Flower's deployed grid asks every 3 s (``flwr/superlink/grid/http_grid.py``), up to
    3 s of idle waiting per phase of a round that may train for less than a second. ``stop``: set
    when the run was interrupted (a simulation's Ctrl-C reaches its main thread, not this one), which
    ends the wait with KeyboardInterrupt instead of waiting out ``timeout`` for replies that will not come.
    ``gone()``: the nodes known to be gone (every :data:`GONE_POLL_S`); their replies are not waited for."""
    pending = set(grid.push_messages(messages))
    node_of = {m.metadata.message_id: m.metadata.dst_node_id for m in messages}
    deadline = time.monotonic() + timeout
    replies: list[FlowerMessage] = []
    looked = time.monotonic()
    while True:
        if stop is not None and stop.is_set():
            raise KeyboardInterrupt
        got = list(grid.pull_messages(pending))
        replies += got
        pending -= {r.metadata.reply_to_message_id for r in got}
        if gone is not None and pending and time.monotonic() - looked >= GONE_POLL_S:
            looked, dead = time.monotonic(), gone()
            pending -= {i for i in pending if node_of.get(i) in dead}
        if not pending or time.monotonic() >= deadline:
            return replies
        if stop is not None:
            stop.wait(every)
        else:
            time.sleep(every)


def log(line: str) -> None:
    """A line for the ServerApp's log (Flower streams its output to ``flwr run --stream``)."""
    print(line, file=sys.stderr, flush=True)


def _message_type(kind: str) -> str:
    return {"fit": "train", EVALUATE: "evaluate"}.get(kind, "query")


# ---- client side ----------------------------------------------------------------------------
_runtime: dict[str, ClientRuntime] = {}  # one per process, rebuilt when the config changes


def _client_runtime(config_json: str) -> ClientRuntime:
    if config_json not in _runtime:
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


def without_termination_notice(record: logging.LogRecord) -> bool:
    """Whether Flower's log keeps a record: not the WARNING each simulated client's actor logs when the
    simulation ends it, finished or stopped (``Manually terminating ClientAppActor``), which Ray forwards
    to the run's output, where it reads as a problem."""
    return not record.getMessage().startswith("Manually terminating ")


logging.getLogger("flwr").addFilter(without_termination_notice)  # here: the module each client's actor imports


@clientapp.train()
@clientapp.evaluate()
@clientapp.query()
def handle(message: FlowerMessage, context: Context) -> FlowerMessage:
    """Answer one fedlt exchange for the client named in the message, with its state from
    ``context.state`` (stored back afterwards, or dropped when empty)."""
    meta = decode_meta(message.content)
    from fedlt.engine.flower_nodes import hello_reply, node_config, node_runtime  # a module that imports this one

    own = node_config(dict(context.node_config))
    said: dict[str, Any] = {}  # what every reply says of its node beside the client's flags
    if own is not None:  # a SuperNode of a real federation: one client, its own data
        runtime = node_runtime(meta["config"], own[0])
        if meta["kind"] == HELLO:
            return FlowerMessage(encode_message(Reply(), hello_reply(own[1], runtime.train_data)), reply_to=message)
        # which data answer: a SuperNode started again under its old id (a registered key) is asked no hello
        said["digest"] = runtime.train_data.digest
    else:
        runtime = _client_runtime(meta["config"])
        pid, parts = _partition(context)
        if meta["kind"] == HELLO:
            return FlowerMessage(encode_message(Reply(), {"partition_id": pid, "num_partitions": parts}),
                                 reply_to=message)
        if meta["cid"] % parts != pid:
            raise FedltError(f"client {meta['cid']} was sent to the node of partition {pid}, but lives on partition "
                             f"{meta['cid'] % parts}")
    cid = meta["cid"]
    prefix = f"client{cid}."
    state = get_tree(context.state, prefix, runtime.device) if has_tree(context.state, prefix) else {}
    had = _keeps_state(state)  # what it brought: the server tells a node that lost it (started again) apart
    incoming = decode_message(message.content, runtime.device)
    if SECURE_ENTRY not in state and (meta["kind"] in (SHARES, UNMASK) or SECURE_ENTRY in incoming.payload):
        return FlowerMessage(encode_message(Reply(), {"cid": cid, "had_state": had, "secrets_lost": True, **said}),
                             reply_to=message)
    reply = runtime.handle(meta["kind"], cid, meta["round"], incoming, state)
    if state:
        put_tree(context.state, prefix, state, where=f"client {cid}'s ctx.state")
    else:
        drop_tree(context.state, prefix)
    return FlowerMessage(encode_message(reply, {"cid": cid, "had_state": had, "kept_state": _keeps_state(state),
                                                **said}), reply_to=message)


def _keeps_state(state: dict[str, Any]) -> bool:
    """Whether a client's ``ctx.state`` holds state between rounds: a site whose SuperNode is started again
    rejoins only without. A secure phase's secrets are no such state: they last one exchange."""
    return any(key != SECURE_ENTRY for key in state)


# ---- server side ----------------------------------------------------------------------------
class FlowerSimulation(Simulation):
    """The in-process round loop whose clients answer over a Flower ``Grid``."""

    engine = "flower"
    reports_dropouts = True
    #: set from another thread when the run was interrupted (see :func:`poll_replies`)
    stop: threading.Event | None = None

    def __init__(self, cfg: Config, spec, data, device: torch.device, grid: Grid, prompt: bool = False):
        if spec.pooled:
            raise ConfigError(f"method {cfg.method} trains on pooled data; run it with engine=inprocess")
        self.grid = grid
        self.prompt = prompt  # poll_replies instead of the grid's own send_and_receive
        self._config_json = json.dumps(cfg.dump())
        self.nodes: dict[int, int] = {}  # client id -> node id
        self.node_names: dict[int, str] = {}  # node id -> its site (partition-I, or the node's name)
        self.exited: set[int] = set()  # nodes whose process fedlt.deploy saw exit: sent nothing more
        self.gone: dict[int, str] = {}  # node id -> why it is gone, as last looked at
        #: node id -> how many of its site's nodes served before it (a site's SuperNode started again): the
        #: site's first lines in the lost-nodes file are theirs, whenever they were written
        self.lost_before: dict[int, int] = {}
        #: client id -> whether its last reply said it keeps state between rounds on its node
        self.kept_state: dict[int, bool] = {}
        #: clients whose last message no reply answered (lost, too late)
        self.unheard: set[int] = set()
        #: clients whose node lost the state they kept there: sent nothing more
        self.state_lost: set[int] = set()
        self.round_started = 0
        self.aborted = False
        #: a resume that has not trained yet: the folder is still the stopped run's, and a failure (nodes that do
        #: not come, other sites, a second resume of the folder) leaves it as it was, its summary too
        self.resuming = False
        super().__init__(cfg, spec, data, device)
        #: whether the method says its clients keep such state: a resume needs it where no reply showed any (lost)
        self.keeps_state = spec.clients_keep_state(parse_method_args(spec, cfg.method_args), self.server_model)

    def _client_runtime(self) -> None:
        return None

    @property
    def worker(self):
        raise FedltError("under engine=flower the clients' models live on the SuperNodes")

    def outgoing(self, kind: str, node: int, cid: int, msg: Message, rnd: int) -> FlowerMessage:
        """``msg`` for client ``cid`` on ``node`` as Flower carries it, with what the ClientApp needs to answer."""
        return FlowerMessage(encode_message(msg, {"kind": kind, "cid": cid, "round": rnd, "config": self._config_json}),
                             dst_node_id=node, message_type=_message_type(kind))

    def may_keep_state(self, cid: int) -> bool:
        """Whether client ``cid``'s node may hold state of it between rounds: as its last reply said, or,
        where its last message went unanswered (its node may have stored state then), as its method declares."""
        return self.kept_state.get(cid, False) or (self.keeps_state and cid in self.unheard)

    def other_data(self, meta: dict[str, Any]) -> str | None:
        """Why a reply (its ``meta``) is not used as its node holds other data than its client's, or None:
        here never, as every node draws its partition from the config."""
        return None

    def _send(self, kind: str, targets: list[tuple[int, int, Message, int]]
              ) -> tuple[list[FlowerMessage], dict[int, str]]:
        """Send (node, client, message, round) tuples as one batch: the replies that arrived, and
        why Flower says the others' nodes are gone (client -> reason), told apart from silence."""
        out = [self.outgoing(kind, node, cid, msg, rnd) for node, cid, msg, rnd in targets]
        timeout = self.cfg.flower.timeout_s
        self.gone = dict.fromkeys(self.exited, EXITED)
        replies = (poll_replies(self.grid, out, timeout, stop=self.stop, gone=self._gone_nodes)
                   if self.prompt or self.stop else list(self.grid.send_and_receive(out, timeout=timeout)))
        cid_of = {m.metadata.message_id: cid for m, (_, cid, _, _) in zip(out, targets)}  # ids set when sent
        lost: dict[int, str] = {}
        for r in replies:
            if r.has_error() and r.error.code in _RAISED:
                raise FedltError(f"a ClientApp failed ({kind}) on {self.site_of(r.metadata.src_node_id)}: "
                                 f"{client_failure(r.error.reason)}")
            if r.has_error() and r.metadata.reply_to_message_id in cid_of:
                lost[cid_of[r.metadata.reply_to_message_id]] = _lost_reason(r.error)
        answered = {cid_of.get(r.metadata.reply_to_message_id) for r in replies}
        for node, cid, _, _ in targets:
            if cid not in answered and node in self.gone:
                lost[cid] = self.gone[node]
        return [r for r in replies if not r.has_error()], lost

    def site_of(self, node: int) -> str:
        """A node as its operator knows it: its site (the partition, or the name it was started with)
        and Flower's id for it."""
        name = self.node_names.get(node)
        return f"{name} (SuperNode {node})" if name else f"SuperNode {node}"

    def named(self, clients: list[int]) -> str:
        """``[1, 3] on partition-1 (SuperNode 101)``: clients and the sites of the nodes that host them."""
        sites = sorted({self.site_of(self.nodes[cid]) for cid in clients if cid in self.nodes})
        return f"{clients}" + (f" on {', '.join(sites)}" if sites else "")

    def _gone_nodes(self) -> set[int]:
        """The run's nodes known to be gone while replies are awaited: those whose process fedlt.deploy
        saw exit (at once, not when Flower's heartbeat expires) and those the SuperLink no longer lists."""
        exited = lost_sites()
        self.exited |= {node for node, name in self.node_names.items()
                        if exited.count(name) > self.lost_before.get(node, 0)}
        unlisted = set(self.nodes.values()) - set(self.grid.get_node_ids()) if self.nodes else set()
        self.gone = {**dict.fromkeys(unlisted, LEFT), **dict.fromkeys(self.exited, EXITED)}
        return set(self.gone)

    def connect(self) -> None:
        """Ask every SuperNode for its partition until each partition 0..N-1 has answered, within
        ``flower.connect_timeout_s``; then map client ids to nodes."""
        deadline = time.monotonic() + self.cfg.flower.connect_timeout_s
        found: dict[int, tuple[int, int]] = {}  # node -> (partition id, partitions)
        log(f"fedlt: waiting for the SuperNodes to answer (up to flower.connect_timeout_s="
            f"{self.cfg.flower.connect_timeout_s:g})")
        while True:
            new = [n for n in self.grid.get_node_ids() if n not in found]
            if new:
                for r in self._send(HELLO, [(n, -1, Message(), 0) for n in new])[0]:
                    meta = decode_meta(r.content)
                    found[r.metadata.src_node_id] = (meta["partition_id"], meta["num_partitions"])
                    self.node_names[r.metadata.src_node_id] = f"partition-{meta['partition_id']}"
                if found:
                    log(f"fedlt: {len(found)}/{next(iter(found.values()))[1]} SuperNodes connected (partitions "
                        f"{', '.join(str(p) for p, _ in sorted(found.values()))})")
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
            if self.stop is None:
                time.sleep(0.5)
            elif self.stop.wait(0.5):  # a stop while nodes are still missing ends the wait
                raise KeyboardInterrupt
        node_of = {pid: node for node, (pid, _) in found.items()}
        self.nodes = {cid: node_of[cid % len(node_of)] for cid in self.all_clients}

    def _deliver(self, kind: str, rnd: int, messages: Iterable[tuple[int, Message]]
                 ) -> Iterator[tuple[int, Message, Reply]]:
        items = list(messages)
        if not items:
            return
        if self.prompt:  # a deployment: a node whose process exited is sent nothing more
            self._gone_nodes()
        alive = set(self.grid.get_node_ids()) - self.exited
        targets = [(self.nodes[cid], cid, msg, rnd) for cid, msg in items
                   if self.nodes[cid] in alive and cid not in self.state_lost]
        lost = {cid: STATE_LOST if cid in self.state_lost else EXITED if self.nodes[cid] in self.exited else LEFT
                for cid, _ in items if self.nodes[cid] not in alive or cid in self.state_lost}
        replies, gone = self._send(kind, targets) if targets else ([], {})
        lost.update(gone)
        metas = [decode_meta(r.content) for r in replies]
        for meta in metas:
            if other := self.other_data(meta):  # first, as a late node's data are checked before its state
                lost[meta["cid"]] = other
            elif self.may_keep_state(meta["cid"]) and meta.get("had_state") is False:
                self.state_lost.add(meta["cid"])
                lost[meta["cid"]] = STATE_LOST
            elif meta.get("secrets_lost"):
                lost[meta["cid"]] = SECRETS_LOST
        got = {meta["cid"]: r for meta, r in zip(metas, replies) if meta["cid"] not in lost}
        self.kept_state.update((meta["cid"], bool(meta.get("kept_state"))) for meta in metas if meta["cid"] not in lost)
        silent = [cid for cid, _ in items if cid not in got and cid not in lost]
        # their nodes may have stored state the lost replies would have shown: unknown until one of theirs arrives
        self.unheard.difference_update(got)
        self.unheard.update([*silent, *gone])
        for cause, clients in ((NODE_LOST, sorted(lost)), (TIMEOUT, silent)):
            if clients:
                self.dropped.append({"round": rnd, "kind": kind, "clients": clients, "cause": cause})
        timeout = f"no reply within flower.timeout_s={self.cfg.flower.timeout_s:g}"
        why = [f"clients {self.named(sorted(lost))}: {lost[min(lost)]}"] if lost else []
        if silent:
            why.append(f"clients {self.named(silent)}: {timeout}")
        need = math.ceil(self.cfg.flower.min_reply_fraction * len(items))
        if len(got) < need:
            raise FedltError(f"round {rnd} ({kind}): {len(got)} of {len(items)} clients answered, fewer than "
                             f"flower.min_reply_fraction={self.cfg.flower.min_reply_fraction:g} requires "
                             f"({'; '.join(why)})")
        for line in why:  # named while the run goes, not only in the record of dropouts
            log(f"fedlt: round {rnd} ({kind}): {line}; going on without them")
        for cid, msg in items:
            if cid in got:
                yield cid, msg, decode_reply(got[cid].content, self.device)

    def fit_round(self, rnd: int) -> dict[str, Any]:
        self.round_started = rnd
        self.resuming = False  # the folder's rounds after the checkpoint are gone: an abort says how far this got
        return super().fit_round(rnd)

    def abort(self, run_dir: Path, reason: str) -> None:
        """Write the aborted run's summary (rounds done, dropouts, reason) once; not for a resume that has
        trained nothing yet, whose folder keeps the summary it had (a finished run's, or why it stopped)."""
        if not self.aborted and not self.resuming:
            self.aborted = True
            write_aborted_summary(run_dir, self.cfg, reason, max(self.round_started - 1, 0),
                                  {"engine": self.engine, "dropped": self.dropped})

    def _checkpoint_state(self, rnd: int, elapsed: float, pending: dict[str, Any]) -> dict[str, Any]:
        """The in-process checkpoint, and what a resumed run needs of the nodes: which clients kept state on
        theirs, and whether the method says they keep any (a resume refuses to go on without it), the dropouts
        so far (the summary lists them all), what the nodes must still be (:meth:`federation_record`) and
        whether a deployment's SuperNodes served it."""
        return {**super()._checkpoint_state(rnd, elapsed, pending),
                "flower": {"kept_state": sorted(c for c, kept in self.kept_state.items() if kept),
                           "method_keeps_state": self.keeps_state, "dropped": self.dropped,
                           "federation": self.federation_record(), "deployed": self.prompt}}

    def federation_record(self) -> dict[str, Any]:
        """What a resumed run must find the same on its nodes: here nothing, as every node draws the
        partition from the config."""
        return {}

    def check_resumable_on_nodes(self, run_dir: Path) -> dict[str, Any]:
        """:func:`resumable_on_nodes`, and the round the resumed run starts at."""
        saved, rnd = resumable_on_nodes(self.cfg, run_dir)
        self.round_started = rnd + 1  # an abort from here says the checkpoint's rounds are done
        return saved

    def resume_stage(self, saved: dict[str, Any]) -> None:
        """What the setup stage made that the checkpoint does not hold, made again with the connected nodes."""
        self.dropped = list(saved.get("dropped", []))

    def _resume_hint(self, run_dir: Path, checkpointed: int) -> str:
        kept = sorted(cid for cid, keeps in self.kept_state.items() if keeps)
        if kept or self.keeps_state:
            who = f"clients {kept}" if kept else f"the clients of method {self.cfg.method}"
            return (f"{run_dir} cannot resume: {who} keep state between rounds on their nodes, which "
                    "SuperNodes started again would lack; start the run again")
        if checkpointed:  # a deployment's ServerApp prompts its nodes; Flower's simulation does not
            folder = shlex.quote(str(run_dir))
            command = f"`fedlt deploy --resume {folder}` with the same options" if self.prompt else \
                f"`fedlt run --resume {folder}`"
            return f"{command} goes on from its checkpoint of round {checkpointed}"
        return (f"{run_dir} stopped before its first checkpoint (run.checkpoint_every={self.cfg.run.checkpoint_every}),"
                " so there is nothing to resume; start the run again")

    def run(self, run_dir: Path, resume: bool = False, quiet: bool = False) -> RunResult:
        if not resume:
            return self._run_on_nodes(run_dir, None, quiet)
        with writing(run_dir):  # a second resume of the folder is refused before it waits for any node
            self.resuming = True
            saved = self.check_resumable_on_nodes(run_dir)  # refused: the folder stays as it is
            return self._run_on_nodes(run_dir, saved, quiet)

    def _run_on_nodes(self, run_dir: Path, saved: dict[str, Any] | None, quiet: bool) -> RunResult:
        try:
            self.connect()
            if saved is not None:
                self.resume_stage(saved)
            return super().run(run_dir, resume=saved is not None, quiet=quiet)
        except TrainingDiverged:  # its summary is written, marked diverged
            raise
        except BaseException as err:  # a signal too: the summary says how far the run got
            self.abort(run_dir, describe_error(err))
            raise


def resumable_on_nodes(cfg: Config, run_dir: Path) -> tuple[dict[str, Any], int]:
    """The saved state's ``flower`` entry (see :meth:`FlowerSimulation._checkpoint_state`) and round, or a
    refusal of a resume the nodes cannot serve, before any process starts or message is sent."""
    check_resumable(cfg, run_dir)
    ckpt = load_checkpoint(run_dir, "cpu", mmap=True)
    saved = ckpt.get("flower")
    if not isinstance(saved, dict):
        raise ConfigError(f"{run_dir / CHECKPOINT_FILE} was saved by a fedlt that did not record what a Flower run "
                          "needs to resume (which clients kept state on their nodes); start a new run")
    if saved.get("kept_state") or saved.get("method_keeps_state"):  # the method's word: replies may have been lost
        kept, sites = saved.get("kept_state") or [], (saved.get("federation") or {}).get("sites") or []
        who = (f"sites {', '.join(sites[cid] for cid in kept)}" if kept and all(cid < len(sites) for cid in kept)
               else f"clients {kept}" if kept else "the clients")  # a deployment on sites' own data names its sites
        raise ConfigError(f"{who} of {run_dir} kept state between rounds on their nodes (method {cfg.method}: a "
                          "personal model, control variates, a prior), which SuperNodes started again no longer "
                          "hold; start a new run")
    return saved, ckpt["round"]


def resume_point(run_dir: Path) -> tuple[dict[str, Any], int] | None:
    """:func:`resumable_on_nodes` of the Flower run in ``run_dir`` with its own config; None where it
    cannot go on (not a Flower run, no checkpoint, clients that kept state on their nodes)."""
    try:
        cfg = load_config(run_dir / CONFIG_FILE)
        return resumable_on_nodes(cfg, run_dir) if cfg.engine == "flower" else None
    except (FedltError, OSError):
        return None


def run_on_grid(cfg: Config, grid: Grid, quiet: bool = False,
                on_start: Callable[[FlowerSimulation, Path], None] | None = None, prompt: bool = False,
                stop: threading.Event | None = None, resume: Path | None = None) -> RunResult:
    """Run ``cfg`` over the SuperNodes behind ``grid`` and write a run directory as usual, or go on with
    the run in ``resume`` from its checkpoint (``on_start(sim, run_dir)`` is called once both exist;
    ``prompt``, ``stop``: see :func:`poll_replies`)."""
    if cfg.flower.node_data:
        from fedlt.engine.flower_nodes import NodeDataSimulation  # a module that imports this one

        spec, device = setup_runtime(cfg)
        sim: FlowerSimulation = NodeDataSimulation(cfg, spec, device, grid, prompt)
    else:
        spec, data, device = setup_parts(cfg)
        sim = FlowerSimulation(cfg, spec, data, device, grid, prompt)
    sim.stop = stop
    run_dir = resume if resume is not None else new_run_dir(sim.cfg)
    if on_start:
        on_start(sim, run_dir)
    return sim.run(run_dir, resume=resume is not None, quiet=quiet)


def app_dir(grid: Grid) -> Path | None:
    """Where Flower installed this run's app (FAB), or None outside a deployment."""
    from flwr.common.config import get_project_dir

    try:
        run = grid.run
        return get_project_dir(run.fab_id, run.fab_version, run.fab_hash)
    except Exception:  # the simulation engine's grid has no installed FAB
        return None


def deployed_config(run_config: dict[str, Any], base: Path | None) -> Config:
    """The run config's fedlt config, on Flower's engine (the one it runs on, whatever the file says);
    relative paths (``config``, ``run.out_dir``) resolve against the app directory ``base``, not the
    SuperLink's working directory."""
    path = str(run_config.get("config", "")) or None
    if path and base is not None and not Path(path).is_absolute():
        path = str(base / path)
    overrides = ["engine=flower", *shlex.split(str(run_config.get("overrides", "")))]
    cfg = load_config(path, overrides)
    if base is not None and not Path(cfg.run.out_dir).is_absolute():
        cfg = load_config(path, [*overrides, f"run.out_dir={base / cfg.run.out_dir}"])
    return cfg


def _report(**outcome: Any) -> None:
    """Tell the deploy command how the run ended (it cannot learn it from ``flwr run``'s exit code)."""
    if os.environ.get(OUTCOME_ENV):
        write_atomic(Path(os.environ[OUTCOME_ENV]), json.dumps(outcome) + "\n")


def _watch_superlink(address: str, on_lost: Callable[[], None], every: float = 1.0, misses: int = 3) -> None:
    """Call ``on_lost`` once the SuperLink refuses connections ``misses`` times in a row: Flower's
    own parent-process check misses a SuperLink that died and was not reaped."""
    host, port = address.rsplit(":", 1)

    def watch() -> None:
        failed = 0
        while failed < misses:
            time.sleep(every)
            try:
                socket.create_connection((host.strip("[]"), int(port)), timeout=2).close()
                failed = 0
            except OSError:
                failed += 1
        on_lost()

    threading.Thread(target=watch, name="fedlt-superlink-watch", daemon=True).start()


serverapp = ServerApp()


@serverapp.main()
def main(grid: Grid, context: Context) -> None:
    """``flwr run``: the fedlt config named by the run config (``config``, ``overrides``).
    However it ends, the outcome goes to ``$FEDLT_OUTCOME_FILE`` when set (by fedlt.deploy)."""
    started: dict[str, Any] = {}
    if os.environ.get(OUTCOME_ENV):  # under fedlt deploy, which relays this log (in colour only to a terminal)
        from flwr.common.logger import update_console_handler

        update_console_handler(colored=False)  # so the log file it keeps holds no colour codes either

    def on_start(sim: FlowerSimulation, run_dir: Path) -> None:
        started.update(sim=sim, run_dir=run_dir)
        address = getattr(grid, "_addr", None)  # HttpGrid's SuperLink address

        def lost() -> None:
            reason = "the SuperLink is gone (it stopped answering on " + str(address) + ")"
            sim.abort(run_dir, reason)
            _report(status="aborted", reason=reason, run_dir=str(run_dir.resolve()),
                    rounds_done=max(sim.round_started - 1, 0), untouched=sim.resuming)
            os._exit(1)

        if isinstance(address, str) and ":" in address:
            _watch_superlink(address, lost)

    try:
        from flwr.superlink.grid import http_grid

        quick_object_pulls(http_grid)  # this ServerApp's pulls of the replies
        cfg = deployed_config(dict(context.run_config), app_dir(grid))
        resume = str(context.run_config.get("resume", "")) or None
        result = run_on_grid(cfg, grid, on_start=on_start, prompt=True, resume=Path(resume) if resume else None)
    except BaseException as err:
        sim = started.get("sim")
        _report(status="aborted", reason=describe_error(err), config_error=isinstance(err, ConfigError),
                run_dir=str(started["run_dir"].resolve()) if started else None,
                rounds_done=max(sim.round_started - 1, 0) if sim else 0,
                untouched=bool(sim and sim.resuming))  # a resume stopped before its first round wrote nothing
        raise
    _report(status="finished", run_dir=str(result.run_dir.resolve()), rounds_done=cfg.fl.rounds,
            **{k: result.summary[k] for k in ("last_evaluated_round",) if k in result.summary})
    print(final_line(result.run_dir, result.summary), flush=True)
    for line in model_notes(result.summary):
        print(f"fedlt: note: {line}", flush=True)


def final_line(run_dir: Path, summary: dict[str, Any]) -> str:
    """The deployed run's last line: its headline accuracy, and when that is not the last round's, which
    round it is (a round whose secure evaluation lost too many nodes is left unevaluated)."""
    acc = summary["final"].get("acc")
    shown = "-" if acc is None else f"{acc:.2f}"
    if "last_evaluated_round" not in summary:
        return f"fedlt: {run_dir}: finished; final acc {shown}"
    last, rounds = summary["last_evaluated_round"], summary["rounds"]
    if last is None:
        return f"fedlt: {run_dir}: finished; no round of {rounds} evaluated (see the ServerApp's log for why)"
    return (f"fedlt: {run_dir}: finished; last evaluated round {last} of {rounds}: acc {shown} (the later rounds "
            "were not evaluated; the ServerApp's log says why)")


def simulation_backend(cfg: Config) -> dict[str, Any]:
    """Flower's simulation backend settings: what Ray reserves for each running ClientApp (its CPUs,
    and GPUs when ``flower.gpus_per_client`` asks for them; check_config has refused more than exist)."""
    cpus = max(cfg.flower.cpus_per_client, cfg.run.threads or 1)  # a client's torch threads each get a core
    resources = {"num_cpus": cpus, "num_gpus": cfg.flower.gpus_per_client}
    return {"client_resources": resources, "init_args": {"include_dashboard": False}}


#: the line Flower logs before its report of any failed ClientApp (the report itself says what failed)
RAY_FAILURE_PREAMBLE = "An exception was raised when processing a message by"
#: an exception's line in a traceback ("KeyError: 'x'", "fedlt.errors.DataError: ..."), at a line's start
EXCEPTION_LINE = re.compile(r"(?m)^([A-Za-z_][\w.]*): ")


def raised_fedlt_error(report: str) -> bool:
    """Whether a logged traceback is of a ClientApp that ended with a FedltError: the last exception before
    Ray wraps it (``raise ClientAppException(...)``), so a bug raised while handling one keeps its traceback."""
    own = EXCEPTION_LINE.findall(report.split("raise ClientAppException(")[0])
    return bool(own) and own[-1].startswith("fedlt.errors.")


#: how Ray ends the report of a client actor killed because the process that started it (the simulation's
#: own) ended or shut Ray down: after a stop, Flower logs one per running client, with Ray's traceback
OWNER_DIED = "The actor is dead because its owner has died."


def without_dead_owner_reports(record: logging.LogRecord) -> bool:
    """Whether Flower's log keeps a record: not the report of a client actor Ray ended because the
    simulation itself stopped (40 lines a client, around the run's own line on how it goes on); an actor
    that died of anything else is still reported."""
    return record.levelno < logging.ERROR or OWNER_DIED not in record.getMessage()


@contextmanager
def without_runtime_notices() -> Iterator[None]:
    """Silences two notices every simulation printed that its user cannot act on: Flower's deprecation
    of ``run_simulation`` (the Python entry point fedlt's simulation is built on) and Ray's tip on a
    future default of its GPU masking; and Flower's report of a ClientApp that raised a FedltError (Ray's
    traceback, 80 lines), which the run's one error line says, or of a client a stop ended. Flower's other
    log lines, the traceback of any other exception (a bug to debug) and every other warning still show."""
    flower_log = logging.getLogger("flwr")

    def keep(record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.levelno >= logging.ERROR and (text.startswith(RAY_FAILURE_PREAMBLE) or raised_fedlt_error(text)):
            return False
        return without_dead_owner_reports(record) and "`run_simulation` function is deprecated" not in text

    flower_log.addFilter(keep)
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Tip: In future versions of Ray", category=FutureWarning)
            yield
    finally:
        flower_log.removeFilter(keep)


#: seconds a stopped simulation waits for its ServerApp's thread to reach a wait for replies and stop there
STOP_WAIT_S = 30.0


def _folder_hint(running: dict[str, Any]) -> str | None:
    """How a simulated run goes on, from its folder, where its thread was not waiting for replies when
    stopped (it reads the stop there) and so said nothing in time: its last checkpoint's round."""
    if "run_dir" not in running:
        return None
    point = resume_point(running["run_dir"])
    return running["sim"]._resume_hint(running["run_dir"], point[1] if point else 0)


def simulate(cfg: Config, quiet: bool = False, resume: Path | None = None) -> RunResult:
    """``fedlt run ... engine=flower``: ``cfg`` on Flower's simulation engine (Ray), one virtual
    SuperNode per client; or the run in ``resume``, from its checkpoint."""
    from flwr.simulation import run_simulation

    if cfg.flower.node_data:
        raise ConfigError("flower.node_data=true runs on SuperNodes that each hold their own data, not in Flower's "
                          "simulation; deploy it with fedlt deploy --node-data DIR")
    if cfg.run.threads is None:  # Ray gives each client cpus_per_client threads; the in-process run, torch's default
        cfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"threads": torch.get_num_threads()})})
    cores, wanted = cpu_cores(), simulation_backend(cfg)["client_resources"]["num_cpus"]
    if wanted > cores:  # Ray would start no client and wait for one
        raise ConfigError(f"each simulated client asks for {wanted:g} CPU cores (flower.cpus_per_client="
                          f"{cfg.flower.cpus_per_client:g}, run.threads={cfg.run.threads}) but this machine has "
                          f"{cores}; set both to at most {cores}")
    result: dict[str, RunResult] = {}
    hint: dict[str, str | None] = {}
    app = ServerApp()
    stop, started, ended = threading.Event(), threading.Event(), threading.Event()

    running: dict[str, Any] = {}  # the run's simulation and folder, once both exist

    @app.main()
    def _main(grid: Grid, context: Context) -> None:
        started.set()
        try:
            result["run"] = run_on_grid(cfg, grid, quiet=quiet, stop=stop, resume=resume,
                                        on_start=lambda sim, run_dir: running.update(sim=sim, run_dir=run_dir))
        except KeyboardInterrupt as interrupt:
            if not stop.is_set():
                raise  # the interrupted run's summary is written; the main thread reports the interrupt
            hint["resume"] = getattr(interrupt, "resume_hint", None)  # how the run goes on, for that report
        finally:
            ended.set()

    os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")  # inherited by the Ray actors
    try:
        with without_runtime_notices(), stops_at_the_next_wait(stop, quiet):
            run_simulation(app, clientapp, num_supernodes=cfg.data.num_clients,
                           backend_config=simulation_backend(cfg))
    except (KeyboardInterrupt, SystemExit) as interrupt:  # a second Ctrl-C reaches this thread, and SIGTERM,
        if isinstance(interrupt, SystemExit) and interrupt.code != signal.SIGTERM:  # whose handler ray.init replaced
            raise  # with sys.exit
        stop.set()  # the ServerApp's thread ends at its next wait for replies
        logging.getLogger("flwr").addFilter(without_dead_owner_reports)  # kept: Flower's threads report as we exit
        if started.is_set():
            ended.wait(STOP_WAIT_S)  # its summary written
        ray = sys.modules.get("ray")  # not imported here: an import of Ray the signal cut short fails again,
        if ray is not None:           # and its error replaced the interrupt
            ray.shutdown()  # the runtime's worker threads would otherwise wait on dead actors at exit
        if "run" in result:  # the run ended meanwhile, its summary written: finished, not stopped
            return result["run"]
        stopped = Terminated() if isinstance(interrupt, SystemExit) else interrupt
        stopped.resume_hint = hint.get("resume") or _folder_hint(running)
        raise stopped from None
    if "run" in result:  # finished, also where a stop came as its last round ended
        return result["run"]
    if stop.is_set():  # a first Ctrl-C: the ServerApp's thread stopped at a wait, and Flower ended as after a run
        stopped = KeyboardInterrupt()
        stopped.resume_hint = hint.get("resume") or _folder_hint(running)
        raise stopped
    raise FedltError("the Flower simulation ended without a result; its log above says why")


@contextmanager
def stops_at_the_next_wait(stop: threading.Event, quiet: bool) -> Iterator[None]:
    """A simulation's first Ctrl-C sets ``stop``: its ServerApp's thread stops at its next wait for replies,
    so Flower ends its runtime as after a finished run. Raised in the main thread instead, where Flower
    waits for its client threads, the interrupt had Flower shut Ray down under those threads' calls, and
    now and then Ray ended the process (exit code 1, no line on how the run goes on). A second Ctrl-C stops
    at once, as before. SIGTERM keeps Ray's handler, which exits at once (asked to wait instead, the
    process ended aborted by Ray after its last line)."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        yield  # signals reach the main thread only; a run started to ignore Ctrl-C goes on ignoring it
        return

    def ask(_signum: int, _frame) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        if not quiet:
            print("fedlt: stopping at the next wait for the clients' replies, once those training now have "
                  "answered; Ctrl-C again stops at once", file=sys.stderr, flush=True)

    previous = signal.signal(signal.SIGINT, ask)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
