"""``fedlt bench speed``: how fast local training runs, and how close to the machine's peak.

Reports, for the given config: images/s of local training, seconds per round (training only,
and evaluation separately), training GFLOP/s achieved (FLOPs counted by torch's FlopCounterMode
on one forward+backward) against a float32 matrix-multiply peak measured in the same process,
and the same figures with channels-last and torch.compile, so the faster setting can be kept.
With ``--backends``: sequential vs parallel vs vectorized local training (``run.backend``) against a loop
written the way peer frameworks train, and K=10 vs K=1,000 clients at the same sampled count and
the same data per client.
"""

from __future__ import annotations

import copy
import time
from dataclasses import replace
from typing import Callable

import torch
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.flop_counter import FlopCounterMode

from fedlt.api import prepare
from fedlt.config import Config, load_config
from fedlt.engine.process_pool import cpu_cores
from fedlt.environment import collect, describe
from fedlt.methods.base import LocalObjective, clone_state
from fedlt.results import counted
from fedlt.run_parts import resolve_device
from fedlt.training.graphed import GraphedTrainer
from fedlt.training.sequential import train_local


def matmul_peak_gflops(device: torch.device, n: int = 2048, repeats: int = 10) -> float:
    """Achieved GFLOP/s of an n x n float32 matmul: the practical peak of this device."""
    a = torch.randn(n, n, device=device)
    b = torch.randn(n, n, device=device)
    for _ in range(2):
        a @ b
    sync_device(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        a @ b
    sync_device(device)
    return 2 * n**3 * repeats / (time.perf_counter() - t0) / 1e9


def sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_flops_per_image(sim) -> float:
    """FLOPs of one forward + backward pass per training image (conv/matmul work)."""
    data = sim.train_data
    rows = torch.as_tensor(data.partition.client_indices[0][: sim.cfg.fl.batch_size], device=data.train.labels.device)
    x = data.train.normalize(data.train.images[rows])
    y = data.train.labels[rows]
    model = sim.worker
    model.train()
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    model.zero_grad(set_to_none=True)
    return counter.get_total_flops() / len(rows)


def time_rounds(sim, rounds: int) -> dict[str, float]:
    """Seconds per round and images/s over ``rounds`` rounds after one warm-up round."""
    sim.setup()
    sim.fit_round(1)  # warm-up: allocations, compilation
    sync_device(sim.device)
    images = 0
    t0 = time.perf_counter()
    for rnd in range(2, rounds + 2):
        sim.fit_round(rnd)
        images += sum(len(sim.train_data.partition.client_indices[c]) for c in sim.schedule[rnd - 1])
    sync_device(sim.device)
    seconds = time.perf_counter() - t0
    images *= sim.cfg.fl.local_epochs
    t1 = time.perf_counter()
    sim.evaluate(rounds + 1)
    sync_device(sim.device)
    return {"s_per_round": seconds / rounds, "images_per_s": images / seconds, "eval_s": time.perf_counter() - t1}


def run_speed_bench(config: str | None, overrides: list[str], rounds: int = 3) -> str:
    variants = [
        ("eager", ["run.channels_last=false", "run.compile=false"]),
        ("channels_last", ["run.channels_last=true", "run.compile=false"]),
        ("compile", ["run.channels_last=false", "run.compile=true"]),
    ]
    base = load_config(config, [*overrides, f"fl.rounds={rounds + 1}"])
    if resolve_device(base.run.device).type != "cpu":  # channels-last is a CPU-only setting (engine.clients)
        variants = [v for v in variants if v[0] != "channels_last"]
    results = []
    flops = None
    for label, extra in variants:
        cfg = load_config(config, [*overrides, f"fl.rounds={rounds + 1}", *extra])
        sim = prepare(cfg)
        if flops is None:
            flops = train_flops_per_image(sim)
        results.append((label, time_rounds(sim, rounds)))
    device = sim.device
    peak = matmul_peak_gflops(device)
    lines = [
        f"# fedlt bench speed: {base.method} / {base.model.name} on {base.data.dataset}",
        "",
        f"device {device}: {describe(collect(device))}; "
        f"{base.data.num_clients} clients, {base.clients_per_round()} per round, {counted(base.fl.local_epochs, 'local epoch')}, "
        f"batch {base.fl.batch_size}; {rounds} timed rounds after one warm-up round.",
        f"Training cost: {flops / 1e6:.2f} MFLOP per image (forward + backward, FlopCounterMode). "
        f"Matmul peak measured now: {peak:.1f} GFLOP/s (float32, 2048x2048).",
        "",
        "| variant | s/round (train) | images/s | GFLOP/s | % of matmul peak | eval s (test + local tests) |",
        "|---|---|---|---|---|---|",
    ]
    for label, r in results:
        gflops = r["images_per_s"] * flops / 1e9
        lines.append(f"| {label} | {r['s_per_round']:.3f} | {r['images_per_s']:.0f} | {gflops:.2f} "
                     f"| {100 * gflops / peak:.1f} | {r['eval_s']:.3f} |")
    best = max(results, key=lambda r: r[1]["images_per_s"])
    lines += ["", f"Fastest here: {best[0]} ({best[1]['images_per_s'] / results[0][1]['images_per_s']:.2f}x eager)."]
    return "\n".join(lines)


# ---- backends: sequential vs vectorized vs the way peer frameworks train ---------------------
BACKEND_MODELS = ("cnn", "resnet8")  # the CNN on the config's data; ResNets on synthetic data (16 px: CPU-sized)
SAMPLED = (10, 20)
BACKENDS = ("sequential", "parallel", "vectorized", "graphed")  # run.backend values measured (where they apply)
CAPTURED_LIMIT = "captured limit"  # the limit's step as a CUDA graph: a GPU row only


def model_data(model: str, synthetic_size: int) -> list[str]:
    """The data a model is measured on: the config's for the CNN, the synthetic set otherwise
    (``synthetic_size`` 32 makes it CIFAR-shaped)."""
    return [] if model == "cnn" else ["data.dataset=synthetic", f"data.image_size={synthetic_size}"]


def measured_setting(base: Config, overrides: list[str], model: str, sampled: int, synthetic_size: int,
                     rounds: int) -> list[str]:
    """Overrides that train ``model`` with ``sampled`` clients a round for ``rounds`` rounds (more
    clients than the config has when needed)."""
    clients = max(sampled, base.data.num_clients)
    return [*overrides, f"fl.rounds={rounds}", f"model.name={model}", *model_data(model, synthetic_size),
            f"data.num_clients={clients}", f"fl.participation={sampled / clients}"]


def reference_round(sim, rnd: int) -> None:
    """One FedAvg round written the way peer frameworks write it: per sampled client a deep copy
    of the global model, a torch DataLoader over a TensorDataset of its samples and a fresh
    ``torch.optim.SGD``; then the sample-weighted average of the clients' state dicts."""
    from fedlt.messages import Reply
    from fedlt.methods.aggregation import weighted_average

    data, fl = sim.train_data.train, sim.cfg.fl
    replies = {}
    for cid in sim.schedule[rnd - 1]:
        idx = sim.train_data.client_indices(cid)
        model = copy.deepcopy(sim.server_model)
        model.train()
        loader = DataLoader(TensorDataset(data.images[idx], data.labels[idx]), batch_size=fl.batch_size, shuffle=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=fl.lr, momentum=fl.momentum, weight_decay=fl.weight_decay)
        for _ in range(fl.local_epochs):
            for x, y in loader:
                loss = torch.nn.functional.cross_entropy(model(data.normalize(x)), y)
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()
        replies[cid] = Reply(weights=model.state_dict(), num_samples=len(idx))
    sim.server_model.load_state_dict(weighted_average(replies))


def limit_context(sim, rnd: int):
    """One client holding every image of round ``rnd``'s sampled clients, with batch K x B (K
    clients, batch B), starting from the worker's initial weights."""
    sampled = sim.schedule[rnd - 1]
    ctx = sim.clients.context(sampled[0], rnd, {})
    rows = torch.cat([sim.train_data.client_indices(c) for c in sampled])
    return replace(ctx, data=replace(ctx.data, indices=rows),
                   train=replace(ctx.train, batch_size=len(sampled) * ctx.train.batch_size))


def limit_round(sim, rnd: int) -> dict[str, float]:
    """The round's work as one model: all the sampled clients' images in batches of K x B through
    the training loop (same batch pipeline, cross-entropy, SGD). Clients with their own weights
    cannot train faster than this in the same loop: it is the device's limit for eager training."""
    ctx = limit_context(sim, rnd)
    return train_local(ctx, lambda x, y: torch.nn.functional.cross_entropy(ctx.model(x), y))


def captured_limit_round(sim, trainer: GraphedTrainer, rnd: int) -> dict[str, float]:
    """:func:`limit_round` with its step captured as a CUDA graph (``trainer``: one lane, kept
    across rounds). Eager training launches every kernel from Python, so a small model's eager
    limit is the host's; captured clients are bounded by this one instead."""
    ctx = limit_context(sim, rnd)
    objective = LocalObjective(torch.nn.functional.cross_entropy)
    return trainer.train([ctx], [clone_state(ctx.model)], [objective])[0][1]


def time_backend(sim, backend: str, rounds: int) -> dict[str, float]:
    """s/round and images/s of training (local training + aggregation) after one warm-up round,
    and on a GPU the peak memory allocated in the timed rounds."""
    steps = {"reference": lambda r: reference_round(sim, r), "limit": lambda r: limit_round(sim, r)}
    if backend == CAPTURED_LIMIT:
        trainer = GraphedTrainer(sim.worker, lanes=1)
        steps[backend] = lambda r: captured_limit_round(sim, trainer, r)
    step = steps.get(backend, sim.fit_round)
    cuda = sim.device.type == "cuda"
    try:
        sim.setup()
        step(1)
        sync_device(sim.device)
        if cuda:
            torch.cuda.reset_peak_memory_stats(sim.device)
        images = 0
        t0 = time.perf_counter()
        for rnd in range(2, rounds + 2):
            step(rnd)
            images += sum(len(sim.train_data.partition.client_indices[c]) for c in sim.schedule[rnd - 1])
        sync_device(sim.device)
        seconds = time.perf_counter() - t0
    finally:
        sim.close()
    return {"s_per_round": seconds / rounds, "images_per_s": images * sim.cfg.fl.local_epochs / seconds,
            "images_per_round": images * sim.cfg.fl.local_epochs / rounds,
            "peak_mib": torch.cuda.max_memory_allocated(sim.device) / 2**20 if cuda else None}


def run_backend_bench(config: str | None, overrides: list[str], rounds: int = 2,
                      echo: Callable[[str], None] = lambda line: None, models: tuple[str, ...] = BACKEND_MODELS,
                      sampled_counts: tuple[int, ...] = SAMPLED, synthetic_size: int = 16, k_table: bool = True,
                      compare: tuple[str, ...] | None = None) -> str:
    """Sequential vs parallel vs vectorized (vs graphed on a GPU) vs the peer-style reference loop and
    the limit (one model, batch K x B), for the CNN and ResNet-8 with 10 and 20 sampled clients; then
    (``k_table``) K=10 vs K=1,000 clients at 10 sampled per round with equal data
    per client (K=10 keeps 1% of the training set). ``compare``: the backends timed (default: every
    one that applies on the device). ``echo`` gets each table row as it is measured (the whole bench
    takes minutes on a CPU)."""
    base = load_config(config, [*overrides, f"fl.rounds={rounds + 1}"])
    device = prepare(base).device
    peak = matmul_peak_gflops(device)
    cuda = device.type == "cuda"
    # parallel: CPU processes; graphed without a GPU is its step without capture, no faster than sequential
    backends = list(compare or (b for b in BACKENDS if b != ("graphed" if device.type == "cpu" else "parallel")))
    lines = [
        f"## Backends: {base.method}, batch {base.fl.batch_size}, {counted(base.fl.local_epochs, 'local epoch')}; "
        f"{rounds} timed round(s) after one warm-up",
        "",
        f"device {device}: {describe(collect(device))}; matmul peak measured now "
        f"{peak:.1f} GFLOP/s (float32, 2048x2048). reference = a DataLoader over a TensorDataset and a deep copy of "
        "the model per client, NCHW (no channels-last), as peer frameworks train; sequential / parallel / "
        f"vectorized / graphed = `run.backend` (parallel, CPU only: one worker process per core, {cpu_cores()} here, "
        "each with the run's threads, so where those are fewer than the cores it uses more of them than the other "
        "rows and its ratios are not per core; graphed, GPU only). "
        "limit = the same images trained as one model in batches of K x B (K sampled clients, "
        "batch B): what clients with their own weights cannot beat in the same loop"
        + ("; captured limit = the same with its step captured as a CUDA graph (eager training launches every "
           "kernel from Python, which can bound a small model's limit by the host)" if cuda else "")
        + "; of limit = the faster limit's s/round over the row's. "
        "GFLOP/s = images/s x the model's forward+backward FLOPs per image."
        + (" peak MiB = GPU memory allocated at most during the timed rounds." if cuda else ""),
        "",
        "| model | data | sampled clients | backend | s/round | images/s | vs reference | of limit | GFLOP/s "
        "| % of peak |" + (" peak MiB |" if cuda else ""),
        "|---|---|---|---|---|---|---|---|---|---|" + ("---|" if cuda else ""),
    ]
    memory: dict[tuple[str, str], dict[int, float]] = {}
    for model in models:
        for sampled in sampled_counts:
            common = measured_setting(base, overrides, model, sampled, synthetic_size, rounds + 1)
            results, flops = {}, None
            for backend in ("reference", *backends, "limit", *([CAPTURED_LIMIT] if cuda else [])):
                pick = {"reference": ["run.channels_last=false"], "limit": [], CAPTURED_LIMIT: []}.get(
                    backend, [f"run.backend={backend}"])
                cfg = load_config(config, [*common, *pick])
                sim = prepare(cfg)
                flops = flops or train_flops_per_image(sim)
                results[backend] = time_backend(sim, backend, rounds)
            ref = results["reference"]["s_per_round"]
            limit = min(results[b]["s_per_round"] for b in ("limit", CAPTURED_LIMIT) if b in results)
            for backend, r in results.items():
                gflops = r["images_per_s"] * flops / 1e9
                lines.append(f"| {model} | {cfg.data.dataset} | {sampled} | {backend} | {r['s_per_round']:.3f} "
                             f"| {r['images_per_s']:.0f} | {ref / r['s_per_round']:.2f}x "
                             f"| {100 * limit / r['s_per_round']:.0f}% | {gflops:.1f} | {100 * gflops / peak:.1f} |"
                             + (f" {r['peak_mib']:.0f} |" if cuda else ""))
                echo(lines[-1])
                if cuda:
                    memory.setdefault((model, backend), {})[sampled] = r["peak_mib"]
    if len(sampled_counts) > 1 and memory:
        low, high = min(sampled_counts), max(sampled_counts)
        lines += ["", f"Peak GPU memory per extra sampled client ({low} to {high} clients): "
                  + "; ".join(f"{model} {backend} {(mib[high] - mib[low]) / (high - low):.1f} MiB"
                              for (model, backend), mib in memory.items()) + "."]
    if not k_table:
        return "\n".join(lines)
    k_rounds = max(rounds, 5)  # short rounds: time more of them
    lines += ["", f"### K = 10 vs 1,000 clients, 10 sampled per round, the same data per client "
              f"({base.model.name}, {base.data.dataset}, IID, IF = 1; K = 10 keeps 1% of the training set); "
              f"{k_rounds} timed rounds", "",
              "| K | participation | data.train_fraction | backend | s/round | images/round | images/s "
              "| per-client state on the server (bytes) |", "|---|---|---|---|---|---|---|---|"]
    for k in (10, 1000):
        for backend in backends:
            cfg = load_config(config, [*overrides, f"fl.rounds={k_rounds + 1}", f"data.num_clients={k}",
                                       "data.partition=iid", "data.min_client_size=0", "data.equal_size=false",
                                       "data.imbalance_factor=1", f"data.train_fraction={k / 1000:g}",
                                       f"fl.participation={10 / k:g}", f"run.backend={backend}"])
            sim = prepare(cfg)
            r = time_backend(sim, backend, k_rounds)
            lines.append(f"| {k} | {10 / k:g} | {k / 1000:g} | {backend} | {r['s_per_round']:.3f} "
                         f"| {r['images_per_round']:.0f} | {r['images_per_s']:.0f} | {state_bytes(sim.client_states)} |")
            echo(lines[-1])
    return "\n".join(lines)


def state_bytes(tree) -> int:
    """Bytes of the tensors in a nested state (what the engine keeps per client between rounds)."""
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    if isinstance(tree, dict):
        return sum(state_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(state_bytes(v) for v in tree)
    return 0
