"""Where a number was measured: the software and machine behind a run or a benchmark.

Floats depend on them: the same seed gives identical metrics only with the same fedlt, torch
version, CPU capability and thread count (README, "Reproducibility"), so every summary.json and
bench-log record carries :func:`collect`'s dict under ``environment``. The code is named twice: the
git commit of a source checkout, and a hash of the package's source files, which also names an
installed wheel (no git) and tells two different uncommitted states apart.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch

from fedlt._version import __version__


def keyed_compile_cache() -> None:
    """Point torch.compile's on-disk cache at a folder of this CPU capability's, unless the user chose one
    (``TORCHINDUCTOR_CACHE_DIR``): its key ignores the vector width, and a graph cached under AVX512 and
    run under AVX2 (a machine whose CPU changed, a /tmp shared by other machines) indexes out of bounds."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    capability = torch.backends.cpu.get_cpu_capability().lower()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(default_cache_dir(), f"cpu-{capability}")


def collect(device: torch.device | str | None = None, backend: str | None = None,
            outside_code: dict[str, str] | None = None) -> dict[str, Any]:
    """The environment of the calling process now (call it during or right after the run:
    ``threads`` is torch's current setting); ``backend`` is how the run trained its clients;
    ``outside_code`` names the run's method, calibrations and model whose code is not fedlt's (a plug-in and
    its version, or one registered in code), which fedlt's source hash does not cover."""
    device = torch.device(device) if device is not None else None
    return {
        **({"outside_code": dict(outside_code)} if outside_code else {}),
        "fedlt": __version__,
        "git_commit": git_commit(),
        "source_hash": source_hash(),
        "torch": str(torch.__version__),  # a str, not its subclass TorchVersion: plain data for a checkpoint
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


@functools.cache
def source_hash() -> str:
    """:func:`hash_sources` of the imported fedlt package, once per process (its modules are loaded)."""
    return hash_sources(Path(__file__).resolve().parent)


def hash_sources(package: Path) -> str:
    """First 16 hex digits of the SHA-256 over every ``*.py`` and ``*.yaml`` (the bundled suites) under
    ``package``, in sorted relative-path order, each as its relative path, its size and its bytes: two
    trees hash alike only if they hold the same files with the same contents."""
    digest = hashlib.sha256()
    files = (p for pattern in ("*.py", "*.yaml") for p in package.rglob(pattern))
    for name, path in sorted((p.relative_to(package).as_posix(), p) for p in files):
        data = path.read_bytes()
        digest.update(f"{name}\0{len(data)}\0".encode())
        digest.update(data)
    return digest.hexdigest()[:16]


def code_version(env: dict[str, Any]) -> str | None:
    """The code behind a record, as reports name it: its source hash, else (a record from before fedlt
    hashed its sources) its git commit; None when neither was recorded. A method or calibration from
    outside fedlt follows, e.g. ``3fc74e33027df234 + clipavg: plug-in fedlt-example-plugin 0.1.0``."""
    version = env.get("source_hash") or env.get("git_commit")
    outside = env.get("outside_code") or {}
    return version and version + "".join(f" + {name}: {origin}" for name, origin in sorted(outside.items()))


def same_code(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two records provably ran the same fedlt source (equal source hashes where both have one,
    else the same clean commit; a ``+dirty`` commit without a hash is unknown code, the same as nothing)
    and the same code from outside fedlt, as far as its names and versions tell."""
    if (a.get("outside_code") or {}) != (b.get("outside_code") or {}):
        return False
    if a.get("source_hash") and b.get("source_hash"):
        return a["source_hash"] == b["source_hash"]
    commit = a.get("git_commit")
    return bool(commit) and not commit.endswith("+dirty") and commit == b.get("git_commit")
