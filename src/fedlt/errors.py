"""User-facing errors, and SIGTERM as one.

A :class:`FedltError` is bad input (a config value, a missing or corrupt data file, an
impossible partition). The CLI prints its message as one line and exits with code 2; it is
never a bug in fedlt, so no traceback is shown. Messages name the problem *and* the fix.
"""

import signal
import threading
from contextlib import contextmanager
from typing import Iterator


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
