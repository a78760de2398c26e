"""Shared fixtures: one tiny benchmark suite, run once per test session (a few seconds)."""

from __future__ import annotations

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
    from fedlt.methods.calibrated import client_features

    feats, labels = [], []
    for cid in range(num_clients):
        ctx = sim._context(cid, rnd)
        ctx.model.load_state_dict(sim.server.inner.model.state_dict())
        f, y = client_features(ctx.model, ctx)
        feats.append(f)
        labels.append(y)
    return torch.cat(feats), torch.cat(labels)
