"""Where a number was measured: every summary.json and bench-log record carries the environment, and
the code that ran it (git commit and a hash of the package's source files)."""

from __future__ import annotations

import hashlib
import json
import platform
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import fedlt
from conftest import write_suite
from fedlt import environment

KEYS = ["fedlt", "git_commit", "source_hash", "torch", "cpu", "cpu_capability", "gpu", "threads", "backend", "os", "python"]
TINY = ["data.dataset=synthetic", "data.num_clients=4", "fl.rounds=1", "fl.local_epochs=1", "fl.participation=0.5",
        "eval.every=1", "run.threads=1", "run.device=cpu"]


def check(env: dict, backend: str | None, threads: int) -> None:
    assert list(env) == KEYS
    assert env["fedlt"] == fedlt.__version__ and env["torch"] == torch.__version__
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["threads"] == threads and env["backend"] == backend and env["gpu"] is None  # these runs are on the CPU
    assert env["python"] == platform.python_version() and env["os"] == platform.platform()
    assert isinstance(env["cpu"], str) and env["cpu"]
    assert env["git_commit"] is None or re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", env["git_commit"])
    assert env["source_hash"] == environment.source_hash() and re.fullmatch(r"[0-9a-f]{16}", env["source_hash"])


def test_a_run_summary_records_its_environment(tmp_path):
    res = fedlt.run(None, overrides=[*TINY, "run.backend=auto", f"run.out_dir={tmp_path}"], quiet=True)
    env = json.loads((res.run_dir / "summary.json").read_text())["environment"]
    check(env, backend="sequential", threads=1)  # the backend run.backend=auto resolved to on a CPU; run.threads=1
    assert torch.get_num_threads() == 1


def test_a_run_without_run_threads_does_not_inherit_an_earlier_runs_threads(tmp_path, monkeypatch):
    """A bench's cells run one after another in one process: a cell with run.threads=1 left torch on one
    thread for the next cell without run.threads, whose floats then depended on the order cells ran in."""
    from fedlt import run_parts

    before = torch.get_num_threads()
    monkeypatch.setattr(run_parts, "_PROCESS_THREADS", 2)  # this process's own choice, before any run
    try:
        fedlt.run(None, overrides=[*TINY, f"run.out_dir={tmp_path}"], quiet=True)
        assert torch.get_num_threads() == 1
        rest = [o for o in TINY if not o.startswith("run.threads")]
        res = fedlt.run(None, overrides=[*rest, f"run.out_dir={tmp_path}"], quiet=True)
        assert res.summary["environment"]["threads"] == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_a_first_run_with_run_threads_or_deterministic_leaves_no_setting_to_the_next(monkeypatch):
    """The process's thread count is read before the first run sets one, even when that run gives
    run.threads; cuDNN's deterministic mode follows each run's run.deterministic."""
    from fedlt.config import load_config
    from fedlt.run_parts import setup_runtime

    before, cudnn = torch.get_num_threads(), torch.backends.cudnn.deterministic
    monkeypatch.setattr("fedlt.run_parts._PROCESS_THREADS", None)  # no run yet in this process
    try:
        torch.set_num_threads(2)
        setup_runtime(load_config(None, ["data.dataset=synthetic", "run.threads=1", "run.deterministic=true"]))
        assert torch.get_num_threads() == 1 and torch.backends.cudnn.deterministic
        setup_runtime(load_config(None, ["data.dataset=synthetic", "run.deterministic=false"]))
        assert torch.get_num_threads() == 2 and not torch.backends.cudnn.deterministic
    finally:
        torch.set_num_threads(before)
        torch.backends.cudnn.deterministic = cudnn


def test_a_bench_log_record_carries_the_environment_of_its_cell(tmp_path):
    from fedlt.bench.suite import load_suite, run_suite

    suite = {"name": "one", "title": "One cell", "description": "one cell", "overrides": TINY, "seeds": [0],
             "settings": [{"name": "s", "overrides": []}], "methods": [{"name": "FedAvg", "overrides": []}]}
    run_suite(load_suite(write_suite(tmp_path / "one.yaml", suite)), tmp_path / "out", echo=lambda line: None)
    (record,) = [json.loads(line) for line in (tmp_path / "out" / "bench-log.jsonl").read_text().splitlines()]
    assert record["status"] == "ok"
    check(record["environment"], backend="sequential", threads=1)


def test_git_commit_names_the_checkout_or_nothing(monkeypatch, tmp_path):
    def no_git(*args, **kwargs):
        raise AssertionError("outside a work tree no git process is started")

    monkeypatch.setattr(environment, "__file__", str(tmp_path / "site-packages" / "fedlt" / "environment.py"))
    monkeypatch.setattr(subprocess, "run", no_git)
    environment.git_commit.cache_clear()
    assert environment.git_commit() is None
    monkeypatch.undo()
    monkeypatch.setenv("PATH", "")  # a work tree but no git program: None, not an error
    environment.git_commit.cache_clear()
    assert environment.git_commit() is None
    monkeypatch.undo()
    environment.git_commit.cache_clear()
    commit = environment.git_commit()
    if shutil.which("git") and commit is not None:
        src = Path(environment.__file__).parent
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
        assert commit.removesuffix("+dirty") == head.stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs the git program to make a checkout")
def test_git_commit_of_a_checkout_is_its_head_and_says_dirty_only_for_edited_tracked_files(monkeypatch, tmp_path):
    """An installed fedlt may rightly have no commit, so the test above cannot tell a git_commit that always
    says None; a checkout made here is named by its HEAD, +dirty once a tracked file changes, not an untracked one."""
    package = tmp_path / "repo" / "fedlt"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "environment.py").write_text("")
    git = lambda *args: subprocess.run(["git", "-C", str(package.parent), "-c", "user.name=t", "-c",  # noqa: E731
                                        "user.email=t@t", *args], capture_output=True, text=True, check=True).stdout
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    monkeypatch.setattr(environment, "__file__", str(package / "environment.py"))
    head = git("rev-parse", "--short", "HEAD").strip()
    for edit, expected in ((None, head), ("notes.txt", head), ("__init__.py", f"{head}+dirty")):
        if edit:
            (package / edit).write_text("x = 1\n")
        environment.git_commit.cache_clear()
        assert environment.git_commit() == expected, edit
    environment.git_commit.cache_clear()


def test_bench_reports_describe_the_machine_in_one_line():
    env = {**environment.collect(), "cpu": "Some CPU", "cpu_capability": "AVX512", "threads": 4, "torch": "2.13.0",
           "fedlt": "0.1.0", "git_commit": "abc1234+dirty"}
    assert environment.describe(env) == "Some CPU (AVX512), 4 threads, torch 2.13.0, fedlt 0.1.0 (abc1234+dirty)"
    assert environment.describe({**env, "gpu": "NVIDIA H100", "git_commit": None}).startswith("NVIDIA H100, Some CPU")


@pytest.mark.parametrize("device", ["cpu", None])
def test_collect_on_the_cpu(device):
    check(environment.collect(device, "parallel"), backend="parallel", threads=torch.get_num_threads())


def test_source_hash_names_the_package_files_and_changes_with_any_of_them(tmp_path):
    """An installed copy (no git) hashes like the checkout; editing, adding or renaming a source file or a
    bundled suite changes the hash, and files that are not source (caches, notes) do not."""
    package = Path(environment.__file__).resolve().parent
    copy = tmp_path / "site-packages" / "fedlt"
    shutil.copytree(package, copy, ignore=shutil.ignore_patterns("__pycache__"))
    installed = environment.hash_sources(copy)
    assert installed == environment.hash_sources(package)
    (copy / "__pycache__").mkdir(exist_ok=True)
    (copy / "__pycache__" / "x.pyc").write_bytes(b"\0")
    (copy / "NOTES.txt").write_text("not source")
    assert environment.hash_sources(copy) == installed
    seen = {installed}
    for change in ("edit", "suite", "add", "rename"):
        if change == "edit":
            (copy / "errors.py").write_text((copy / "errors.py").read_text() + "\n")
        elif change == "suite":
            (copy / "bench" / "suites" / "demo.yaml").write_text("name: demo\n")
        elif change == "add":
            (copy / "extra.py").write_text("")
        else:
            (copy / "extra.py").rename(copy / "extra2.py")
        seen.add(environment.hash_sources(copy))
        assert len(seen) == {"edit": 2, "suite": 3, "add": 4, "rename": 5}[change], change
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    (tiny / "a.py").write_bytes(b"x = 1\n")
    # by hand: sha256 of "a.py", NUL, the size 6, NUL and the bytes
    assert environment.hash_sources(tiny) == hashlib.sha256(b"a.py\x006\x00x = 1\n").hexdigest()[:16]


def test_same_code_needs_equal_source_hashes_or_one_clean_commit():
    same, hashed = environment.same_code, {"source_hash": "0123456789abcdef", "git_commit": "abc1234"}
    assert same(hashed, {"source_hash": "0123456789abcdef", "git_commit": "def5678+dirty"})
    assert not same(hashed, {"source_hash": "fedcba9876543210", "git_commit": "abc1234"})
    assert same(hashed, {"git_commit": "abc1234"}) and same({"git_commit": "abc1234"}, hashed)  # a run before hashing
    assert not same({"git_commit": "abc1234+dirty"}, {"git_commit": "abc1234+dirty"})  # uncommitted: unknown code
    assert not same({}, {}) and not same({"git_commit": None}, hashed)
    assert environment.code_version(hashed) == "0123456789abcdef"
    assert environment.code_version({"source_hash": None, "git_commit": "abc1234+dirty"}) == "abc1234+dirty"
    assert environment.code_version({}) is None

    # a method or calibration from outside fedlt is code of its own, named beside fedlt's
    plugin = {**hashed, "outside_code": {"clipavg": "plug-in fedlt-example-plugin 0.1.0"}}
    upgraded = {**hashed, "outside_code": {"clipavg": "plug-in fedlt-example-plugin 0.2.0"}}
    assert same(plugin, dict(plugin)) and not same(plugin, upgraded) and not same(plugin, hashed)
    assert same(hashed, {**hashed, "outside_code": {}})  # a record without the key ran fedlt's own code
    assert environment.code_version(plugin) == "0123456789abcdef + clipavg: plug-in fedlt-example-plugin 0.1.0"


def test_a_run_keeps_large_freed_buffers_for_reuse_on_glibc(tmp_path) -> None:
    """An evaluation batch's ~100 MB of activations came back from the kernel as fresh pages every batch
    (most of a small run's system time); a run raises glibc's thresholds once, where it has glibc."""
    import ctypes
    import platform

    import fedlt
    from fedlt import host_memory

    fedlt.run({"data": {"dataset": "synthetic", "num_clients": 4}, "fl": {"rounds": 1, "participation": 0.5},
               "run": {"out_dir": str(tmp_path), "threads": 1}}, quiet=True)
    glibc = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"
    assert host_memory._kept is glibc and host_memory.keep_freed_buffers() is glibc
    if glibc:  # the values it sets are ones glibc accepts
        assert ctypes.CDLL(None).mallopt(-3, host_memory.MMAP_THRESHOLD) == 1
