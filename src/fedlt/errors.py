"""User-facing errors.

A :class:`FedltError` is bad input (a config value, a missing or corrupt data file, an
impossible partition). The CLI prints its message as one line and exits with code 2; it is
never a bug in fedlt, so no traceback is shown. Messages name the problem *and* the fix.
"""


class FedltError(Exception):
    """Bad input from the user: printed as one line by the CLI, exit code 2."""


class ConfigError(FedltError):
    """An invalid configuration value or key."""


class DataError(FedltError):
    """A missing, unreadable or corrupt dataset file, or an impossible data split."""


class TrainingDiverged(FedltError):
    """The clients' training loss became NaN or infinite: the optimiser settings do not suit the run."""


class Terminated(KeyboardInterrupt):
    """A command that stops worker processes got SIGTERM: it unwinds as after Ctrl-C, stopping them on
    the way, and exits with 143 instead of 130."""
