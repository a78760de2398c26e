"""A real Flower deployment on this machine: one SuperLink and N SuperNodes on 127.0.0.1, plain
or TLS (certificates made here with openssl), and ``flwr run`` of a fedlt config over them.

SuperNode ``I`` gets ``--node-config "partition-id=I num-partitions=N"`` and hosts the fedlt
clients ``k`` with ``k % N == I``; it builds the same seeded partition from the config and trains
only its own clients' rows, so no data moves. Every process started here runs in its own process
group and is killed by id when the federation closes, whatever happened.

``python -m fedlt.deploy --nodes 3 [--tls] CONFIG [key=value ...]`` (or scripts/flower_deploy.sh).
"""

from __future__ import annotations

import argparse
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

HOST = "127.0.0.1"
APP_DIR = Path(__file__).resolve().parents[2]  # the checkout: pyproject.toml with [tool.flwr.app]


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def _wait_for_port(port: int, deadline: float, proc: subprocess.Popen) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise FedltError(f"the SuperLink exited (code {proc.returncode}) before listening; see its log")
        with socket.socket() as s:
            if s.connect_ex((HOST, port)) == 0:
                return
        time.sleep(0.2)
    raise FedltError(f"the SuperLink did not listen on {HOST}:{port} in time")


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
    ca: Path | None = None

    def start(self, log: str, *args: str) -> subprocess.Popen:
        out = open(self.workdir / log, "w")
        return subprocess.Popen([*args], stdout=out, stderr=subprocess.STDOUT, env=self.env, cwd=self.workdir,
                                start_new_session=True)

    def kill_node(self, i: int) -> None:
        """Kill SuperNode ``i`` and the ClientApp it may be running (its whole process group)."""
        _kill(self.nodes[i])

    def run(self, config: Path, overrides: list[str], timeout: float) -> subprocess.CompletedProcess:
        """``flwr run`` the fedlt app with ``config`` + ``overrides`` and wait for it (``--stream``)."""
        run_config = f'config="{config.resolve()}" overrides="{shlex.join(overrides)}"'
        args = [str(Path(sys.executable).with_name("flwr")), "run", str(APP_DIR), "deploy", "--stream",
                "--run-config", run_config]
        try:
            return subprocess.run(args, capture_output=True, text=True, env=self.env, timeout=timeout,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            raise FedltError(f"flwr run did not finish within {timeout:g} s; logs in {self.workdir}") from None


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (Flower starts some helpers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _kill(proc: subprocess.Popen) -> None:
    """Stop ``proc`` and every process below it, by id: SIGTERM, then SIGKILL what is left."""
    pids = [proc.pid, *_descendants(proc.pid)]
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (proc.poll() is None or any(_alive(p) for p in pids[1:])):
        time.sleep(0.1)
    _signal([p for p in {*pids, *_descendants(proc.pid)} if _alive(p)], signal.SIGKILL)
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass


@contextmanager
def local_federation(workdir: Path, nodes: int, tls: bool = False, startup_s: float = 60) -> Iterator[Federation]:
    """Start a SuperLink and ``nodes`` SuperNodes on 127.0.0.1; stop them all on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_HOME": str(workdir / "flwr-home"), "PYTHONUNBUFFERED": "1",
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
        _wait_for_port(port, time.monotonic() + startup_s, fed.superlink)
        for i in range(nodes):
            fed.nodes.append(fed.start(
                f"supernode{i}.log", str(bin_dir / "flower-supernode"), *node_sec, "--superlink", f"{HOST}:{port}",
                "--host", HOST, "--port", str(free_port()), "--max-wait-time", str(int(startup_s)),
                "--node-config", f"partition-id={i} num-partitions={nodes}"))
        home = workdir / "flwr-home"
        home.mkdir(exist_ok=True)
        security = f'root-certificates = "{fed.ca}"' if tls else "insecure = true"
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "deploy"\n\n[superlink.deploy]\naddress = "{HOST}:{port}"\n{security}\n')
        yield fed
    finally:
        for proc in [*fed.nodes, *([fed.superlink] if fed.superlink else [])]:
            _kill(proc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedlt.deploy", description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="fedlt config YAML")
    parser.add_argument("overrides", nargs="*", help="key=value overrides")
    parser.add_argument("--nodes", type=int, default=3, help="SuperNodes (partitions) to start")
    parser.add_argument("--tls", action="store_true", help="TLS with certificates made by openssl (default: --insecure)")
    parser.add_argument("--workdir", type=Path, default=Path("runs/deploy"), help="logs, certificates, Flower state")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds before the run is abandoned")
    a = parser.parse_args(argv)
    try:
        if a.nodes < 1:
            raise ConfigError("--nodes must be at least 1")
        from fedlt.config import load_config

        out_dir = Path(load_config(a.config, a.overrides).run.out_dir)  # also checks the config first
        overrides = [*a.overrides, f"run.out_dir={out_dir.resolve()}"]  # the ServerApp runs elsewhere
        with local_federation(a.workdir.resolve(), a.nodes, a.tls) as fed:
            done = fed.run(Path(a.config), overrides, a.timeout)
        print(done.stdout[-4000:], done.stderr[-2000:], sep="\n")
        return done.returncode
    except FedltError as err:
        print(f"fedlt: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
