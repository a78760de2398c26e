"""The parallel backend: a phase's clients answer at the same time, in worker processes.

Why processes: a small model's batch does not split well over CPU threads. Measured on this
project's 2-core machine (CNN, batch 32): one process with 2 threads trains 65 steps/s, two
single-threaded processes 90 together (docs/results/speed.md). So ``run.backend=parallel``
starts ``run.workers`` processes (default: one per core), each with cores / workers threads and
its own :class:`~fedlt.engine.clients.ClientRuntime` built from the run's config, exactly as a
Flower SuperNode builds one, and hands each phase's messages to whichever worker is free,
largest client first.

Results equal sequential training's (to float rounding: a different thread count may sum in
another order): a client's answer depends only on its message, its ``ctx.state`` (sent along
and returned) and its seeds, never on which process computed it. Each worker holds its own
copy of the federation's data.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any

import torch

from fedlt.config import Config
from fedlt.messages import Message, Reply

#: one job: (client id, message, the client's ctx.state); its answer: (reply, updated state)
Job = tuple[int, Message, dict[str, Any]]


def cpu_cores() -> int:
    """The cores this process may run on (a container's limit, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers(cfg: Config) -> int:
    """``run.workers``, else one per CPU core, never more than a round samples."""
    return max(1, cfg.run.workers or min(cpu_cores(), cfg.clients_per_round()))


class ClientPool:
    """Worker processes that answer client exchanges; start once per run, :meth:`close` after.

    Workers are fresh interpreters (:func:`serve_fd`) talking over a socket pair: unlike
    multiprocessing's spawn they do not re-import the caller's ``__main__``, so a user script needs
    no ``if __name__ == "__main__"`` guard, and unlike fork they never inherit torch's OpenMP
    threads."""

    def __init__(self, cfg: Config, workers: int):
        threads = cfg.run.threads or max(1, cpu_cores() // workers)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        config_json = json.dumps(cfg.dump()).encode()
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        for _ in range(workers):
            mine, theirs = socket.socketpair()
            code = f"from fedlt.engine.process_pool import serve_fd; serve_fd({theirs.fileno()}, {threads})"
            proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                    stdin=subprocess.DEVNULL, env=env)
            theirs.close()
            conn = Connection(mine.detach())
            conn.send_bytes(config_json)
            self._conns.append(conn)
            self._procs.append(proc)

    def answer(self, kind: str, rnd: int, jobs: list[Job], cost: dict[int, int]) -> list[tuple[Reply, dict[str, Any]]]:
        """Every job's (reply, state), in job order. Jobs go out largest ``cost`` first, each to
        the next free worker, so one big client does not leave the other workers idle at the end."""
        if not self.open:
            raise RuntimeError("this ClientPool is closed; start a new one")
        order = sorted(range(len(jobs)), key=lambda i: -cost.get(jobs[i][0], 0))
        results: list[Any] = [None] * len(jobs)
        busy: dict[Connection, int] = {}
        idle = list(self._conns)
        while order or busy:
            while order and idle:
                conn, i = idle.pop(), order.pop(0)
                try:
                    conn.send_bytes(pickle.dumps((kind, rnd, *jobs[i]), protocol=pickle.HIGHEST_PROTOCOL))
                except OSError:
                    self._died()
                busy[conn] = i
            for conn in wait(list(busy)):
                i = busy.pop(conn)
                results[i] = self._receive(conn)
                idle.append(conn)
        return results

    def _receive(self, conn: Connection) -> tuple[Reply, dict[str, Any]]:
        try:
            status, value = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._died()
        if status == "error":
            self.close()
            error, text = value
            if isinstance(error, BaseException):
                raise error from RuntimeError(f"in a worker process:\n{text}")
            raise RuntimeError(f"a worker process failed:\n{text}")
        return value

    @property
    def open(self) -> bool:
        return bool(self._conns)

    def _died(self) -> None:
        self.close()
        raise RuntimeError("a run.backend=parallel worker process died (killed, or out of memory?); "
                           "lower run.workers or use run.backend=sequential") from None

    def close(self) -> None:
        for conn in self._conns:
            conn.close()
        for proc in self._procs:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._conns, self._procs = [], []


def _serve(conn: Connection, threads: int) -> None:
    """A worker's loop: build the client runtime from the config it is sent first, then answer
    jobs until the pipe closes. A failure is sent back with the job it stopped."""
    from fedlt.api import setup_parts
    from fedlt.config import build_config
    from fedlt.engine.clients import ClientRuntime

    runtime, failure = None, None
    try:
        cfg = build_config(json.loads(conn.recv_bytes()))
        spec, data, device = setup_parts(cfg)
        torch.set_num_threads(threads)
        runtime = ClientRuntime(cfg, spec, data, device)
    except (EOFError, OSError):
        return
    except Exception as error:
        failure = error
    while True:
        try:
            kind, rnd, cid, msg, state = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            return
        try:
            if runtime is None:
                raise failure
            out: Any = ("ok", (runtime.handle(kind, cid, rnd, msg, state), state))
        except Exception as error:
            out = ("error", (_picklable(error), traceback.format_exc()))
        conn.send_bytes(pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL))


def _picklable(error: BaseException) -> BaseException | None:
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return None


def serve_fd(fd: int, threads: int) -> None:
    """A worker process's entry point: serve the socket it inherited as file descriptor ``fd``.
    Ctrl-C is the parent's to handle: a worker ends when the parent closes the socket."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _serve(Connection(fd), threads)
