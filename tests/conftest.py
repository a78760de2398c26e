"""Shared fixtures: one tiny benchmark suite, run once per test session (a few seconds)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import yaml

TINY_SUITE = {
    "name": "tiny",
    "title": "Tiny suite",
    "description": "two methods on synthetic data",
    "overrides": ["data.dataset=synthetic", "data.num_clients=4", "data.imbalance_factor=10", "fl.rounds=2",
                  "fl.local_epochs=1", "fl.participation=0.5", "eval.every=1", "run.threads=1"],
    "seeds": [0, 1],
    "settings": [{"name": "IF=10, alpha=0.5", "overrides": ["data.alpha=0.5"]}],
    "methods": [
        {"name": "FedAvg + CCVR", "overrides": ["method=ccvr", "calibration_args.retrain_steps=20"], "variants": {"FedAvg": "uncalibrated"}},
        {"name": "FedProx", "overrides": ["method=fedprox"]},
    ],
}


def pytest_configure(config):
    """Under pytest-xdist the workers share the cores: each gets its share of torch's threads, so
    two workers on two cores do not each spin two threads (the suite's compute stays the same)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        from fedlt.engine.process_pool import cpu_cores

        torch.set_num_threads(max(1, cpu_cores() // workers))


def run_until_crash_in_round_3(cfg: dict, monkeypatch) -> Path:
    """Run ``cfg`` until it is interrupted in round 3 (after round 2's checkpoint); its run folder,
    to resume and compare with an uninterrupted run."""
    import fedlt
    from fedlt.engine.simulation import Simulation

    original = Simulation.fit_round

    def crash_in_round_3(self, rnd):
        if rnd == 3:
            raise KeyboardInterrupt
        return original(self, rnd)

    monkeypatch.setattr(Simulation, "fit_round", crash_in_round_3)
    with pytest.raises(KeyboardInterrupt):
        fedlt.run(cfg, quiet=True)
    monkeypatch.setattr(Simulation, "fit_round", original)
    return Path(cfg["run"]["out_dir"]) / cfg["run"]["name"]


def wait_until_group_ends(leader: int, seconds: float = 10.0) -> None:
    """Wait until no process is left in the process group (session) of ``leader``; fail after ``seconds``:
    a worker outlived the command that started it."""
    import time

    deadline = time.monotonic() + seconds
    while True:
        try:
            os.killpg(leader, 0)
        except ProcessLookupError:
            return
        assert time.monotonic() < deadline, "a process of the command outlived it"
        time.sleep(0.2)


def write_suite(path: Path, tree: dict) -> Path:
    path.write_text(yaml.safe_dump(tree, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def tiny_suite(tmp_path_factory):
    """(suite file, output folder, SuiteResult) of the tiny suite run in-process with 1 worker."""
    from fedlt.bench.suite import load_suite, run_suite

    root = tmp_path_factory.mktemp("tiny-suite")
    path = write_suite(root / "tiny.yaml", TINY_SUITE)
    out = root / "out"
    result = run_suite(load_suite(path), out, echo=lambda line: None)
    return path, out, result


@pytest.fixture
def float64():
    """Build and train in float64, for tests that compare two ways of computing the same thing.

    Two code paths that do the same arithmetic in another order (grouped vs single convolutions,
    fixed-point vs float sums, a logit shift) differ by float32 rounding, ~6e-8 relative, which
    depends on the CPU's kernels (AVX2, AVX512 and the scalar fallback round differently). Training
    amplifies it, chaotically: ResNet-8's BatchNorm turns it into 5e-4 (AVX2) to 3e-3 (AVX512) on
    the weights within one round, and any float32 tolerance is a guess tuned on one CPU. In float64
    rounding is 1.1e-16 and the same comparisons end <= 1e-14 apart under every
    ATEN_CPU_CAPABILITY (measured: default, avx2), so a test can demand equality to 1e-10 (1e4 to
    1e6 times that) and identical accuracy (a prediction flips only on a top-two logit tie within
    ~1e-13) on any CPU.
    """
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)  # models, data standardisation and losses follow it
    yield
    torch.set_default_dtype(previous)


def run_capturing_stats(sim, run_dir: Path):
    """Run ``sim`` (a calibrated method) and return (result, the server's merged statistics)."""
    captured = {}
    server = sim.server
    original = server.receive

    def spy(query, replies):
        original(query, replies)
        captured.update(server._stats)

    server.receive = spy
    run_dir.mkdir()
    return sim.run(run_dir, quiet=True), captured


def pooled_client_features(sim, num_clients: int, rnd: int):
    """Every client's features under the final backbone, concatenated (what the sums must equal)."""
    from fedlt.calibration.wrapper import client_features

    feats, labels = [], []
    for cid in range(num_clients):
        ctx = sim._context(cid, rnd)
        ctx.model.load_state_dict(sim.server.inner.model.state_dict())
        f, y = client_features(ctx.model, ctx)
        feats.append(f)
        labels.append(y)
    return torch.cat(feats).cpu(), torch.cat(labels).cpu()  # where the server keeps its merged sums


def assert_clients_equal_sequential_training(sim, msg, cids, results, tol: float) -> None:
    """Each client's ``(weights, metrics, ...)`` in ``results`` equals training it alone with
    ``train_local`` from ``msg`` (FedAvg's local loss), to ``tol``."""
    from fedlt.methods.fedavg import local_loss
    from fedlt.training.sequential import train_local

    for cid, (weights, metrics, *_) in zip(cids, results):  # the graphed trainer adds extras
        ctx = sim._context(cid, 1)
        loss_fn = local_loss(ctx, msg)
        expected = train_local(ctx, lambda x, y: loss_fn(ctx.model(x), y))
        assert metrics["steps"] == expected["steps"]
        assert metrics["train_loss"] == pytest.approx(expected["train_loss"], rel=tol)
        for name, value in ctx.model.state_dict().items():
            assert torch.allclose(weights[name], value, rtol=0, atol=tol), (cid, name)
