"""The CUDA paths: the graphed backend's captured steps and streams, and the vectorized backend, equal
sequential training on the GPU client by client; a local epoch on the GPU never waits for the host.

The same arithmetic is checked on the CPU in test_vectorized.py (the graphed step without capture);
what only a GPU has (graph capture, replays, several streams) is checked here.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import fedlt
from conftest import assert_clients_equal_sequential_training, run_until_crash_in_round_3
from fedlt.api import prepare
from fedlt.messages import Message
from fedlt.engine.checkpoint import load_checkpoint
from fedlt.methods.base import clone_state
from fedlt.results import TIMING_KEYS
from fedlt.training.batched import train_clients
from fedlt.training.graphed import GraphedTrainer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA GPU (graph capture, replays and streams exist only there)")


def config(tmp_path, *overrides: str):
    return fedlt.load_config(None, [
        "seed=1", "data.dataset=synthetic", "data.imbalance_factor=10", "data.num_clients=6", "fl.participation=1.0",
        "fl.local_epochs=1", "fl.rounds=2", "eval.every=1", f"run.out_dir={tmp_path}", "run.device=cuda",
        "run.checkpoint_every=0", "fl.batch_size=16", *overrides,
    ])


@pytest.mark.parametrize("together", ["graphed", "vectorized"])
@pytest.mark.parametrize("model,loss,extra", [
    ("resnet8", "ldam", ["data.augment=weak", "fl.grad_clip=0.5"]),  # BatchNorm, margins, augmentation, clipping
    ("cnn", "la", ["fl.local_epochs=2", "fl.weight_decay=0.01"]),
])
def test_clients_trained_together_on_a_gpu_equal_sequential_training(tmp_path, float64, model, loss, extra, together):
    sim = prepare(config(tmp_path, f"model.name={model}", f"loss.name={loss}", "data.image_size=8", *extra))
    assert sim.device.type == "cuda" and sim.worker.head.weight.dtype == torch.float64
    msg = Message(weights=clone_state(sim.worker))
    cids = sim.schedule[0]
    contexts = [sim._context(c, 1) for c in cids]
    assert len({len(ctx.data) % 16 for ctx in contexts}) > 1, "the test needs clients whose last batches differ"
    objectives = [sim.client.local_objective(ctx, msg) for ctx in contexts]
    starts = [dict(msg.weights)] * len(cids)
    if together == "graphed":
        trainer = GraphedTrainer(sim.worker, lanes=4)
        results = trainer.train(contexts, starts, objectives)
        assert trainer.capture and len(trainer.lanes) == 4
        assert all(lane.graphs for lane in trainer.lanes)  # every lane captured and replayed its full batches
    else:
        results = train_clients(sim.worker, contexts, starts, objectives)
    assert_clients_equal_sequential_training(sim, msg, cids, results, tol=1e-9)


@pytest.mark.parametrize("method,extra", [
    # a new learning rate every round (read by the graphs from a tensor) and FedProx's anchor
    ("fedprox", ["method_args.mu=0.5", "fl.lr_schedule=cosine"]),
    # losses of the model: SFD's projector (its annealed weight a tensor), FedLoGe's phi_k outside the model
    ("sfd", ["model.name=resnet8", "data.image_size=8", "data.augment=weak", "calibration_args.safs_steps=5"]),
    ("fedloge", ["method_args.head_bias=true", "fl.grad_clip=0.5", "method_args.sse_steps=50"]),
    # experts frozen per client (a graph per set of trained parameters), the warm-up's rate per step
    ("gbme", ["loss.name=bsm", "model.name=resnet8", "data.image_size=8"]),
    # two views per image made outside the graph, the log-prior written per step, the features kept
    ("fedyoyo", ["model.name=resnet8", "data.image_size=8"]),
    # the gradient offset read and the gradient sums written inside the graph (round 2 uses round 1's variates)
    ("scaffold", ["fl.rounds=3", "fl.weight_decay=0.01"]),
])
def test_a_graphed_run_on_a_gpu_equals_a_sequential_run(tmp_path, float64, method, extra):
    runs = {}
    for backend in ("sequential", "graphed"):
        sim = prepare(config(tmp_path, f"method={method}", *extra, f"run.backend={backend}", "run.streams=3"))
        assert sim.backend == backend
        (tmp_path / backend).mkdir()
        runs[backend] = (sim.run(tmp_path / backend, quiet=True), clone_state(sim.server_model))
        if backend == "graphed":
            assert any(lane.graphs for lane in sim.graphed.lanes)  # steps were captured and replayed
            pools = {lane.pool for lane in sim.graphed.lanes if lane.graphs}
            assert len(pools) == sum(1 for lane in sim.graphed.lanes if lane.graphs)  # one pool per lane
    (seq, seq_state), (graphed, graphed_state) = runs["sequential"], runs["graphed"]
    for name, value in seq_state.items():
        assert torch.allclose(graphed_state[name], value, rtol=0, atol=1e-9), name
    assert [r["acc"] for r in graphed.metrics] == [r["acc"] for r in seq.metrics]


@pytest.mark.parametrize("backend,extra", [
    ("sequential", ["loss.name=bsm"]), ("graphed", ["loss.name=bsm"]), ("vectorized", ["loss.name=bsm"]),
    ("graphed", ["method=fedyoyo"]),  # two views per image, the strong one AutoAugment's policy with masks
])
def test_a_local_epoch_on_a_gpu_never_waits_for_the_host(tmp_path, backend, extra):
    """CUDA's own sync check: the synchronisations of a round do not grow with its local epochs."""
    counts = [round_syncs(tmp_path, f"run.backend={backend}", f"fl.local_epochs={epochs}", *extra) for epochs in (1, 3)]
    # equal up to set-up the first round left (one fewer was seen with 3 epochs): none per step
    assert counts[1] <= counts[0], f"synchronisations with 1 and 3 local epochs: {counts}"


@pytest.mark.parametrize("extra", [[], ["loss.name=bsm", "loss.prior=global"], ["method=sfd"]],
                         ids=lambda e: " ".join(e) or "ce")
def test_a_graphed_round_on_a_gpu_waits_no_more_often_with_more_clients(tmp_path, extra):
    """A client's start (rows, class counts, its loss's per-class terms) and its reply make no
    synchronisation: the host makes the next clients while the lanes train, and a wait per client
    would stall it."""
    counts = [round_syncs(tmp_path, "run.backend=graphed", f"data.num_clients={clients}", *extra) for clients in (3, 6)]
    assert counts[1] <= counts[0], f"synchronisations with 3 and 6 clients: {counts}"


def round_syncs(tmp_path, *overrides: str) -> int:
    """CUDA's synchronisation warnings in a run's second round (the first one captures and allocates)."""
    sim = prepare(config(tmp_path, *overrides))
    sim.setup()
    sim.fit_round(1)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            sim.fit_round(2)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sim.close()
    return sum("synchroniz" in str(w.message).lower() for w in caught)


def test_the_captured_limit_on_a_gpu_equals_the_eager_limit(tmp_path, float64):
    """`fedlt bench speed --backends`' captured limit row replays the eager limit's step as a graph."""
    from fedlt.bench.speed import captured_limit_round, limit_round

    sim = prepare(config(tmp_path, "model.name=resnet8", "data.image_size=8", "fl.local_epochs=2"))
    trainer = GraphedTrainer(sim.worker, lanes=1)
    captured = captured_limit_round(sim, trainer, 1)
    assert trainer.capture and trainer.lanes[0].graphs  # the full batch's shape ran twice: captured
    lane = clone_state(trainer.lanes[0].model)
    eager = limit_round(sim, 1)
    assert captured["steps"] == eager["steps"]
    for name, value in clone_state(sim.worker).items():
        assert torch.allclose(lane[name], value, rtol=0, atol=1e-9), name


def test_a_resumed_gpu_run_keeps_its_host_state_on_the_host_and_ends_as_the_uninterrupted_one(tmp_path, monkeypatch):
    """SCAFFOLD's server variate and the model live on the device, the clients' variates and the global
    class counts (loss.prior=global) on the host; resumed, each is where the uninterrupted run kept it."""
    over = ["method=scaffold", "loss.name=bsm", "loss.prior=global", "fl.rounds=4", "run.checkpoint_every=1"]
    full = fedlt.run(config(tmp_path, *over, "run.name=full"), quiet=True)
    run_dir = run_until_crash_in_round_3(config(tmp_path, *over, "run.name=cut").dump(), monkeypatch)
    saved = load_checkpoint(run_dir, "cuda")
    assert {t.device.type for t in saved["server"]["model"].values()} == {"cuda"}
    assert saved["server"]["c"].device.type == "cuda" and saved["server"]["global_counts"].device.type == "cpu"
    assert {t.device.type for state in saved["clients"].values() for t in state.values()} == {"cpu"}
    monkeypatch.undo()
    resumed = fedlt.resume(run_dir, quiet=True)
    assert [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in resumed.metrics] == \
        [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in full.metrics]


def test_fused_clones_on_a_gpu_are_exact_copies_in_each_tensors_layout():
    """One multiplication by 1 per group (fedlt.fused.clones) copies a CUDA state as ``clone`` does, and so
    do a state's copies packed in one buffer per dtype (fedlt.fused.packed_clones, a graphed client's reply)."""
    from fedlt import fused

    g = torch.Generator(device="cuda").manual_seed(0)
    conv = torch.randn(8, 4, 3, 3, generator=g, device="cuda").contiguous(memory_format=torch.channels_last)
    specials = torch.tensor([-0.0, float("inf"), 1e-45, 2.5], device="cuda")
    state = [conv, specials, specials.half(), torch.tensor(7, device="cuda"), torch.randn(3, 5, device="cuda").t(),
             torch.tensor([True, False], device="cuda")]
    packed, buffers = fused.packed_clones(state)
    assert len(buffers) == 5  # the conv and the specials in one, the transposed matrix alone, one per other dtype
    for copies in (fused.clones(state), packed):
        for t, c in zip(state, copies):
            assert c.dtype == t.dtype and c.stride() == t.clone().stride() and c.data_ptr() != t.data_ptr()
            assert torch.equal(c.view(torch.uint8), t.view(torch.uint8)) if t.is_contiguous() and t.dim() \
                else torch.equal(c, t)
