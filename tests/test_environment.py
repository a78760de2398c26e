"""Where a number was measured: every summary.json and bench-log record carries the environment."""

from __future__ import annotations

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

KEYS = ["fedlt", "git_commit", "torch", "cpu", "cpu_capability", "gpu", "threads", "backend", "os", "python"]
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


def test_a_run_summary_records_its_environment(tmp_path):
    res = fedlt.run(None, overrides=[*TINY, "run.backend=auto", f"run.out_dir={tmp_path}"], quiet=True)
    env = json.loads((res.run_dir / "summary.json").read_text())["environment"]
    check(env, backend="vectorized", threads=1)  # the backend run.backend=auto resolved to; run.threads=1
    assert torch.get_num_threads() == 1


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


def test_bench_reports_describe_the_machine_in_one_line():
    env = {**environment.collect(), "cpu": "Some CPU", "cpu_capability": "AVX512", "threads": 4, "torch": "2.13.0",
           "fedlt": "0.1.0", "git_commit": "abc1234+dirty"}
    assert environment.describe(env) == "Some CPU (AVX512), 4 threads, torch 2.13.0, fedlt 0.1.0 (abc1234+dirty)"
    assert environment.describe({**env, "gpu": "NVIDIA H100", "git_commit": None}).startswith("NVIDIA H100, Some CPU")


@pytest.mark.parametrize("device", ["cpu", None])
def test_collect_on_the_cpu(device):
    check(environment.collect(device, "parallel"), backend="parallel", threads=torch.get_num_threads())
