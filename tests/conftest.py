"""Shared fixtures: one tiny benchmark suite, run once per test session (a few seconds)."""

from __future__ import annotations

from pathlib import Path

import pytest
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
