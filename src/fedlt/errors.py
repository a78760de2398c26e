"""User-facing errors, and SIGTERM as one.

A :class:`FedltError` is bad input (a config value, a missing or corrupt data file, an
impossible partition). The CLI prints its message as one line and exits with code 2; it is
never a bug in fedlt, so no traceback is shown. Messages name the problem *and* the fix.
"""

import re
import signal
import threading
from contextlib import contextmanager
from typing import Iterator


def one_line(text: str) -> str:
    """An error as the one line a user (or a script reading stderr) expects: a line break in a name it
    quotes (a file name may hold one) is shown as its escape."""
    return text.replace("\r", "\\r").replace("\n", "\\n")


class FedltError(Exception):
    """Bad input from the user: printed as one line by the CLI, exit code 2."""


class ConfigError(FedltError):
    """An invalid configuration value or key."""


class DataError(FedltError):
    """A missing, unreadable or corrupt dataset file, or an impossible data split."""


class PluginError(FedltError):
    """A method's or calibration's hook broke the engine's contract (a wrong return type, state a
    checkpoint cannot keep ...): the message names the hook and the fix, which a traceback through
    the engine would not."""


class TrainingDiverged(FedltError):
    """The clients' training loss became NaN or infinite: the optimiser settings do not suit the run."""


class OutOfMemory(FedltError):
    """A step asked for more memory than the machine (or the GPU) has: the settings that size the work
    are too large for it; the message says which settings and how the run goes on."""


#: what sizes the memory a step holds at once, named where a run ran out of it
MEMORY_KNOBS = ("fl.batch_size, eval.batch_size, run.workers / run.streams, a calibration's *_per_class or "
                "safs_rff_dim, the model")


def out_of_memory(err: BaseException) -> str | None:
    """What ran out, when ``err`` is memory exhaustion (Python's MemoryError, torch's CPU allocator, CUDA),
    else None: ``"the CPU allocator was asked for 102.4 TB"``."""
    if isinstance(err, MemoryError):
        return "Python could not allocate memory"
    text = str(err)
    if (isinstance(err, OverflowError) and "too big to convert" in text) or any(
            sign in text for sign in ("Storage size calculation overflowed", "Overflow when unpacking long")):
        return "a tensor larger than any memory was asked for (its size does not fit in 64 bits)"
    if not isinstance(err, RuntimeError):
        return None
    if "can't allocate memory" in text:
        asked = re.search(r"allocate (\d+) bytes", text)
        return "the CPU allocator was asked for " + (size_text(int(asked.group(1))) if asked else "more than it has")
    if "out of memory" in text:  # CUDA: "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has ..."
        asked = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]?i?B)", text)
        return "the GPU ran out of memory" + (f" (asked for {asked.group(1)})" if asked else "")
    return None


def size_text(n: int) -> str:
    """A byte count as people read it: ``"56.9 TB"``."""
    if n >= 1e18:  # past any machine: a count of petabytes would read as a typo
        return f"{n:.2g} bytes"
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


class Terminated(KeyboardInterrupt):
    """A command got SIGTERM: it unwinds as after Ctrl-C (worker processes stopped, a progress bar
    closed, a run's files left resumable on the way) and exits with 143 instead of 130."""


def _raise_terminated(signum: int, _frame) -> None:
    raise Terminated()


@contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in this process while inside; its default action would end the
    process at once, leaving worker processes running and a terminal's cursor hidden."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def interrupt_kept() -> Iterator[None]:
    """A Ctrl-C (or SIGTERM) that lands inside a library stays the interrupt: torch's file writer, cut
    short mid-record, fails while closing the file (``RuntimeError: unexpected pos``), and that error
    replaced the interrupt, so a run stopped while saving its checkpoint failed instead of stopping
    resumable."""
    try:
        yield
    except Exception as err:
        cause = err.__context__
        while cause is not None and not isinstance(cause, KeyboardInterrupt):
            cause = cause.__context__
        if cause is None:
            raise
        raise cause from None
