"""A real Flower deployment on this machine: one SuperLink and N SuperNodes on 127.0.0.1, plain
or TLS (certificates made here with openssl), and ``flwr run`` of a fedlt config over them.

SuperNode ``I`` gets ``--node-config "partition-id=I num-partitions=N"`` and hosts the fedlt
clients ``k`` with ``k % N == I``; it builds the same seeded partition from the config and trains
only its own clients' rows, so no data moves. Each SuperNode runs with ``--isolation process``
beside one long-lived ClientApp process (:mod:`fedlt.engine.flower_worker`) that serves all its
messages: Flower's default starts a fresh ``flwr-clientapp`` per message, whose imports cost more
than a small round's training. A SuperNode and its ClientApp process stop together, whichever
ends first. Every process started here runs in its own process group; those groups, and the
sessions Flower's helpers open below them, are signalled when a node dies and when the federation
closes, whatever happened (SIGINT and SIGTERM included).

The outcome comes from the ServerApp itself (``$FEDLT_OUTCOME_FILE``), not from ``flwr run``,
which exits 0 when the ServerApp raised: no outcome file means the run failed. Exit codes: 0
finished, 1 failed (one ``fedlt: error:`` line naming the cause), 2 refused config, 128+N signal N.

``python -m fedlt.deploy --nodes 3 [--tls] CONFIG [key=value ...]`` (or scripts/flower_deploy.sh).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from fedlt.errors import ConfigError, FedltError
from fedlt.results import OUTCOME_ENV

HOST = "127.0.0.1"
APP_DIR = Path(__file__).resolve().parents[2]  # the checkout: pyproject.toml with [tool.flwr.app]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


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


def _wait_for_port(port: int, deadline: float, proc: subprocess.Popen, log: Path) -> None:
    """Wait until ``proc`` (our SuperLink) itself listens on ``port``: a program that took the port
    first must not pass for it."""
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            text = log.read_text(errors="replace") if log.is_file() else ""
            if "address already in use" in text.lower() or "errno 98" in text.lower():
                raise FedltError(f"another program took {HOST}:{port} before the SuperLink could listen on it; "
                                 "run again (a new free port is chosen)")
            raise FedltError(f"the SuperLink exited (code {proc.returncode}) before listening; see {log}")
        inode = _listening_inode(port)
        if inode is not None and _holds_socket([proc.pid, *_descendants(proc.pid)], inode):
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


@dataclass
class Federation:
    """A running SuperLink and SuperNodes (``nodes[i]`` serves partition i)."""

    workdir: Path
    port: int
    tls: bool
    env: dict[str, str]
    superlink: subprocess.Popen | None = None
    nodes: list[subprocess.Popen] = field(default_factory=list)
    #: ``workers[i]``: the ClientApp process serving ``nodes[i]``; its group is one of the node's
    workers: list[subprocess.Popen] = field(default_factory=list)
    ca: Path | None = None
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

    def kill_node(self, i: int) -> None:
        """Kill SuperNode ``i`` and its ClientApp process (its process groups)."""
        self.stop(self.nodes[i])

    def start_node(self, i: int, *args: str, startup_s: float) -> None:
        """SuperNode ``i`` (``args``: its command, without the Runtime API's address) and the
        ClientApp process that serves it; the latter's group joins the node's, so stopping the
        node stops both."""
        port = free_port()
        node = self.start(f"supernode{i}.log", *args, "--isolation", "process", "--host", HOST, "--port", str(port))
        worker = self.start(f"clientapp{i}.log", sys.executable, "-m", "fedlt.engine.flower_worker",
                            "--runtime-api-address", f"{HOST}:{port}", "--startup", str(startup_s))
        self.groups[node.pid] |= self.groups.pop(worker.pid)
        self.nodes.append(node)
        self.workers.append(worker)

    def run(self, config: Path, overrides: list[str], timeout: float) -> subprocess.CompletedProcess:
        """``flwr run`` the fedlt app with ``config`` + ``overrides`` (``--stream``) and wait, watching
        the federation; a run that did not finish raises a FedltError naming the cause (a
        ConfigError for a config the ServerApp refused)."""
        outcome = Path(self.env[OUTCOME_ENV])
        outcome.unlink(missing_ok=True)
        run_config = f'config="{config.resolve()}" overrides="{shlex.join(overrides)}"'
        flwr = self.start("flwr-run.log", str(Path(sys.executable).with_name("flwr")), "run", str(APP_DIR),
                          "deploy", "--stream", "--run-config", run_config)
        deadline = time.monotonic() + timeout
        try:
            while flwr.poll() is None and self.superlink.poll() is None and time.monotonic() < deadline:
                self.track()
                for node, worker in zip(self.nodes, self.workers):  # a SuperNode and its ClientApp go together
                    if (node.poll() is not None or worker.poll() is not None) and _members(self.groups[node.pid]):
                        self.stop(node)
                time.sleep(0.5)
            if self.superlink.poll() is not None:  # give the ServerApp time to write its summary
                end = time.monotonic() + 10
                while not outcome.is_file() and time.monotonic() < end:
                    time.sleep(0.2)
                raise FedltError(f"the SuperLink exited (code {self.superlink.returncode}) during the run"
                                 + _outcome_tail(outcome) + f"; logs in {self.workdir}")
            if flwr.poll() is None:
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


def _read_outcome(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _aborted(outcome: dict) -> str:
    if outcome.get("config_error") or not outcome.get("run_dir"):
        return outcome["reason"]
    return (f"the run was aborted after {outcome['rounds_done']} round(s): {outcome['reason']}; "
            f"its summary is in {outcome['run_dir']}")


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


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


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


@contextmanager
def local_federation(workdir: Path, nodes: int, tls: bool = False, startup_s: float = 60) -> Iterator[Federation]:
    """Start a SuperLink and ``nodes`` SuperNodes on 127.0.0.1; stop them all on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_HOME": str(workdir / "flwr-home"), "PYTHONUNBUFFERED": "1", OUTCOME_ENV: str(workdir / "outcome.json"),
           "PATH": os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))}
    src = str(APP_DIR / "src")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    fed = Federation(workdir, port, tls, env)
    bin_dir = Path(sys.executable).parent
    try:
        if tls:
            fed.ca, cert, key = make_certificates(workdir / "certs")
            link_sec = ["--ssl-ca-certfile", str(fed.ca), "--ssl-certfile", str(cert), "--ssl-keyfile", str(key)]
            node_sec = ["--root-certificates", str(fed.ca)]
        else:
            link_sec, node_sec = ["--insecure"], ["--insecure"]
        fed.superlink = fed.start("superlink.log", str(bin_dir / "flower-superlink"), *link_sec, "--host", HOST,
                                  "--port", str(port), "--disable-runtime-dependency-installation",
                                  "--database", str(workdir / "state.db"))
        _wait_for_port(port, time.monotonic() + startup_s, fed.superlink, workdir / "superlink.log")
        for i in range(nodes):
            fed.start_node(i, str(bin_dir / "flower-supernode"), *node_sec, "--superlink", f"{HOST}:{port}",
                           "--max-wait-time", str(int(startup_s)),
                           "--node-config", f"partition-id={i} num-partitions={nodes}", startup_s=startup_s)
        home = workdir / "flwr-home"
        home.mkdir(exist_ok=True)
        security = f'root-certificates = "{fed.ca}"' if tls else "insecure = true"
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "{HOST}:{port}"\n{security}\n')
        yield fed
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # a second Ctrl-C must not cut the cleanup short
        try:
            fed.track()
            _stop_groups(set().union(*fed.groups.values()) - {os.getpgrp()} if fed.groups else set())
            for proc in [*fed.nodes, *fed.workers, *([fed.superlink] if fed.superlink else [])]:
                proc.poll()
        finally:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}


class Stopped(Exception):
    """The deploy command got SIGINT or SIGTERM: unwind, stopping the federation on the way."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame) -> None:
    raise Stopped(signum)


def check_deployable(config: str, overrides: list[str]):
    """The config as the ServerApp will build it, with every check that needs no process: a
    refused config ends the deploy command before anything starts."""
    from fedlt.config import load_config
    from fedlt.run_parts import check_config

    cfg = load_config(config, [*overrides, "engine=flower"])
    if check_config(cfg).pooled:
        raise ConfigError(f"method {cfg.method} trains on pooled data and cannot be deployed over Flower; "
                          "run it with `fedlt run` (engine=inprocess)")
    return cfg


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedlt.deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="fedlt config YAML")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--nodes", type=int, default=3, help="SuperNodes (partitions) to start")
    parser.add_argument("--tls", action="store_true", help="TLS with certificates made by openssl (default: --insecure)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/deploy"), help="logs, certificates, Flower state")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the run is abandoned")
    a = parser.parse_args(argv)
    for sig in _STOP_SIGNALS:
        signal.signal(sig, _raise_stopped)
    try:
        if a.nodes < 1:
            raise ConfigError("--nodes must be at least 1")
        out_dir = Path(check_deployable(a.config, a.overrides).run.out_dir)
        overrides = [*a.overrides, "engine=flower", f"run.out_dir={out_dir.resolve()}"]  # the ServerApp runs elsewhere
        with local_federation(a.workdir.resolve(), a.nodes, a.tls) as fed:
            done = fed.run(Path(a.config), overrides, a.timeout)
        print(done.stdout[-4000:])
        return 0
    except ConfigError as err:
        print(f"fedlt: error: {err}", file=sys.stderr)
        return 2
    except FedltError as err:
        print(f"fedlt: error: {err}", file=sys.stderr)
        return 1
    except Stopped as stop:
        print(f"fedlt: error: stopped by {stop}; every process of the federation was stopped", file=sys.stderr)
        return 128 + stop.signum


if __name__ == "__main__":
    sys.exit(main())
