"""A Flower Grid inside the test process, shared by the tests that run the Flower engine at message
level without Ray or sockets (test_flower.py, test_compatibility.py), and the live processes of a real
loopback deployment (test_flower.py, test_plugins.py)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# before flwr is first imported: no telemetry, no dependency installation from a test
os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION", "1")


class LoopbackGrid:
    """A Flower Grid in this process: each node is a Context handed to the real ClientApp
    handler; nodes in ``dead`` stay registered but never answer (as after a crash, until the
    SuperLink's heartbeat gives up); from fit ``late_after_fits`` on, the last node answers (its clients'
    state kept) after the server stopped waiting, so none of its replies arrives."""

    def __init__(self, nodes: int, die_after_fits: int | None = None, leave_after_fits: int | None = None,
                 fail_after_fits: int | None = None, lost_after_fits: int | None = None,
                 late_after_fits: int | None = None):
        from flwr.app import Context, RecordDict

        self.contexts = {100 + i: Context(run_id=1, node_id=100 + i, state=RecordDict(), run_config={},
                                          node_config={"partition-id": i, "num-partitions": nodes})
                         for i in range(nodes)}
        self.dead: set[int] = set()
        self.fits, self.die_after_fits = 0, die_after_fits
        self.leave_after_fits, self.fail_after_fits = leave_after_fits, fail_after_fits
        self.lost_after_fits = lost_after_fits  # from then on Flower answers for the last node: unavailable
        self.late_after_fits = late_after_fits
        self.left: set[int] = set()
        self.batches: list[tuple[str, list[int]]] = []  # (message type, nodes) of every send
        self.timeouts: list[float] = []
        self.replies: dict[str, object] = {}  # message id -> its reply, until pulled
        self.pulls = 0

    def get_node_ids(self):
        return [n for n in self.contexts if n not in self.left]

    def push_messages(self, messages):
        from flwr.app import Error, Message
        from flwr.common.constant import ErrorCode

        from fedlt.engine.flower_app import handle

        messages = list(messages)
        if messages and messages[0].metadata.message_type == "train":
            self.fits += 1
            if self.fits == self.die_after_fits:
                self.dead.add(max(self.contexts))
            if self.fits == self.leave_after_fits:  # de-registered after this phase (heartbeat expired)
                self.left.add(max(self.contexts))
        if messages:
            self.batches.append((messages[0].metadata.message_type, [m.metadata.dst_node_id for m in messages]))
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id  # as Flower's grid does when it pushes
            node = m.metadata.dst_node_id
            if node in self.dead:
                continue
            if self.fits == self.fail_after_fits and node == max(self.contexts):
                reply = Message(error=Error(ErrorCode.CLIENT_APP_RAISED_EXCEPTION, "ValueError: boom"), reply_to=m)
            elif self.lost_after_fits and self.fits >= self.lost_after_fits and node == max(self.contexts):
                reply = Message(error=Error(ErrorCode.NODE_UNAVAILABLE, "Error: Node Unavailable"), reply_to=m)
            else:
                reply = handle(m, self.contexts[node])
                if self.late_after_fits and self.fits >= self.late_after_fits and node == max(self.contexts):
                    continue  # too late: never pulled
            self.replies[m.metadata.message_id] = reply
        return [m.metadata.message_id for m in messages]

    def pull_messages(self, message_ids):
        self.pulls += 1
        return [self.replies.pop(i) for i in list(message_ids) if i in self.replies]

    def send_and_receive(self, messages, *, timeout):
        """As Flower's grids: a dead node's silence lasts ``timeout`` (here: no time at all)."""
        self.timeouts.append(timeout)
        return self.pull_messages(self.push_messages(messages))


@contextmanager
def server_identity() -> Iterator[None]:
    """What Flower sets in a ServerApp process before messages can be created, for the block's
    duration (test_flower.py's ``server_identity`` fixture does the same with monkeypatch)."""
    from flwr.supercore.task_identity import TaskIdentity

    attrs = ("_run_id", "_task_id", "_node_id")
    saved = {attr: TaskIdentity.__dict__[attr] for attr in attrs if attr in TaskIdentity.__dict__}
    for attr in attrs:
        setattr(TaskIdentity, attr, 1)
    try:
        yield
    finally:
        for attr in attrs:
            if attr in saved:
                setattr(TaskIdentity, attr, saved[attr])
            else:
                delattr(TaskIdentity, attr)


def deployment_pids(workdir: Path) -> list[int]:
    """Every live process of the deployment in ``workdir``: all inherit its FLWR_HOME."""
    from fedlt.deploy import _inheritors

    return _inheritors(f"FLWR_HOME={workdir / 'flwr-home'}".encode())


def stop_deployment(proc, workdir: Path) -> None:
    """A test's teardown of ``fedlt.deploy`` run as ``proc``, where the test failed before it ended:
    asked to stop (SIGTERM, which stops its federation), killed only if it does not, then whatever of
    the deployment is left killed. SIGKILL at once left the SuperLink and SuperNodes (in sessions of
    their own) to disturb the tests after a failed one. A deploy that ended is left alone: what it
    left running is the test's to assert."""
    import signal
    import subprocess

    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    for pid in deployment_pids(workdir):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
