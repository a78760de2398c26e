"""run.backend=parallel: clients answered in worker processes give exactly the sequential run."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fedlt
from fedlt.api import prepare
from fedlt.engine.process_pool import LOOKAHEAD, ClientPool, default_workers
from fedlt.errors import ConfigError, DataError
from fedlt.messages import Message
from fedlt.methods.fedavg import FedAvgClient
from fedlt.results import TIMING_KEYS
from fedlt.run_parts import choose_backend


def config(tmp_path, *overrides: str):
    # run.threads=1 in both backends: the same arithmetic, so the runs must agree bit for bit
    return fedlt.load_config(None, [
        "seed=2", "data.dataset=synthetic", "data.imbalance_factor=10", "data.num_clients=6", "fl.participation=0.67",
        "fl.rounds=3", "eval.every=1", f"run.out_dir={tmp_path}", "run.threads=1", "run.checkpoint_every=0",
        "run.workers=2", "run.device=cpu", *overrides,  # worker processes train on the CPU
    ])


@pytest.mark.parametrize("extra", [
    ["method=fedavg", "loss.name=la"],
    ["method=ditto"],  # per-client state kept between rounds, personalized evaluation in the workers
    ["method=creff"],  # a query phase (gradients of real features) besides fit
    # personal heads on the sent encoder: each worker makes the test set's features for its clients
    ["method=fedrep", "method_args.head_epochs=1"],
])
def test_parallel_run_equals_sequential_run(tmp_path, extra):
    runs = {}
    for backend in ("sequential", "parallel"):
        sim = prepare(config(tmp_path, f"run.backend={backend}", *extra))
        assert sim.backend == backend
        (tmp_path / backend).mkdir()
        result = sim.run(tmp_path / backend, quiet=True)
        runs[backend] = (result, sim.client_states)
    (seq, seq_states), (par, par_states) = runs["sequential"], runs["parallel"]
    strip = lambda rows: [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]  # noqa: E731
    assert strip(par.metrics) == strip(seq.metrics)
    assert par.summary["communication_bytes"] == seq.summary["communication_bytes"]
    assert json.loads((par.run_dir / "summary.json").read_text())["backend"] == "parallel"
    assert par_states.keys() == seq_states.keys()
    for cid, state in seq_states.items():
        flat_seq, flat_par = torch.utils._pytree.tree_leaves(state), torch.utils._pytree.tree_leaves(par_states[cid])
        assert len(flat_seq) == len(flat_par)
        for a, b in zip(flat_seq, flat_par):
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b
    if extra == ["method=ditto"]:
        assert seq_states, "ditto keeps a personal model per client"


def test_worker_failures_reach_the_caller_and_close_the_pool(tmp_path):
    cfg = config(tmp_path)
    size = lambda cid: cid  # noqa: E731
    pool = ClientPool(cfg, workers=1)
    # more jobs than the look-ahead holds (4 per worker): replies still come back, in job order
    many = [(cid % 6, Message(), {}) for cid in range(2 * LOOKAHEAD + 1)]
    counts = [len(ix) for ix in prepare(cfg).train_data.partition.client_indices]
    assert [reply.num_samples for reply, _ in pool.answer("fit", 1, many, size)] == [counts[c] for c, _, _ in many]
    fit = [(cid, Message(), {}) for cid in range(3)]
    replies = pool.answer("fit", 1, fit, size)
    first = next(replies)[0]
    assert first.num_samples == counts[0] and first.weights
    replies.close()  # the caller abandons the phase: its other replies must never be read later
    assert not pool.open
    with pytest.raises(RuntimeError, match="closed"):
        list(pool.answer("fit", 1, fit, size))

    pool = ClientPool(cfg, workers=2)
    with pytest.raises(ValueError, match="unknown exchange kind 'nonsense'"):  # one worker fails, one is busy
        list(pool.answer("nonsense", 1, [(0, Message(), {}), (1, Message(), {})], size))
    assert not pool.open

    pool = ClientPool(cfg, workers=1)
    pool._procs[0].kill()
    pool._procs[0].wait()
    with pytest.raises(RuntimeError, match="worker process died .*run.backend=sequential"):
        list(pool.answer("fit", 1, fit, size))
    assert not pool.open


def test_an_interrupt_while_the_pool_closes_kills_its_workers(tmp_path, monkeypatch):
    """Ctrl-C while the pool waited for its workers to end left the others running: a busy worker reads its
    closed socket only after its job, and went on alone after the run had stopped."""
    import subprocess

    pool = ClientPool(config(tmp_path), workers=2)
    workers = list(pool._procs)
    wait = subprocess.Popen.wait

    def interrupted(proc, timeout=None):
        if timeout == 5.0:  # the first worker's end, waited for
            raise KeyboardInterrupt
        return wait(proc, timeout)

    monkeypatch.setattr(subprocess.Popen, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        pool.close()
    assert all(proc.returncode is not None for proc in workers) and not pool.open  # ended, and reaped


def test_worker_setup_errors_are_reported(tmp_path):
    cfg = config(tmp_path, "data.dataset=cifar10", f"data.root={tmp_path / 'missing'}")
    pool = ClientPool(cfg, workers=1)  # the parent never loads the data here; the worker fails to
    with pytest.raises(DataError, match="cifar10"):
        list(pool.answer("fit", 1, [(0, Message(), {})], lambda cid: 0))


def test_parallel_secure_aggregation_equals_sequential(tmp_path):
    finals = []
    for backend in ("sequential", "parallel"):
        sim = prepare(config(tmp_path, f"run.backend={backend}", "secagg.enabled=true", "fl.rounds=2"))
        (tmp_path / backend).mkdir()
        finals.append(sim.run(tmp_path / backend, quiet=True).summary["final"])
    assert finals[0] == finals[1]


def test_parallel_backend_choice(tmp_path):
    cfg = config(tmp_path, "run.backend=parallel")
    assert choose_backend(cfg, FedAvgClient, torch.device("cpu")) == "parallel"
    with pytest.raises(ConfigError, match="run.backend=parallel trains clients in CPU processes.*run.device=cpu"):
        choose_backend(cfg, FedAvgClient, torch.device("cuda"))
    assert default_workers(cfg) == 2
    cores = len(os.sched_getaffinity(0))
    assert default_workers(config(tmp_path, "run.backend=parallel", "run.workers=null")) == min(cores, 4)
    # never more processes than clients: no exchange asks more at once (64 workers for 4 clients took 40x as long)
    assert default_workers(config(tmp_path, "run.backend=parallel", "run.workers=64")) == 6  # data.num_clients


def test_a_refusal_of_vectorized_training_names_parallel_among_the_backends_that_run_the_method(tmp_path):
    # FedLoGe's step reads the features: not vectorized, but any worker process runs it by name
    from fedlt.methods.fedloge import FedLoGeClient
    with pytest.raises(ConfigError, match="use run.backend=graphed, run.backend=parallel, run.backend=auto or "
                                          "run.backend=sequential"):
        choose_backend(config(tmp_path, "method=fedloge", "run.backend=vectorized"), FedLoGeClient, torch.device("cpu"))
