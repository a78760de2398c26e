"""Flower 1.41's fixed waits, shortened where a fedlt deployment runs them.

Three waits in Flower's code put seconds into every exchange of a round, whatever its training costs:

- an idle SuperNode sleeps 3 s before it asks the SuperLink for messages again
  (``flwr/supernode/start_client_internal.py``). It asks right after it sent its reply, before the
  server has read that phase's replies and sent the next message, so nearly every exchange waits
  the 3 s out; the same loop checks every 0.5 s whether its ClientApp's reply is ready;
- an object asked for before its sender finished uploading it is asked for again after 1 s, then
  2 s, ... (``PULL_INITIAL_BACKOFF`` in ``flwr/supercore/inflatable/inflatable_utils.py``), on the
  SuperNode fetching the server's message and on the ServerApp fetching the replies alike.

A fedlt round is several exchanges (fit, then each stage of a secure evaluation), so a round of a
second's training took 20 s on a loopback deployment. :func:`cap_supernode_waits` caps the SuperNode's
sleeps (``fedlt.engine.flower_supernode`` runs Flower's SuperNode with it) and :func:`quick_object_pulls`
starts the pulls' back-off at 50 ms. Only the waiting changes: messages, replies and their order are
Flower's. Nothing here imports torch (a SuperNode process stays light).
"""

from __future__ import annotations

import functools
import time
from types import ModuleType

#: seconds between an idle SuperNode's requests for messages, and between its checks for a reply
SUPERNODE_POLL_S = 0.2
#: the first pause before an object that is not uploaded yet is asked for again (Flower's: 1 s)
PULL_BACKOFF_S = 0.05


class CappedSleep:
    """``time`` for Flower's SuperNode loop: every sleep capped at ``cap_s`` seconds, all else as ``time``."""

    def __init__(self, cap_s: float, clock: ModuleType = time):
        self.cap_s, self._clock = cap_s, clock

    def sleep(self, seconds: float) -> None:
        self._clock.sleep(min(seconds, self.cap_s))

    def __getattr__(self, name: str):
        return getattr(self._clock, name)


def cap_supernode_waits(cap_s: float = SUPERNODE_POLL_S) -> None:
    """Cap the sleeps of Flower's SuperNode loop (in this process) at ``cap_s`` seconds, and start its
    object pulls' back-off at :data:`PULL_BACKOFF_S`."""
    from flwr.supernode import start_client_internal as loop

    clock = getattr(loop, "time", None)
    if clock is not time and not isinstance(clock, CappedSleep):
        raise RuntimeError("this flwr's SuperNode loop does not wait with the time module; start flower-supernode "
                           "itself instead (its fixed 3 s idle wait applies)")
    loop.time = CappedSleep(cap_s)
    quick_object_pulls(loop)


def quick_object_pulls(module: ModuleType) -> None:
    """Make ``module``'s ``pull_objects`` (Flower's, imported by name) start its back-off at
    :data:`PULL_BACKOFF_S`; its cap, its tries and its time limit stay Flower's."""
    pull = module.pull_objects
    if not isinstance(pull, functools.partial):  # once
        module.pull_objects = functools.partial(pull, initial_backoff=PULL_BACKOFF_S)
