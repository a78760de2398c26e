"""The parallel backend: a phase's clients answer at the same time, in worker processes.

Why processes: a small model's batch does not split well over CPU threads. Measured on this
project's 2-core machine (CNN, batch 32, one client's steps): one process with 2 threads trains
65 steps/s, two single-threaded processes 90 together (docs/results/speed.md has the per-round
figures). So ``run.backend=parallel`` starts ``run.workers`` processes (default: one per core),
each with cores / workers threads and its own :class:`~fedlt.engine.clients.ClientRuntime` built
from the run's config, exactly as a Flower SuperNode builds one, and hands each phase's messages
to whichever worker is free, largest client first.

Results equal sequential training's (bit for bit at the same thread count): a client's answer
depends only on its message, its ``ctx.state`` (sent along and returned) and its seeded
generators, never on which process computed it. Client code that draws from torch's or numpy's
global RNG gets a per-(round, client, exchange) seed here instead of the sequential loop's running
state; no built-in method does. Each worker holds its own copy of the federation's data.
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
import zlib
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Iterable, Iterator

import numpy as np
import torch

from fedlt.config import Config, build_config
from fedlt.engine.clients import ClientRuntime
from fedlt.environment import keyed_compile_cache
from fedlt.errors import FedltError
from fedlt.messages import Message, Reply
from fedlt.run_parts import setup_parts
from fedlt.seeding import seed_for

#: one job: (client id, message, the client's ctx.state); its answer: (reply, updated state)
Job = tuple[int, Message, dict[str, Any]]
#: jobs in flight or waiting, per worker: bounds the messages and replies held at once
LOOKAHEAD = 4


def cpu_cores() -> int:
    """The cores this process may run on (a container's limit, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def default_workers(cfg: Config) -> int:
    """``run.workers`` (never more than there are clients: no exchange asks more at once), else one per
    CPU core, never more than a round samples."""
    if cfg.run.workers:
        return min(cfg.run.workers, cfg.data.num_clients)
    return max(1, min(cpu_cores(), cfg.clients_per_round()))


class ClientPool:
    """Worker processes that answer client exchanges; start once per run, :meth:`close` after.

    Workers are fresh interpreters (:func:`serve_fd`) talking over a socket pair: unlike
    multiprocessing's spawn they do not re-import the caller's ``__main__``, so a user script needs
    no ``if __name__ == "__main__"`` guard, and unlike fork they never inherit torch's OpenMP
    threads. Any failure closes the pool (no reply of an abandoned phase can be read later)."""

    def __init__(self, cfg: Config, workers: int):
        threads = cfg.run.threads or max(1, cpu_cores() // workers)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        config_json = json.dumps(cfg.dump()).encode()
        self._conns: list[Connection] = []
        self._procs: list[subprocess.Popen] = []
        try:
            for _ in range(workers):
                mine, theirs = socket.socketpair()
                # Ctrl-C is the parent's to handle, from the first instruction: a worker ends when
                # the parent closes its socket
                code = ("import signal; signal.signal(signal.SIGINT, signal.SIG_IGN); "
                        f"from fedlt.engine.process_pool import serve_fd; serve_fd({theirs.fileno()}, {threads})")
                proc = subprocess.Popen([sys.executable, "-c", code], pass_fds=[theirs.fileno()],
                                        stdin=subprocess.DEVNULL, env=env)
                theirs.close()
                self._procs.append(proc)
                self._conns.append(Connection(mine.detach()))
                self._conns[-1].send_bytes(config_json)
        except BaseException:
            self.close(wait_s=0)
            raise

    @property
    def open(self) -> bool:
        return bool(self._conns)

    def answer(self, kind: str, rnd: int, jobs: Iterable[Job], cost: Callable[[int], int]
               ) -> Iterator[tuple[Reply, dict[str, Any]]]:
        """Each job's (reply, state), in job order. Jobs are read lazily, at most ``LOOKAHEAD``
        per worker ahead of the replies handed out; of those read, the largest ``cost(cid)`` goes
        first to the next free worker, so one big client does not leave the others idle at the end."""
        if not self.open:
            raise RuntimeError("this ClientPool is closed; start a new one")
        source, exhausted = iter(jobs), False
        waiting: dict[int, Job] = {}  # read, not sent yet
        busy: dict[Connection, int] = {}
        done: dict[int, tuple[Reply, dict[str, Any]]] = {}
        idle, read, handed = list(self._conns), 0, 0
        try:
            while True:
                while not exhausted and read - handed < LOOKAHEAD * len(self._conns):
                    job = next(source, None)
                    if job is None:
                        exhausted = True
                    else:
                        waiting[read] = job
                        read += 1
                while waiting and idle:
                    i = max(waiting, key=lambda j: (cost(waiting[j][0]), -j))
                    conn = idle.pop()
                    self._send(conn, (kind, rnd, *waiting.pop(i)))
                    busy[conn] = i
                while handed in done:
                    yield done.pop(handed)
                    handed += 1
                if exhausted and handed == read:
                    return
                if busy and handed not in done:  # (with nothing busy: read and send more first)
                    for conn in wait(list(busy)):
                        done[busy.pop(conn)] = self._receive(conn)
                        idle.append(conn)
        except BaseException:  # includes the caller abandoning the phase (GeneratorExit)
            self.close(wait_s=0)
            raise

    def _send(self, conn: Connection, job: tuple) -> None:
        try:
            conn.send_bytes(pickle.dumps(job, protocol=pickle.HIGHEST_PROTOCOL))
        except OSError:
            self._died()

    def _receive(self, conn: Connection) -> tuple[Reply, dict[str, Any]]:
        try:
            status, value = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            self._died()
        if status == "error":
            error, text = value
            if isinstance(error, BaseException):
                raise error from RuntimeError(f"in a run.backend=parallel worker process:\n{text}")
            raise RuntimeError(f"a run.backend=parallel worker process failed:\n{text}")
        return value

    def _died(self) -> None:
        raise RuntimeError("a run.backend=parallel worker process died (killed, or out of memory?); "
                           "lower run.workers or use run.backend=sequential") from None

    def close(self, wait_s: float = 5.0) -> None:
        """Close the sockets (idle workers then exit) and stop every worker within ``wait_s``; interrupted
        meanwhile, kill the workers left (a busy one reads its closed socket only after its job)."""
        for conn in self._conns:
            conn.close()
        try:
            for proc in self._procs:
                try:
                    proc.wait(timeout=wait_s)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        except BaseException:
            for proc in self._procs:
                proc.kill()
                proc.wait()
            raise
        finally:
            self._conns, self._procs = [], []


def _serve(conn: Connection, threads: int) -> None:
    """A worker's loop: build the client runtime from the config it is sent first, then answer
    jobs until the socket closes. Any failure goes back as the answer to the job it stopped."""
    try:
        config = json.loads(conn.recv_bytes())
    except (EOFError, OSError):
        return
    runtime, failure = None, None
    try:
        cfg = build_config(config)
        spec, data, device = setup_parts(cfg)
        torch.set_num_threads(threads)
        runtime = ClientRuntime(cfg, spec, data, device)
        if cfg.run.compile:
            keyed_compile_cache()
            runtime.worker.compile()
    except Exception as error:
        failure = error
    while True:
        try:
            job = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            kind, rnd, cid, msg, state = pickle.loads(job)
            if runtime is None:
                raise failure
            exchange = zlib.crc32(kind.encode())
            torch.manual_seed(seed_for(cfg.seed, "worker", rnd, cid, exchange))
            np.random.seed(seed_for(cfg.seed, "worker", rnd, cid, exchange, 1) % 2**32)
            answer = pickle.dumps(("ok", (runtime.handle(kind, cid, rnd, msg, state), state)),
                                  protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as error:
            answer = pickle.dumps(("error", (_picklable(error), traceback.format_exc())))
        try:
            conn.send_bytes(answer)
        except OSError:  # the parent gave up on this phase
            return


def _picklable(error: BaseException) -> BaseException | None:
    """The error itself if it survives pickling; a user error keeps its one-line message."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return FedltError(str(error)) if isinstance(error, FedltError) else None


def serve_fd(fd: int, threads: int) -> None:
    """A worker process's entry point: serve the socket it inherited as file descriptor ``fd``."""
    _serve(Connection(fd), threads)
