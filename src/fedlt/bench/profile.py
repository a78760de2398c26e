"""``fedlt bench profile``: where a local training step's time goes, per backend, model and number
of sampled clients.

One round of training runs under ``torch.profiler``; the training loops mark their parts
(:mod:`fedlt.training.scopes`: the batch with its augmentation, forward and loss, backward, the
optimizer), so a step's host time splits into them. On a GPU the device columns add the kernel
time, how busy the device was, the kernels launched and the runtime's waits and copies per step.
Host synchronisations are counted by :class:`~fedlt.bench.host_syncs.HostSyncs` in a round of
their own (the counting slows Python down, so it never overlaps a timed round).
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Callable

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from fedlt.api import prepare
from fedlt.bench.host_syncs import HostSyncs
from fedlt.bench.speed import measured_setting, sync_device
from fedlt.config import load_config
from fedlt.environment import collect, describe
from fedlt.results import counted
from fedlt.training.scopes import BACKWARD, BATCH, FORWARD, GRADIENT, OPTIMIZER
from fedlt.training.sequential import steps_per_epoch

PARTS = {BATCH: "batch", FORWARD: "forward+loss", BACKWARD: "backward", GRADIENT: "forward+backward",
         OPTIMIZER: "optimizer"}
PROFILER_LINES = ("USDT:", "STAGE:")
DEVICE_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def client_steps(sim, rnd: int) -> int:
    """Optimizer steps the sampled clients of round ``rnd`` take together (one per batch)."""
    fl = sim.cfg.fl
    sizes = (len(sim.train_data.partition.client_indices[c]) for c in sim.schedule[rnd - 1])
    return sum(fl.local_epochs * steps_per_epoch(n, fl.batch_size) for n in sizes)


@contextmanager
def _without_profiler_lines() -> Iterator[None]:
    """The profiler's C++ side prints ``USDT:``/``STAGE:`` lines straight to stderr at its start and stop
    (no setting silences them); they would land between the bench's own lines. Whatever else reached
    stderr meanwhile is passed on."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as caught:
        os.dup2(caught.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            kept = [line for line in caught.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(PROFILER_LINES)]
            sys.stderr.write("".join(kept))


def profile_round(sim, rnd: int) -> dict[str, float]:
    """Per client step of round ``rnd``: wall ms, each part's host ms, and on a GPU the kernel ms,
    kernels, device waits and host-device copies."""
    cuda = sim.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with _without_profiler_lines(), profile(activities=activities) as prof:
        t0 = time.perf_counter()
        sim.fit_round(rnd)
        sync_device(sim.device)
        wall = time.perf_counter() - t0
    steps = client_steps(sim, rnd)
    row = {"profiled_ms": 1e3 * wall / steps}
    events = prof.key_averages()
    for event in events:
        # a marked range also shows as a GPU-side annotation of the same name (no host time): only
        # the host-side entry counts, whichever comes first
        if event.key in PARTS and event.device_type == DeviceType.CPU:
            row[PARTS[event.key]] = row.get(PARTS[event.key], 0.0) + event.cpu_time_total / 1e3 / steps
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
        row["kernel_ms"] = sum(e.device_time_total for e in kernels) / 1e3 / steps
        row["kernels"] = len(kernels) / steps
        row["device_waits"] = sum(e.count for e in events if e.key in DEVICE_WAITS) / steps
        row["copies"] = sum(e.count for e in events if e.key.startswith("cudaMemcpy")) / steps
    return row


def profile_backend(config: str | None, overrides: list[str]) -> dict[str, float]:
    """Warm-up round, a round counting host synchronisations, a timed round, a profiled round."""
    sim = prepare(load_config(config, [*overrides, "fl.rounds=4"]))
    try:
        sim.setup()
        sim.fit_round(1)
        with HostSyncs() as syncs:
            sim.fit_round(2)
        sync_device(sim.device)
        t0 = time.perf_counter()
        sim.fit_round(3)
        sync_device(sim.device)
        row = {"wall_ms": 1e3 * (time.perf_counter() - t0) / client_steps(sim, 3),
               "host_syncs": syncs.total / client_steps(sim, 2), **profile_round(sim, 4)}
        row["sync_sites"] = ", ".join(f"{site} {name}" for (name, site), _ in syncs.calls.most_common(3))
    finally:
        sim.close()
    return row


def run_profile_bench(config: str | None, overrides: list[str], models: tuple[str, ...] = ("cnn", "resnet8"),
                      sampled_counts: tuple[int, ...] = (10,), backends: tuple[str, ...] = ("sequential", "vectorized"),
                      synthetic_size: int = 16, echo: Callable[[str], None] = lambda line: None) -> str:
    """The breakdown table for every model x sampled count x backend; ``echo`` gets each row."""
    base = load_config(config, overrides)
    device = prepare(base).device
    cuda = device.type == "cuda"
    columns = ["model", "sampled clients", "backend", "ms / client step", "host syncs / step",
               *(f"{p} ms" for p in ("batch", "forward+loss", "backward", "forward+backward", "optimizer"))]
    if cuda:
        columns += ["kernel ms", "GPU busy %", "kernels / step", "device waits / step", "copies / step"]
    lines = [
        f"## Where a local training step goes: {base.method}, batch {base.fl.batch_size}, "
        f"{counted(base.fl.local_epochs, 'local epoch')}", "",
        f"device {device}: {describe(collect(device))}. Per optimizer step of one client (a round's time over "
        "the sampled clients' steps). The parts are host time inside the training loop's marked ranges, "
        "measured in a profiled round (the profiler's own cost included); ms / client step is an unprofiled "
        "round; host syncs are counted in a third round. Empty: the backend has no such part.", "",
        "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns),
    ]
    sites = []
    for model in models:
        for sampled in sampled_counts:
            for backend in backends:
                setting = [*measured_setting(base, overrides, model, sampled, synthetic_size, 4),
                           f"run.backend={backend}"]
                r = profile_backend(config, setting)
                cells = [model, str(sampled), backend, f"{r['wall_ms']:.2f}", f"{r['host_syncs']:.2f}",
                         *(f"{r[p]:.2f}" if p in r else "" for p in
                           ("batch", "forward+loss", "backward", "forward+backward", "optimizer"))]
                if cuda:
                    cells += [f"{r['kernel_ms']:.2f}", f"{100 * r['kernel_ms'] / r['profiled_ms']:.0f}",
                              f"{r['kernels']:.0f}", f"{r['device_waits']:.2f}", f"{r['copies']:.2f}"]
                lines.append("| " + " | ".join(cells) + " |")
                echo(lines[-1])
                if r["sync_sites"]:
                    sites.append(f"- {model}, {sampled} clients, {backend}: {r['sync_sites']}")
    if sites:
        lines += ["", "Where the host synchronisations are (most frequent first):", *sites]
    return "\n".join(lines)
