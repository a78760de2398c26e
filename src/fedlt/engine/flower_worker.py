"""One long-lived ClientApp process per SuperNode, for ``flower-supernode --isolation process``.

A SuperNode turns every message it receives into one task. In Flower 1.41's default
``subprocess`` isolation its ``flower-superexec`` claims each task and starts a fresh
``flwr-clientapp`` for it (``flwr/supercore/superexec/executor/subprocess_executor.py``), which
handles that single message and exits (``flwr/supernode/runtime/run_clientapp.py``); Flower's only
warm executors are Kubernetes pools for AgentApp, model and connector tasks
(``flwr/supercore/superexec/executor/warm_executor_pool.py``). So every message paid the imports
of torch, flwr and fedlt, the app's loading and its seeded data, several seconds on a small
machine, for a fraction of a second of training. With ``--isolation process`` the SuperNode
leaves claiming its tasks to a process started beside it. This module is that process: it claims
the SuperNode's ClientApp tasks over its Runtime API and runs each one itself with Flower's own
task steps (pull the message and context, call the ClientApp, push the reply, push the context),
so imports, the app and what the app caches are paid once per SuperNode, not once per message.

``python -m fedlt.engine.flower_worker --runtime-api-address HOST:PORT`` (the SuperNode's
``--host``/``--port``); ``fedlt.deploy`` starts one beside each SuperNode. It speaks plain HTTP
to the Runtime API, as Flower's own superexec does for a SuperNode started without Runtime API
certificates (``--ssl-certfile``), and exits once the Runtime API has refused connections for
``--patience`` seconds (its SuperNode is gone).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import httpx
from flwr.app import Context, Message
from flwr.app.error import Error
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import ClientApp, LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest, SendTaskHeartbeatRequest  # pylint: disable=E0611
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.interceptors import RuntimeTokenHttpInterceptor, RuntimeVersionHttpInterceptor
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

import fedlt.engine.flower_app  # noqa: F401  imported (torch included) at start, not at the first message

#: the ClientApp of each FAB this process has served, by FAB hash: installed and imported once
_apps: dict[str, ClientApp] = {}


class _RuntimeClient(RuntimeHttpClient):
    """The SuperNode's Runtime API, except that an object the SuperNode is still fetching is asked
    for again every 20 ms (for up to 2 s, then Flower's back-off applies) rather than after Flower's
    1 s back-off (``PULL_INITIAL_BACKOFF``): a task
    can be claimed before its message's objects have arrived (the SuperNode creates the task, then
    pulls the objects: ``flwr/supernode/start_client_internal.py``), and a claim 0.2 s after the
    task appeared mostly finds them still on their way."""

    def PullObject(self, request):  # noqa: N802 (Flower's name)
        deadline = time.monotonic() + 2.0
        while True:
            got = super().PullObject(request)
            if got.object_available or not got.object_found or time.monotonic() > deadline:
                return got
            time.sleep(0.02)


def _client(address: str, *interceptors) -> RuntimeHttpClient:
    return _RuntimeClient.from_server_address(server_address=address, insecure=True, root_certificates=None,
                                              interceptors=list(interceptors))


def _app(fab_id: str, fab_version: str, fab_hash: str, content: bytes) -> ClientApp:
    if fab_hash not in _apps:
        install_from_fab(content, skip_prompt=True)
        _apps[fab_hash] = get_load_client_app_fn("", None, multi_app=True)(fab_id, fab_version, fab_hash)
    return _apps[fab_hash]


def _heartbeat(client: RuntimeHttpClient):
    """Keep the claimed task alive while the app works (a task without heartbeats expires)."""

    def beat() -> bool:
        try:
            return client.SendTaskHeartbeat(SendTaskHeartbeatRequest()).success
        except httpx.HTTPError:
            return False

    return HeartbeatSender(beat)


def run_task(address: str, token: str) -> None:
    """Serve one claimed task as ``flwr-clientapp --token`` would, without its process: an
    exception in the app becomes the error reply Flower sends for it, and this process goes on."""
    client = _client(address, RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                     RuntimeTokenHttpInterceptor(token))
    heartbeat = _heartbeat(client)
    heartbeat.start()
    message: Message | None = None
    context: Context | None = None
    try:
        try:
            message, context, run, fab = pull_task_input(client)
            reply = _app(run.fab_id, run.fab_version, fab.hash_str, fab.content)(message=message, context=context)
            status, details = SubStatus.COMPLETED, ""
        except Exception as err:  # the app's (or loading's) failure goes back as the reply, as Flower does
            code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION if isinstance(err, LoadClientAppError) \
                else ErrorCode.CLIENT_APP_RAISED_EXCEPTION
            status, details = SubStatus.FAILED, f"{type(err)}:<'{err}'>"
            traceback.print_exc()
            reply = Message(Error(code=code, reason=details), reply_to=message) if message else None
        if reply is not None and context is not None:
            push_message(client, reply, context)
        heartbeat.stop()  # before the task ends: a heartbeat for a finished task is refused
        push_task_output(client=client, context=context, sub_status=status, details=details)
    finally:
        if heartbeat.is_running:
            heartbeat.stop()
        client.close()


def serve(address: str, poll_s: float = 0.2, patience_s: float = 10.0, startup_s: float = 120.0) -> int:
    """Claim and run the SuperNode's ClientApp tasks one after another, asking every ``poll_s``;
    return 1 once the Runtime API has refused connections for ``patience_s`` (``startup_s``
    before it first answered: the SuperNode may still be starting)."""
    acquire = _client(address, RuntimeVersionHttpInterceptor(component_name="SuperExec"))
    request = AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP])
    deadline, served = time.monotonic() + startup_s, 0
    try:
        while True:
            try:
                got = acquire.AcquireTask(request)
                deadline = time.monotonic() + patience_s
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    print(f"fedlt worker: the SuperNode's Runtime API at {address} is gone", file=sys.stderr)
                    return 1
                got = None
            if got is not None and got.HasField("task") and got.token:
                start = time.monotonic()
                try:
                    run_task(address, got.token)
                except httpx.HTTPError as err:  # the task is lost (the SuperNode lets it expire), not this process
                    print(f"fedlt worker: a task failed to reach the SuperNode: {err}", file=sys.stderr, flush=True)
                    continue
                served += 1
                print(f"fedlt worker {os.getpid()}: task {served} served in {time.monotonic() - start:.2f} s",
                      flush=True)
            else:
                time.sleep(poll_s)
    finally:
        acquire.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fedlt.engine.flower_worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--runtime-api-address", required=True, help="the SuperNode's Runtime API, HOST:PORT")
    parser.add_argument("--poll", type=float, default=0.2, help="seconds between asking for a task")
    parser.add_argument("--patience", type=float, default=10.0, help="seconds of refused connections before exiting")
    parser.add_argument("--startup", type=float, default=120.0, help="the same before the Runtime API first answered")
    a = parser.parse_args(argv)
    return serve(a.runtime_api_address, a.poll, a.patience, a.startup)


if __name__ == "__main__":
    sys.exit(main())
