"""A suite's cells in worker processes, stopped together. An interrupt of the bench (Ctrl-C, or
SIGTERM sent to it alone) cancels the cells not started, interrupts the running ones as Ctrl-C
interrupts a run (each keeps what its folder needs to resume), and leaves no worker behind: a
process pool left to itself would go on starting the queued cells, or outlive the bench."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor, as_completed, wait
from concurrent.futures.process import BrokenProcessPool
from contextlib import contextmanager
from multiprocessing import get_context
from typing import Any

from fedlt.environment import collect as collect_environment
from fedlt.errors import terminate_as_interrupt

#: seconds the running cells get to stop after an interrupt before their workers are killed
STOP_GRACE_S = 60.0
_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM}
#: the signal by which the bench asks its workers to stop their cells (SIGINT may be ignored by the bench)
STOP_REQUEST = signal.SIGUSR1

_stop: Any = None  # in a worker: the pool's stop event
_in_cell = False  # in a worker: a cell is running and a SIGINT interrupts it


@contextmanager
def _workers_born_deaf() -> Iterator[None]:
    """Workers spawned inside start with SIGINT, SIGTERM and the stop request blocked (a signal mask a new
    process inherits), until :func:`_start_worker` installs their handlers: Ctrl-C while they import torch
    would end each in a traceback, and a stop request would kill it. This process notes an interrupt meanwhile
    and raises it once the spawns are done: ignored, as it was, a Ctrl-C was lost and the bench ran the whole
    suite; raised amid a spawn, it would leave a worker without its start (a traceback)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {*_STOP_SIGNALS, STOP_REQUEST})
    handlers = {signum: signal.getsignal(signum) for signum in _STOP_SIGNALS}
    for signum, handler in handlers.items():
        if callable(handler):  # not ignored, nor the default action (SIGTERM outside the command line)
            signal.signal(signum, lambda signum, _frame: noted.append(signum))
    try:
        yield
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    if noted:  # what its handler does, now that no spawn is cut short
        handlers[noted[0]](noted[0], None)


def _start_worker(stop, sigint_ignored: bool) -> None:
    """SIGUSR1 is the bench's own request to stop; SIGINT (Ctrl-C to the process group) too, unless
    the bench ignores it (started as ``cmd &`` by a non-interactive shell, or after ``trap '' INT``), as the
    bench then goes on."""
    global _stop
    _stop = stop
    signal.signal(STOP_REQUEST, _interrupt_cell)
    if not sigint_ignored:
        signal.signal(signal.SIGINT, _interrupt_cell)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {*_STOP_SIGNALS, STOP_REQUEST})  # blocked since its spawn


def _interrupt_cell(signum: int, _frame) -> None:
    """A worker's SIGINT interrupts its cell, once (a second would cut short what the first makes the
    run save); an idle worker ignores it, and the cell it would take next is cancelled."""
    global _in_cell
    if _in_cell:
        _in_cell = False
        raise KeyboardInterrupt


def _cell(fn: Callable[..., dict[str, Any]], *args: Any) -> dict[str, Any]:
    global _in_cell
    _in_cell = True
    try:
        if _stop.is_set():  # queued before the interrupt; read after _in_cell is set, so no SIGINT is lost
            return {"status": "cancelled"}
        return fn(*args)
    except KeyboardInterrupt:
        return {"status": "interrupted"}
    finally:
        _in_cell = False


def _outcome(future: Future) -> dict[str, Any]:
    try:
        info = future.result()
    except BrokenProcessPool as err:  # a worker died (killed, out of memory)
        info = {"status": "failed", "error": f"worker process died: {err}"}
    if info["status"] in ("interrupted", "cancelled"):  # a worker signalled alone: the cell resumes next time
        info = {"status": "failed", "error": "KeyboardInterrupt: its worker was interrupted; run the bench again "
                                             "to resume the cell"}
    if info["status"] == "failed" and "environment" not in info:
        info.update(wall_s=0.0, cpu_s=0.0, environment=collect_environment())
    return info


def run_in_workers(jobs: list[tuple[Any, tuple]], workers: int, fn: Callable[..., dict[str, Any]],
                   done: Callable[[Any, dict[str, Any]], None]) -> None:
    """``fn(*args)`` of every ``(key, args)`` job in ``workers`` spawned processes; ``done(key, info)``
    as each ends (``fn`` returns its info and never raises). On an interrupt the cells that ended
    before the workers stopped are still passed to ``done``, then the interrupt is raised again."""
    context = get_context("spawn")
    stop = context.Event()
    main = threading.current_thread() is threading.main_thread()
    ignored = main and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    pool = ProcessPoolExecutor(max_workers=workers, mp_context=context, initializer=_start_worker,
                               initargs=(stop, ignored))
    futures: dict[Future, Any] = {}
    reported: set[Future] = set()
    manager = None
    try:  # from the first worker's spawn: an interrupt then stops the workers spawned so far
        with _workers_born_deaf():
            for key, args in jobs:
                futures[pool.submit(_cell, fn, *args)] = key
        with terminate_as_interrupt():
            for future in as_completed(futures):
                reported.add(future)
                done(futures[future], _outcome(future))
    except BaseException:
        signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS)  # a second Ctrl-C must not cut the stopping short
        stop.set()
        for future in futures:  # here, not by the pool's thread: a future cancelled there never wakes wait()
            future.cancel()
        processes = list((pool._processes or {}).values())  # the pool keeps its workers there (CPython 3.9+)
        manager = pool._executor_manager_thread  # a shutdown without waiting forgets it, and it reaps the workers
        pool.shutdown(wait=False, cancel_futures=True)
        for process in processes:
            if process.is_alive() and process.pid is not None:
                os.kill(process.pid, STOP_REQUEST)  # as Ctrl-C in a terminal would; a second one is ignored
        wait([f for f in futures if not f.done()], timeout=STOP_GRACE_S)
        for process in processes:
            if process.is_alive():
                process.kill()
        for future in futures:  # what ended before the workers stopped; not the cells they interrupted
            if future.done() and not future.cancelled() and future not in reported and future.exception() is None \
                    and future.result()["status"] in ("ok", "failed"):
                done(futures[future], _outcome(future))
        raise
    finally:
        pool.shutdown(wait=True)
        if manager is not None:  # left running, it reaped a worker while the caller waited for it (no exit code)
            manager.join()
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
