"""A real Flower deployment on this machine: one SuperLink and N SuperNodes on 127.0.0.1, plain
or TLS (certificates made here with openssl), and ``flwr run`` of a fedlt config over them.

By default SuperNode ``I`` gets ``--node-config "partition-id=I num-partitions=N"`` and hosts the
fedlt clients ``k`` with ``k % N == I``; it builds the same seeded partition from the config and
trains only its own clients' rows, so no data moves. With ``--node-data DIR`` each subfolder of
DIR is one site: its SuperNode gets ``--node-config 'data="DIR/SITE" name="SITE"'`` and the run
``flower.node_data=true flower.min_nodes=<sites>``, so each node trains on its own folder (the
rehearsal of a federation whose sites hold their own data). ``--auth`` (with ``--tls``) turns on
Flower's SuperNode authentication: every SuperNode gets its own ECDSA key pair, whose public half
is registered with ``flwr supernode register`` before the node starts; the SuperLink admits no
other node.

Each SuperNode runs with ``--isolation process`` beside one long-lived ClientApp process
(:mod:`fedlt.engine.flower_worker`) that serves all its messages: Flower's default starts a fresh
``flwr-clientapp`` per message, whose imports cost more than a small round's training. A
SuperNode and its ClientApp process stop together, whichever ends first. Every process started
here runs in its own process group; those groups, and the sessions Flower's helpers open below
them, are signalled when a node dies and when the federation closes, whatever happened (SIGINT and
SIGTERM included). A SuperLink or SuperNode whose port another program took before it could bind it
starts again on a fresh one.

While the run goes, its log (``flwr run --stream``: Flower's lines and the ServerApp's) is relayed to
stderr in its own order, colour codes only to a terminal, and the result line goes to stdout at the end.
A SuperNode or ClientApp process seen to exit is named, and listed in ``$FEDLT_LOST_NODES_FILE`` so the
ServerApp stops waiting for it at once (Flower's heartbeat would take up to 60 s to report it lost).

The outcome comes from the ServerApp itself (``$FEDLT_OUTCOME_FILE``), not from ``flwr run``,
which exits 0 when the ServerApp raised: no outcome file means the run failed. Exit codes: 0
finished, 1 failed (one ``fedlt: error:`` line naming the cause), 2 refused input, 128+N signal N.

``--resume RUN_DIR`` (no CONFIG) starts the federation again for a run that stopped, which goes on from
its last checkpoint with its own config (``resume`` in Flower's run config); refused where the run's
clients kept state between rounds on their nodes.

``fedlt deploy [--nodes 3 | --node-data DIR] [--tls [--auth]] CONFIG [key=value ...]``, also
``python -m fedlt.deploy`` and scripts/flower_deploy.sh; both share :func:`deploy`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from fedlt.errors import ConfigError, DataError, FedltError, one_line
from fedlt.results import (CONFIG_FILE, LOST_NODES_ENV, OUTCOME_ENV, STOP_REASON_ENV, SUMMARY_FILE, check_output_path,
                           holding, read_summary)

HOST = "127.0.0.1"
#: where the ServerApp says how the run ended, in the deployment's workdir ($FEDLT_OUTCOME_FILE)
OUTCOME_NAME = "outcome.json"
APP_DIR = Path(__file__).resolve().parents[2]  # the checkout: pyproject.toml with [tool.flwr.app]


#: starts of the SuperLink, and of each SuperNode, on a fresh port while another program takes the one
#: chosen: free_port's number is free only until the process binds it
PORT_TRIES = 3


class PortTaken(FedltError):
    """Another program took the port before our process could listen on it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _port_taken(proc: subprocess.Popen, log: Path) -> bool:
    """Whether ``proc`` exited because its port was in use."""
    text = log.read_text(errors="replace").lower() if proc.poll() is not None and log.is_file() else ""
    return "address already in use" in text or "errno 98" in text


def _listens(proc: subprocess.Popen, port: int) -> bool:
    """Whether ``proc`` (or a process below it) itself listens on ``port``."""
    inode = _listening_inode(port)
    return inode is not None and _holds_socket([proc.pid, *_descendants(proc.pid)], inode)


def _processes() -> dict[int, tuple[int, int, str]]:
    """Every process as pid -> (parent pid, process group, state), from /proc."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        table[int(stat.parent.name)] = (int(fields[1]), int(fields[2]), fields[0])
    return table


def _listening_inode(port: int) -> str | None:
    """The socket inode listening on HOST:port (IPv4), if any."""
    want = f"{socket.inet_aton(HOST)[::-1].hex().upper()}:{port:04X}"
    try:
        lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        f = line.split()
        if f[1] == want and f[3] == "0A":  # 0A: LISTEN
            return f[9]
    return None


def _holds_socket(pids: list[int], inode: str) -> bool:
    for pid in pids:
        try:
            if any(os.readlink(fd) == f"socket:[{inode}]" for fd in Path(f"/proc/{pid}/fd").iterdir()):
                return True
        except OSError:
            continue
    return False


def ports_taken_error(what: str, ports: list[int]) -> str:
    """Each of the :data:`PORT_TRIES` free ports chosen for ``what`` was taken by another program before
    it could listen: not a race a new run avoids, but a program here that takes free ports."""
    listed = ", ".join(f"{HOST}:{p}" for p in ports)
    return (f"another program took each port chosen for {what} ({listed}) before it could listen on it; find "
            "what takes free ports on this machine (`ss -ltnp`) and stop it, then run again")


def _wait_for_port(port: int, deadline: float, proc: subprocess.Popen, log: Path) -> None:
    """Wait until ``proc`` (our SuperLink) itself listens on ``port``: a program that took the port
    first must not pass for it."""
    while time.monotonic() < deadline:
        if _port_taken(proc, log):
            raise PortTaken(f"another program took {HOST}:{port} before the SuperLink could listen on it; "
                            "run again (a new free port is chosen)")
        if proc.poll() is not None:
            raise FedltError(f"the SuperLink exited (code {proc.returncode}) before listening; see {log}")
        if _listens(proc, port):
            return
        time.sleep(0.2)
    holder = " (another program listens there)" if _listening_inode(port) else ""
    raise FedltError(f"the SuperLink did not listen on {HOST}:{port} in time{holder}; see {log}")


def make_certificates(folder: Path) -> tuple[Path, Path, Path]:
    """A throw-away CA and a server certificate for 127.0.0.1 signed by it: (ca, cert, key)."""
    folder.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, csr, cert = (folder / n for n in ("ca.key", "ca.crt", "server.key", "server.csr", "server.pem"))
    ext = folder / "san.ext"
    ext.write_text(f"subjectAltName = IP:{HOST}\n")
    steps = [
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=fedlt-test-ca",
         "-keyout", ca_key, "-out", ca],
        ["req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={HOST}", "-keyout", key, "-out", csr],
        ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-days", "2",
         "-extfile", ext, "-out", cert],
    ]
    for args in steps:
        done = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, timeout=60)
        if done.returncode != 0:
            raise FedltError(f"openssl {args[0]} failed: {done.stderr.strip()[-300:]}")
    return ca, cert, key


@dataclass(frozen=True)
class Site:
    """One SuperNode to start: ``name`` (its registration name) and its ``--node-config``."""

    name: str
    node_config: str


def partition_sites(nodes: int) -> list[Site]:
    """SuperNode ``I`` serves partition ``I`` of the config's own seeded partition."""
    return [Site(f"partition-{i}", f"partition-id={i} num-partitions={nodes}") for i in range(nodes)]


def _toml_string(value: str, what: str) -> str:
    """``value`` as a double-quoted TOML string, the form Flower's ``--node-config`` parser reads
    (an unquoted path is not valid TOML); its regex cannot take a double quote inside one."""
    if '"' in value or any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise ConfigError(f"{what} {value!r} has a double quote or a control character, which Flower's "
                          "--node-config cannot carry; rename it")
    return '"' + value.replace("\\", "\\\\") + '"'


def run_config(config: Path, overrides: list[str], resume: Path | None = None) -> str:
    """Flower's ``--run-config`` for the fedlt app: the config's path and the overrides, both as
    double-quoted TOML strings (``flower_app.deployed_config`` reads them back), and the folder of a run
    to go on with (its ``config.yaml`` is then ``config``, so the check of that path covers it)."""
    return (f'config="{config.resolve()}" overrides="{shlex.join(overrides)}"'
            + (f' resume="{resume.resolve()}"' if resume is not None else ""))


def _read_back(config: Path, overrides: list[str]) -> bool:
    """Whether Flower's run-config parser gives the config's path and the overrides back unchanged."""
    try:
        from flwr.common.config import parse_config_args
    except ImportError:
        raise ConfigError("fedlt deploy needs Flower: pip install 'fedlt[flower]'") from None
    try:
        parsed = parse_config_args([run_config(config, overrides)])
        return parsed.get("config") == str(config.resolve()) and shlex.split(parsed.get("overrides", "")) == overrides
    except Exception:  # a TOML or click error, or shlex's unbalanced quote: not carried
        return False


def check_run_config(config: Path, overrides: list[str], given: list[str]) -> None:
    """Refuse, before anything starts, what Flower's run config would not carry to the ServerApp unchanged
    (a quote or a backslash in a path or an override): it would fail only once the federation is up. Names
    the config path, the user's override, or the folder (``--server-test``, ``run.out_dir``) that holds it."""
    if _read_back(config, overrides):
        return
    fix = "which Flower's run config cannot carry"
    if not _read_back(config, []):
        raise ConfigError(f"the config path {str(config.resolve())!r} holds a quote or a backslash, {fix}; "
                          "move or rename the file")
    for override in overrides:
        if not _read_back(config, [override]):
            if override in given:
                raise ConfigError(f"override {override!r} holds a quote or a backslash, {fix}; write the value "
                                  "without them (a YAML config file can hold it)")
            raise ConfigError(f"{override.partition('=')[2]!r} (the deployment's {override.partition('=')[0]}) "
                              f"holds a quote or a backslash, {fix}; move or rename that folder")
    raise ConfigError(f"the overrides together are not something Flower's run config can carry; "
                      "give them in a YAML config file")


def _is_dir(path: Path) -> bool:
    """``path.is_dir()``, False too where the system cannot look the path up (a name longer than the file
    system allows raises instead of saying no): the option's own error names it, not a traceback."""
    try:
        return path.is_dir()
    except OSError:
        return False


def node_data_sites(folder: Path) -> list[Site]:
    """One site per subfolder of ``folder`` (sorted by name; hidden folders skipped), each SuperNode
    told its folder's absolute path and its name: the node side loads ``data`` by itself."""
    if not _is_dir(folder):
        raise ConfigError(f"--node-data {folder} is not a folder; give a folder with one subfolder per site")
    subfolders = sorted((p for p in folder.resolve().iterdir() if p.is_dir() and not p.name.startswith(".")),
                        key=lambda p: p.name)
    if not subfolders:
        raise ConfigError(f"--node-data {folder} has no subfolders; put each site's data in a folder of its own "
                          f"({folder}/SITE/...)")
    return [Site(p.name, f"data={_toml_string(str(p), '--node-data folder')} "
                         f"name={_toml_string(p.name, '--node-data site name')}") for p in subfolders]


def make_node_key(path: Path) -> Path:
    """An ECDSA P-384 key pair in OpenSSH format, what ``ssh-keygen -t ecdsa -b 384 -N "" -f PATH``
    writes (Flower 1.41 takes any NIST curve, in OpenSSH form): the private key at ``path`` (mode
    600), the public key, returned, at ``PATH.pub``."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP384R1())
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    with os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
        out.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                    serialization.NoEncryption()))
    public = path.with_name(path.name + ".pub")
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                                     serialization.PublicFormat.OpenSSH) + b"\n")
    return public


def superlink_args(port: int, database: Path, certs: tuple[Path, Path, Path] | None, auth: bool) -> list[str]:
    """``flower-superlink``'s flags (after the program): ``certs`` = (CA, certificate, key) or
    ``--insecure``; ``auth`` admits only SuperNodes whose public key was registered beforehand."""
    if certs is None:
        security = ["--insecure"]
    else:
        ca, cert, key = certs
        security = ["--ssl-ca-certfile", str(ca), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
    return [*security, *(["--enable-supernode-auth"] if auth else []), "--host", HOST, "--port", str(port),
            "--disable-runtime-dependency-installation", "--database", str(database)]


def supernode_args(site: Site, superlink: str, ca: Path | None, key: Path | None, startup_s: float) -> list[str]:
    """``flower-supernode``'s flags (after the program, before ``--isolation``/``--host``/``--port``):
    trust ``ca`` (or ``--insecure``), sign with the private ``key`` when given, and the site's node config."""
    return [*(["--root-certificates", str(ca)] if ca is not None else ["--insecure"]), "--superlink", superlink,
            "--max-wait-time", str(int(startup_s)),
            *(["--auth-supernode-private-key", str(key)] if key is not None else []), "--node-config", site.node_config]


@dataclass
class Federation:
    """A running SuperLink and SuperNodes (``nodes[i]`` serves site i: partition i, or folder i)."""

    workdir: Path
    port: int
    tls: bool
    env: dict[str, str]
    superlink: subprocess.Popen | None = None
    nodes: list[subprocess.Popen] = field(default_factory=list)
    #: ``workers[i]``: the ClientApp process serving ``nodes[i]``; its group is one of the node's
    workers: list[subprocess.Popen] = field(default_factory=list)
    #: ``names[i]``: the site ``nodes[i]`` serves (the name the ServerApp knows it by)
    names: list[str] = field(default_factory=list)
    #: ``commands[i]``: ``nodes[i]``'s command and start-up seconds (:meth:`start_node`'s), to start it again
    commands: list[tuple[tuple[str, ...], float]] = field(default_factory=list)
    #: ``ports[i]``: the port of ``nodes[i]``'s Runtime API, where its ClientApp process asks for tasks
    ports: list[int] = field(default_factory=list)
    ca: Path | None = None
    #: ``node_ids[i]``: the id Flower gave SuperNode ``i`` at registration (``--auth`` only)
    node_ids: list[int] = field(default_factory=list)
    #: process groups of everything started here, with the sessions Flower's helpers open below
    #: them (a superexec and its ServerApp); signalled as groups, so re-parented members go too
    groups: dict[int, set[int]] = field(default_factory=dict)

    def start(self, log: str, *args: str) -> subprocess.Popen:
        out = open(self.workdir / log, "w")
        proc = subprocess.Popen([*args], stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
                                start_new_session=True)
        self.groups[proc.pid] = {proc.pid}
        return proc

    def track(self) -> None:
        """Note the process groups below each started process while they are still its descendants."""
        table = _processes()
        for pid, groups in self.groups.items():
            groups.update(table[p][1] for p in _descendants(pid, table) if table[p][2] != "Z")

    def stop(self, proc: subprocess.Popen) -> None:
        """Stop ``proc`` and every process group it started: SIGTERM, then SIGKILL after 5 s."""
        self.track()
        _stop_groups(self.groups.get(proc.pid, {proc.pid}) - {os.getpgrp()})
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass

    def flwr(self, calls: dict[str, list[str]], timeout: float = 60) -> dict[str, str]:
        """Run ``flwr`` CLI commands (log name -> arguments) against this federation, all at once, and
        return each one's output; the first that fails or hangs raises a FedltError with its last line."""
        program = str(Path(sys.executable).with_name("flwr"))
        procs = {log: self.start(log, program, *args) for log, args in calls.items()}
        deadline, texts = time.monotonic() + timeout, {}
        for log, proc in procs.items():
            what = f"`flwr {' '.join(calls[log][:2])}`"
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.stop(proc)
                raise FedltError(f"{what} did not answer within {timeout:g} s; see {self.workdir / log}") from None
            texts[log] = (self.workdir / log).read_text(errors="replace")
            if proc.returncode != 0:
                last = next((line.strip() for line in reversed(texts[log].splitlines()) if line.strip()), "no output")
                raise FedltError(f"{what} failed (exit code {proc.returncode}): {last}; see {self.workdir / log}")
        return texts

    def register(self, keys: list[tuple[Path, str]]) -> list[int]:
        """Register each SuperNode's (public key, name) with the SuperLink over the Control API, as an
        operator does with ``flwr supernode register KEY.pub CONNECTION``; return their node ids."""
        calls = {f"register{i}.log": ["supernode", "register", str(key), "deploy", "--name", name, "--format", "json"]
                 for i, (key, name) in enumerate(keys)}
        ids = []
        for log, text in self.flwr(calls).items():
            try:
                ids.append(int(json.loads(text[text.index("{"):text.rindex("}") + 1])["node-id"]))
            except (ValueError, KeyError, TypeError):
                raise FedltError(f"`flwr supernode register` gave no node id; see {self.workdir / log}") from None
        return ids

    def start_node(self, i: int, *args: str, startup_s: float, name: str = "") -> None:
        """SuperNode ``i`` (``args``: its command, without the Runtime API's address) and the
        ClientApp process that serves it; the latter's group joins the node's, so stopping the
        node stops both. A node ``i`` started before is replaced, on a fresh port."""
        port = free_port()
        node = self.start(f"supernode{i}.log", *args, "--isolation", "process", "--host", HOST, "--port", str(port))
        worker = self.start(f"clientapp{i}.log", sys.executable, "-m", "fedlt.engine.flower_worker",
                            "--runtime-api-address", f"{HOST}:{port}", "--startup", str(startup_s))
        self.groups[node.pid] |= self.groups.pop(worker.pid)
        if i < len(self.nodes):
            self.nodes[i], self.workers[i], self.ports[i] = node, worker, port
            return
        self.nodes.append(node)
        self.workers.append(worker)
        self.names.append(name or f"partition-{i}")
        self.commands.append((args, startup_s))
        self.ports.append(port)

    def wait_for_nodes(self, deadline: float) -> None:
        """Wait until every SuperNode listens on its Runtime API's port. One whose port another program
        took first starts again on a fresh one (:data:`PORT_TRIES` starts in all): its ClientApp process
        would ask that program for tasks. One that exited otherwise is left to the run, which names it."""
        starts, waiting = [1] * len(self.nodes), set(range(len(self.nodes)))
        tried: list[list[int]] = [[] for _ in self.nodes]
        while True:
            for i in sorted(waiting):
                node, port = self.nodes[i], self.ports[i]
                if _port_taken(node, self.workdir / f"supernode{i}.log"):
                    tried[i].append(port)
                    if starts[i] == PORT_TRIES:
                        raise PortTaken(ports_taken_error(f"the SuperNode of {self.names[i]}", tried[i]))
                    self.stop(node)  # and its ClientApp process
                    starts[i] += 1
                    args, startup_s = self.commands[i]
                    self.start_node(i, *args, startup_s=startup_s)
                elif node.poll() is not None or _listens(node, port):
                    waiting.discard(i)
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise FedltError(f"the SuperNode of {self.names[min(waiting)]} did not listen on "
                                 f"{HOST}:{self.ports[min(waiting)]} in time; see {self.workdir}")
            time.sleep(0.2)

    def node_exited(self, i: int) -> None:
        """SuperNode ``i`` or its ClientApp process exited: stop both, and tell the ServerApp
        (``$FEDLT_LOST_NODES_FILE``), which then stops waiting for that node's replies at once, not
        after Flower's heartbeat (a SuperNode killed outright stays listed for up to 60 s)."""
        node, worker = self.nodes[i], self.workers[i]
        what = "SuperNode" if node.poll() is not None else "ClientApp process"
        code = node.returncode if node.poll() is not None else worker.returncode
        say(f"the {what} of {self.names[i]} exited (code {code}); the run goes on without it")
        with open(self.env[LOST_NODES_ENV], "a") as lost:  # before stopping the other, which takes up to 7 s
            lost.write(self.names[i] + "\n")
        self.stop(node)

    def run(self, config: Path, overrides: list[str], timeout: float, flower_lines: bool = True,
            resume: Path | None = None) -> subprocess.CompletedProcess:
        """``flwr run`` the fedlt app with ``config`` + ``overrides`` (``--stream``) and wait, watching
        the federation; a run that did not finish raises a FedltError naming the cause (a
        ConfigError for a config the ServerApp refused). ``flower_lines=False`` relays fedlt's lines
        only (a benchmark's progress), leaving Flower's in the log file."""
        outcome, stop_reason = Path(self.env[OUTCOME_ENV]), Path(self.env[STOP_REASON_ENV])
        outcome.unlink(missing_ok=True)
        stop_reason.unlink(missing_ok=True)
        Path(self.env[LOST_NODES_ENV]).unlink(missing_ok=True)
        say(f"starting the run (flwr run); Flower's log is in {self.workdir / 'flwr-run.log'}")
        flwr = self.start("flwr-run.log", str(Path(sys.executable).with_name("flwr")), "run", str(APP_DIR),
                          "deploy", "--stream", "--run-config", run_config(config, overrides, resume))
        deadline = time.monotonic() + timeout
        log = GrowingFile(self.workdir / "flwr-run.log")
        try:
            while flwr.poll() is None and self.superlink.poll() is None and time.monotonic() < deadline:
                show_progress(log, flower_lines=flower_lines)  # the ServerApp's, as the run goes
                self.track()
                for i, (node, worker) in enumerate(zip(self.nodes, self.workers)):  # they go together
                    if (node.poll() is not None or worker.poll() is not None) and _members(self.groups[node.pid]):
                        self.node_exited(i)
                time.sleep(0.5)
            show_progress(log, flower_lines=flower_lines)  # what came during the last wait
            if self.superlink.poll() is not None:  # give the ServerApp time to write its summary
                end = time.monotonic() + 10
                while not outcome.is_file() and time.monotonic() < end:
                    time.sleep(0.2)
                raise FedltError(f"the SuperLink exited (code {self.superlink.returncode}) during the run"
                                 + _outcome_tail(outcome) + f"; logs in {self.workdir}")
            if flwr.poll() is None:
                stop_reason.write_text(f"the deployment's --timeout of {timeout:g} s ran out")  # the ServerApp's record
                raise FedltError(f"the run did not finish within {timeout:g} s; logs in {self.workdir}")
        finally:
            self.stop(flwr)
        log = (self.workdir / "flwr-run.log").read_text(errors="replace")
        result = _read_outcome(outcome)
        if result is None:
            raise FedltError(f"the ServerApp ended without saying how the run went (flwr run exit code "
                             f"{flwr.returncode}); see {self.workdir / 'flwr-run.log'}")
        if result["status"] != "finished":
            error = ConfigError if result.get("config_error") else FedltError
            raise error(_aborted(result))
        return subprocess.CompletedProcess(flwr.args, 0, log, "")


#: the ServerApp's last line, the run's result (``flower_app.final_line``): kept for stdout
_RESULT = re.compile(r"fedlt: .+: finished; ")
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")
#: a Flower log line with nothing after its level (``INFO :      ``), which it prints as a spacer
_EMPTY = re.compile(r"(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s*:\s*$")


#: Flower's own routine lines: its DEBUG/INFO log lines and ``flwr run``'s start-up line
_FLOWER_CHATTER = re.compile(r"(DEBUG|INFO)\s*:|Successfully (started|built|installed) |Using SuperLink: ")


def is_result(line: str) -> bool:
    return _RESULT.match(_COLOUR.sub("", line)) is not None


def say(line: str) -> None:
    """A line of the deploy command's own, on the stream the run's log is relayed to."""
    print(f"fedlt deploy: {line}", file=sys.stderr, flush=True)


def show_progress(log: "GrowingFile", stream=None, flower_lines: bool = True) -> None:
    """Relay the run's log (``flwr run --stream``: Flower's lines and the ServerApp's) as it grows, in
    its own order, on one stream (stderr): colour codes removed unless that stream is a terminal,
    Flower's empty spacer lines dropped, a Python traceback's frames left to the log file (its last
    line, the exception, is relayed; the run's own error line follows), the result line kept for stdout.
    ``flower_lines=False`` drops Flower's DEBUG/INFO lines and its start-up line too."""
    stream = stream if stream is not None else sys.stderr
    colour = stream.isatty()
    for line in log.new_lines():
        plain = _COLOUR.sub("", line)
        if plain.startswith("Traceback (most recent call last):"):
            log.in_traceback = True
            print(f"(a traceback, in {log.path})", file=stream, flush=True)
            continue
        if log.in_traceback and plain[:1].isspace():  # a frame
            continue
        log.in_traceback = False
        if not plain.strip() or _EMPTY.fullmatch(plain.strip()) or is_result(plain):
            continue
        if not flower_lines and _FLOWER_CHATTER.match(plain):
            continue
        print(line if colour else plain, file=stream, flush=True)


class GrowingFile:
    """The complete lines a file (a process's log) has gained since the last call."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rest = path, 0, b""
        self.in_traceback = False  # the relay's place: inside a traceback's frames, which it leaves out

    def new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:  # not written yet
            return []
        self.offset += len(chunk)
        *lines, self.rest = (self.rest + chunk).split(b"\n")
        return [line.decode(errors="replace").rstrip("\r") for line in lines]


def _read_outcome(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _aborted(outcome: dict) -> str:
    if outcome.get("config_error") or not outcome.get("run_dir"):
        return outcome["reason"]
    if outcome.get("untouched"):  # a resume that trained no round: the folder holds what it held before
        return (f"the resumed run stopped before it trained a round: {outcome['reason']}; {outcome['run_dir']} is "
                "as it was" + resume_line(outcome["run_dir"]))
    return (f"the run was aborted after {outcome['rounds_done']} round(s): {outcome['reason']}; "
            f"its summary is in {outcome['run_dir']}" + resume_line(outcome["run_dir"]))


def resume_line(run_dir: str) -> str:
    """How a stopped deployed run goes on, where it can: ``; `fedlt deploy --resume RUN_DIR` ...``, or ''."""
    from fedlt.engine.flower_app import resume_point

    point = resume_point(Path(run_dir))
    return "" if point is None else (f"; `fedlt deploy --resume {shlex.quote(run_dir)}` with the same options goes "
                                     f"on from its checkpoint of round {point[1]}")


def _outcome_tail(path: Path) -> str:
    outcome = _read_outcome(path)
    return f" ({_aborted(outcome)})" if outcome and outcome["status"] != "finished" else ""


def _descendants(pid: int, table: dict[int, tuple[int, int, str]] | None = None) -> list[int]:
    """Every live process below ``pid`` (Flower starts some helpers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for child, (parent, _, _) in (table if table is not None else _processes()).items():
        children.setdefault(parent, []).append(child)
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _members(groups: set[int]) -> list[int]:
    return [pid for pid, (_, group, state) in _processes().items() if group in groups and state != "Z"]


def _stop_groups(groups: set[int]) -> None:
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
        for group in groups:
            try:
                os.killpg(group, sig)
            except (ProcessLookupError, PermissionError):
                pass
        deadline = time.monotonic() + wait
        while _members(groups) and time.monotonic() < deadline:
            time.sleep(0.1)
        if not _members(groups):
            return


def _inheritors(mark: bytes) -> list[int]:
    """Live processes (not this one) whose environment holds ``mark``: every process the federation
    started, and everything they started, inherits its FLWR_HOME, also one that opened a session of
    its own or lost its parent after the groups were noted."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        pid = int(environ.parent.name)
        try:
            live = Path(environ.parent, "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
            if pid != os.getpid() and live and mark in environ.read_bytes().split(b"\0"):
                found.append(pid)
        except OSError:
            continue
    return found


def _stop_inheritors(flwr_home: str, seconds: float = 4.0) -> None:
    """Stop what the process groups missed (a helper started while the signal arrived): SIGTERM, then
    SIGKILL, until no process carries the federation's FLWR_HOME or ``seconds`` have passed."""
    mark, deadline, sig = f"FLWR_HOME={flwr_home}".encode(), time.monotonic() + seconds, signal.SIGTERM
    while (left := _inheritors(mark)) and time.monotonic() < deadline:
        for pid in left:
            try:
                os.kill(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.2)
        sig = signal.SIGKILL  # a straggler gets one polite request


def check_tls(tls: bool, auth: bool) -> None:
    """--auth needs --tls (Flower's rule), and --tls the openssl that makes its certificates."""
    if auth and not tls:
        raise ConfigError(AUTH_NEEDS_TLS)
    if tls and shutil.which("openssl") is None:
        raise ConfigError("--tls makes its certificates with openssl, which is not on PATH; install it "
                          "(e.g. apt install openssl) or drop --tls")


def check_supernode_poll() -> None:
    """Refuse a bad ``$FEDLT_SUPERNODE_POLL`` before anything starts: every SuperNode would refuse it and
    exit, and the run wait ``flower.connect_timeout_s`` for nodes that never come."""
    from fedlt.engine.flower_supernode import chosen_poll

    try:
        chosen_poll()
    except ValueError as err:
        raise ConfigError(f"{err} (the SuperNodes' poll)") from None


@contextmanager
def local_federation(workdir: Path, nodes: int | None = None, tls: bool = False, startup_s: float = 60, *,
                     sites: list[Site] | None = None, auth: bool = False,
                     flower_waits: bool = False) -> Iterator[Federation]:
    """Start a SuperLink and one SuperNode per site (``sites``, or ``nodes`` partitions) on
    127.0.0.1; stop them all on exit. ``auth`` (TLS only, as Flower requires) starts the SuperLink
    with ``--enable-supernode-auth`` and registers a fresh key pair per SuperNode before it starts.
    The SuperNodes run with their waits shortened (:mod:`fedlt.engine.flower_supernode`), or with
    Flower's own if ``flower_waits`` (a plain-Flower baseline)."""
    sites = sites if sites is not None else partition_sites(nodes if nodes is not None else 3)
    check_tls(tls, auth)
    if not flower_waits:
        check_supernode_poll()
    workdir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_HOME": str(workdir / "flwr-home"), "PYTHONUNBUFFERED": "1", OUTCOME_ENV: str(workdir / OUTCOME_NAME),
           STOP_REASON_ENV: str(workdir / "stop-reason.txt"), LOST_NODES_ENV: str(workdir / "lost-nodes.txt"),
           "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))}
    src = str(APP_DIR / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    fed = Federation(workdir, free_port(), tls, env)
    bin_dir = Path(sys.executable).parent
    try:
        certs = None
        if tls:
            certs = make_certificates(workdir / "certs")
            fed.ca = certs[0]
        tried: list[int] = []
        for tries in range(1, PORT_TRIES + 1):
            fed.superlink = fed.start("superlink.log", str(bin_dir / "flower-superlink"),
                                      *superlink_args(fed.port, workdir / "state.db", certs, auth))
            say(f"starting a SuperLink on {HOST}:{fed.port}" + (" (TLS)" if tls else ""))
            try:
                _wait_for_port(fed.port, time.monotonic() + startup_s, fed.superlink, workdir / "superlink.log")
                break
            except PortTaken:
                tried.append(fed.port)
                if tries == PORT_TRIES:
                    raise PortTaken(ports_taken_error("the SuperLink", tried)) from None
                fed.port = free_port()
        home = workdir / "flwr-home"
        home.mkdir(exist_ok=True)
        security = f'root-certificates = "{fed.ca}"' if tls else "insecure = true"
        (home / "config.toml").write_text(  # the `flwr` CLI's connection, for registration and `flwr run`
            f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "{HOST}:{fed.port}"\n{security}\n')
        keys = [workdir / "keys" / f"supernode{i}" if auth else None for i in range(len(sites))]
        if auth:  # every key is registered before any SuperNode starts, or the SuperLink turns it away
            fed.node_ids = fed.register([(make_node_key(key), site.name) for key, site in zip(keys, sites)])
        for i, (site, key) in enumerate(zip(sites, keys)):
            program = [str(bin_dir / "flower-supernode")] if flower_waits else [
                sys.executable, "-m", "fedlt.engine.flower_supernode"]
            fed.start_node(i, *program,
                           *supernode_args(site, f"{HOST}:{fed.port}", fed.ca, key, startup_s), startup_s=startup_s,
                           name=site.name)
        fed.wait_for_nodes(time.monotonic() + startup_s)
        say(f"started {len(sites)} SuperNode(s) ({', '.join(site.name for site in sites)}), each with its ClientApp "
            f"process; logs in {workdir}")
        yield fed
    finally:
        _CLEANUP["running"] += 1  # first, and no call: the deploy command's stop signals wait from here on
        try:
            signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # a second Ctrl-C must not cut the cleanup short
            try:
                fed.track()
                _stop_groups(set().union(*fed.groups.values()) - {os.getpgrp()} if fed.groups else set())
                _stop_inheritors(env["FLWR_HOME"])
                for proc in [*fed.nodes, *fed.workers, *([fed.superlink] if fed.superlink else [])]:
                    proc.poll()
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
        finally:
            _CLEANUP["running"] -= 1
        late, _CLEANUP["late"] = _CLEANUP["late"], None
        if late is not None and sys.exc_info()[1] is None:  # the federation had ended as the signal came: a stop
            raise late


AUTH_NEEDS_TLS = ("--auth needs --tls: Flower 1.41's SuperLink refuses --enable-supernode-auth without TLS "
                  "certificates; add --tls")


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class Stopped(BaseException):
    """The deploy command got SIGINT or SIGTERM: unwind, stopping the federation on the way. Not an
    Exception (as KeyboardInterrupt is not): code that catches any error, such as the check that Flower's
    run config carries the config's path or a plug-in's import, took it for its own and failed with it."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


#: federations stopping their processes now, and the stop signal that came meanwhile: the deploy command's
#: handler keeps it for after the clean-up, which a signal landing before the mask takes hold would skip
_CLEANUP: dict[str, Any] = {"running": 0, "late": None}


def _raise_stopped(signum: int, _frame) -> None:
    if _CLEANUP["running"]:
        _CLEANUP["late"] = _CLEANUP["late"] or Stopped(signum)
        return
    raise Stopped(signum)


def check_deployable(config: str, overrides: list[str]):
    """The config as the ServerApp will build it, with every check that needs no process: a
    refused config ends the deploy command before anything starts."""
    from fedlt.config import load_config
    from fedlt.run_parts import check_new_config

    cfg = load_config(config, [*overrides, "engine=flower"])
    if check_new_config(cfg).pooled:
        raise ConfigError(f"method {cfg.method} trains on pooled data and cannot be deployed over Flower; "
                          "run it with `fedlt run` (engine=inprocess)")
    return cfg


def check_site_folders(cfg, folders: list[Path]) -> None:
    """Read every site's folder (and the server's test and validation sets) as its SuperNode and the
    ServerApp will: a malformed folder is one DataError line naming the file, before any process starts."""
    from fedlt.data.declaration import declared_dataset
    from fedlt.data.sources.imagefolder import load_node_data

    from fedlt.engine.flower_nodes import require_test_folder, server_set

    declared = declared_dataset(cfg.data)
    for folder in folders:
        require_test_folder(cfg, folder, load_node_data(folder, declared).test is not None)
    for key in ("test_data", "val_data"):  # --server-test sets eval.test_data; either may be an override
        server_set(cfg, key, "cpu")


@dataclass(frozen=True)
class Plan:
    """What a deploy will start and run, settled (or refused) before any process starts."""

    config: Path
    #: the run's overrides, the deploy's own last
    overrides: list[str]
    sites: list[Site]
    tls: bool
    auth: bool
    #: the run to go on with from its checkpoint (``config`` is its config.yaml), or None: a new run
    resume: Path | None = None
    #: the result line of a resumed run that has ended all its rounds: nothing is started for it
    finished: str | None = None


def refuse_contradictions(overrides: list[str], settled: list[str], by: str) -> None:
    """An override of a key the deployment settles (``settled``, ``key=value``) to another value is
    refused, not silently replaced; the same value passes."""
    from fedlt.config import parse_scalar

    wanted = dict(o.split("=", 1) for o in settled)
    for override in overrides:
        key, _, value = override.partition("=")
        key = key.strip()
        if key in wanted and parse_scalar(value) != parse_scalar(wanted[key]):
            raise ConfigError(f"{override} contradicts {by}, which sets {key}={wanted[key]}; drop the override")
        if key == "engine" and parse_scalar(value) != "flower":
            raise ConfigError("a deployment runs on Flower; drop the engine= override")


def plan_deployment(config: str, overrides: list[str], *, nodes: int | None = None, tls: bool = False,
                    auth: bool = False, node_data: Path | None = None, server_test: Path | None = None,
                    resume: Path | None = None) -> Plan:
    """Check the options and the config and decide the SuperNodes and the run's overrides; bad input
    raises a ConfigError naming the fix, with nothing started and no folder made. With ``resume`` (a run's
    folder) the config is the run's own, and what its nodes cannot go on with is refused here too."""
    if resume is not None:
        return _plan_resume(resume, config, overrides, nodes=nodes, tls=tls, auth=auth, node_data=node_data,
                            server_test=server_test)
    if "=" in config and not Path(config).is_file():
        raise ConfigError(f"the deploy command needs a config file first, not {config!r}; "
                          "e.g. configs/synthetic_smoke.yaml fl.rounds=2")
    check_tls(tls, auth)
    if nodes is not None and nodes < 1:
        raise ConfigError(f"--nodes {nodes}: use 1 or more SuperNodes")
    check_run_config(Path(config), overrides, overrides)  # the user's own first: named before the config is read
    extra = []
    if node_data is not None:
        sites = node_data_sites(node_data)
        if nodes is not None and nodes != len(sites):
            raise ConfigError(f"--nodes {nodes} conflicts with --node-data {node_data}, which has {len(sites)} site "
                              "folder(s), one SuperNode each; drop --nodes")
        # one client per site: what the ServerApp will run, so every check sees the federation it gets
        extra = ["flower.node_data=true", f"flower.min_nodes={len(sites)}", f"data.num_clients={len(sites)}"]
    else:
        sites = partition_sites(nodes if nodes is not None else 3)
    if server_test is not None:
        if node_data is None:
            raise ConfigError("--server-test is the server's test set of a federation whose sites hold their data; "
                              "add --node-data DIR")
        if not _is_dir(server_test):
            raise ConfigError(f"--server-test {server_test} is not a folder; give the server's test set "
                              "(an image-folder tree, one subfolder per class)")
        extra.append(f"eval.test_data={server_test.resolve()}")
    by = f"--node-data {node_data} ({len(sites)} site folders)" + (f" and --server-test {server_test}"
                                                                  if server_test is not None else "")
    refuse_contradictions(overrides, extra, by)
    given = [*overrides, *extra]
    cfg = check_deployable(config, given)
    if node_data is None and cfg.flower.node_data:
        raise ConfigError("flower.node_data=true needs SuperNodes that hold their data; "
                          "use --node-data DIR (one subfolder per site) instead of the override")
    if node_data is not None:
        check_site_folders(cfg, [node_data / site.name for site in sites])
    elif len(sites) > cfg.data.num_clients:  # a SuperNode would serve no client: a process for nothing
        raise ConfigError(f"--nodes {len(sites)}: the federation has {cfg.data.num_clients} clients "
                          f"(data.num_clients) and each SuperNode serves at least one; use --nodes "
                          f"{cfg.data.num_clients} or fewer")
    out_dir = Path(cfg.run.out_dir).resolve()  # the ServerApp runs elsewhere
    check_output_path(out_dir, True, "run.out_dir")
    sets = [f"eval.{key}={Path(path).expanduser().resolve()}" for key in ("test_data", "val_data")
            if (path := getattr(cfg.eval, key))]  # as checked here, whatever folder the ServerApp runs in
    final = [*given, *sets, "engine=flower", f"run.out_dir={out_dir}"]
    check_run_config(Path(config), final, overrides)
    return Plan(Path(config), final, sites, tls, auth)


def _plan_resume(run_dir: Path, config: str | None, overrides: list[str], **options: Any) -> Plan:
    """The plan of a new run of the config ``run_dir`` began with, to go on with that run."""
    from fedlt.config import load_config
    from fedlt.engine.flower_app import final_line, resumable_on_nodes

    if config or overrides:
        raise ConfigError(f"--resume {run_dir} goes on with the run's own config; drop {config or overrides[0]!r}")
    if not (run_dir / CONFIG_FILE).is_file():
        raise ConfigError(f"--resume {run_dir} is not a fedlt run directory (no {CONFIG_FILE}); pass a run's folder")
    ran = load_config(run_dir / CONFIG_FILE)
    if ran.engine != "flower":
        raise ConfigError(f"{run_dir} ran in-process (engine={ran.engine}); resume it with fedlt run --resume {run_dir}")
    if (summary := _finished_summary(run_dir, ran.fl.rounds)) is not None:  # a deployment would train nothing
        return Plan(run_dir / CONFIG_FILE, [], [], options["tls"], options["auth"], resume=run_dir,
                    finished=final_line(run_dir.resolve(), summary))
    saved, _ = resumable_on_nodes(ran, run_dir)
    _check_resume_options(run_dir, ran, saved, options["node_data"], options["server_test"])
    plan = plan_deployment(str(run_dir / CONFIG_FILE), [], **options)
    resumable_on_nodes(load_config(plan.config, plan.overrides), run_dir)
    return dataclasses.replace(plan, resume=run_dir)


def _finished_summary(run_dir: Path, rounds: int) -> dict[str, Any] | None:
    """The summary of the run in ``run_dir`` if it has ended all its ``rounds``; None if it has not (no
    summary, a stopped run's, or one that cannot be read: the resume writes it again)."""
    try:
        summary = read_summary(run_dir) if (run_dir / SUMMARY_FILE).is_file() else None
    except FedltError:
        return None
    return summary if summary and "status" not in summary and summary.get("rounds") == rounds else None


def _check_resume_options(run_dir: Path, ran: Any, saved: dict[str, Any], node_data: Path | None,
                          server_test: Path | None) -> None:
    """The deploy options a resume must give as the run was deployed: the same sites (by folder name) and
    server test set, named here, before any process starts, not as a config the run's folder differs from."""
    sites = (saved.get("federation") or {}).get("sites") or []
    if ran.flower.node_data and node_data is None:
        raise ConfigError(f"{run_dir} ran on sites that hold their own data ({', '.join(sites) or 'their folders'}); "
                          "resume it with --node-data DIR, the folder of those sites' folders")
    if not ran.flower.node_data and node_data is not None:
        raise ConfigError(f"{run_dir} ran on SuperNodes serving partitions of data.dataset={ran.data.dataset}, not on "
                          f"sites' own data; drop --node-data{' and --server-test' if server_test else ''}")
    if node_data is not None and sites:
        given = [site.name for site in node_data_sites(node_data)]
        if sorted(given) != sorted(sites):
            raise ConfigError(f"--node-data {node_data} holds sites {', '.join(given)}, but {run_dir} ran on "
                              f"{', '.join(sites)}; pass the folder of the run's own sites")
    if server_test is not None and ran.flower.node_data:
        if not ran.eval.test_data:
            raise ConfigError(f"{run_dir} ran without a server test set (the sites evaluated on their own test "
                              "splits); drop --server-test")
        if server_test.resolve() != Path(ran.eval.test_data).expanduser().resolve():
            raise ConfigError(f"--server-test {server_test} is not the server test set {run_dir} ran with "
                              f"({ran.eval.test_data}); pass that folder, or leave --server-test out")


def deploy(config: str | None, overrides: list[str], *, nodes: int | None = None, tls: bool = False,
           auth: bool = False, node_data: Path | None = None, server_test: Path | None = None,
           workdir: Path = Path("runs/deploy"), timeout: float = 3600, resume: Path | None = None) -> int:
    """The deploy command behind both ``fedlt deploy`` and ``python -m fedlt.deploy``, so they
    cannot drift: returns the exit code, prints errors as one ``fedlt: error:`` line, never a
    traceback, and leaves no process of the federation running (SIGINT/SIGTERM included)."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in _STOP_SIGNALS}
    started = time.time()
    try:
        if not timeout > 0:
            raise ConfigError(f"--timeout {timeout:g}: give the seconds the run may take, more than 0")
        if config is None and resume is None:
            raise ConfigError("the deploy command needs a config file (or --resume RUN_DIR)")
        plan = plan_deployment(config or "", overrides, nodes=nodes, tls=tls, auth=auth, node_data=node_data,
                               server_test=server_test, resume=resume)
        if plan.finished is not None:
            print(plan.finished)
            return 0
        check_output_path(workdir, True, "--workdir")
        check_supernode_poll()
        workdir = workdir.resolve()
        workdir.mkdir(parents=True, exist_ok=True)
        with holding(workdir, f"--workdir {workdir} is the folder of a deployment still running (its Flower "
                              "state, logs and outcome); wait for it to end, or give this one another --workdir"), \
                local_federation(workdir, tls=plan.tls, sites=plan.sites, auth=plan.auth) as fed:
            done = fed.run(plan.config, plan.overrides, timeout, resume=plan.resume)
        results = [_COLOUR.sub("", line) for line in done.stdout.splitlines() if is_result(line)]
        print("\n".join(results))  # the rest of the log went by on stderr
        return 0
    except (ConfigError, DataError) as err:  # bad input: found before anything started, or by the ServerApp
        print(f"fedlt: error: {one_line(str(err))}", file=sys.stderr)
        return 2
    except FedltError as err:
        print(f"fedlt: error: {one_line(str(err))}", file=sys.stderr)
        return 1
    except Stopped as stop:
        path = workdir / OUTCOME_NAME  # the ServerApp's, stopped with the rest; not an earlier deploy's
        outcome = (_read_outcome(path) or {}) if path.is_file() and path.stat().st_mtime >= started else {}
        print(f"fedlt: error: stopped by {stop}; every process of the federation was stopped"
              + (resume_line(outcome["run_dir"]) if outcome.get("run_dir") else ""), file=sys.stderr)
        return 128 + stop.signum
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        """A usage error is one line and exit code 2, like every other refusal."""
        print(f"fedlt: error: {one_line(message)}; see `{self.prog} --help`", file=sys.stderr)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="python -m fedlt.deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", nargs="?", default=None, help="fedlt config YAML")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--nodes", type=int, default=None, help="SuperNodes (partitions) to start (default 3)")
    parser.add_argument("--node-data", type=Path, default=None, metavar="DIR",
                        help="one SuperNode per subfolder of DIR, each training on its own folder")
    parser.add_argument("--server-test", type=Path, default=None, metavar="DIR",
                        help="with --node-data: the server's test set (eval.test_data)")
    parser.add_argument("--tls", action="store_true", help="TLS with certificates made by openssl (default: --insecure)")
    parser.add_argument("--auth", action="store_true",
                        help="with --tls: SuperNode authentication, one registered key pair per SuperNode")
    parser.add_argument("--workdir", type=Path, default=Path("runs/deploy"),
                        help="logs, certificates, keys, Flower state")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the run is abandoned")
    parser.add_argument("--resume", type=Path, default=None, metavar="RUN_DIR",
                        help="go on with a deployed run from its last checkpoint (clients without state between "
                        "rounds)")
    a = parser.parse_args(argv)
    return deploy(a.config, a.overrides, nodes=a.nodes, tls=a.tls, auth=a.auth, node_data=a.node_data,
                  server_test=a.server_test, workdir=a.workdir, timeout=a.timeout, resume=a.resume)


if __name__ == "__main__":
    sys.exit(main())
