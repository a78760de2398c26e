"""Where a number was measured: the software and machine behind a run or a benchmark.

Floats depend on them: the same seed gives identical metrics only with the same fedlt, torch
version, CPU capability and thread count (README, "Reproducibility"), so every summary.json and
bench-log record carries :func:`collect`'s dict under ``environment``.
"""

from __future__ import annotations

import functools
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from fedlt._version import __version__


def collect(device: torch.device | str | None = None, backend: str | None = None) -> dict[str, Any]:
    """The environment of the calling process now (call it during or right after the run:
    ``threads`` is torch's current setting); ``backend`` is how the run trained its clients."""
    device = torch.device(device) if device is not None else None
    return {
        "fedlt": __version__,
        "git_commit": git_commit(),
        "torch": torch.__version__,
        "cpu": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "gpu": torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None,
        "threads": torch.get_num_threads(),
        "backend": backend,
        "os": platform.platform(),
        "python": platform.python_version(),
    }


def describe(env: dict[str, Any]) -> str:
    """One line for a report, e.g. ``AMD EPYC (AVX2), 2 threads, torch 2.13.0+cpu, fedlt 0.1.0 (4c1c078)``;
    keys an older record lacks are left out."""
    machine = ", ".join(str(p) for p in (env.get("gpu"), env.get("cpu")) if p)
    if env.get("cpu_capability"):
        machine += f" ({env['cpu_capability']})"
    threads = env.get("threads")
    parts = [machine, f"{threads} thread{'s' * (threads != 1)}" if threads is not None else "",
             f"torch {env['torch']}" if env.get("torch") else "",
             f"fedlt {env['fedlt']}" + (f" ({env['git_commit']})" if env.get("git_commit") else "") if env.get("fedlt") else ""]
    return ", ".join(p for p in parts if p)


@functools.cache
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


@functools.cache
def git_commit() -> str | None:
    """Short hash of the checkout fedlt is imported from, ``+dirty`` with uncommitted changes to
    tracked files; None for an installed package, without git, or when git fails or hangs."""
    here = Path(__file__).resolve().parent
    if not any((p / ".git").exists() for p in (here, *here.parents)):
        return None  # no work tree: no git process started

    def git(*args: str) -> str:
        # --no-optional-locks: reading must never write the index of a checkout someone is using
        return subprocess.run(["git", "--no-optional-locks", "-C", str(here), *args], capture_output=True,
                              text=True, timeout=5, check=True).stdout.strip()

    try:
        if not git("ls-files", "__init__.py"):  # installed into a folder inside some other work tree
            return None
        commit = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return commit + ("+dirty" if dirty else "")
