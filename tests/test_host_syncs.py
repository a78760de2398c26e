"""No host synchronisation inside a local epoch: the host never waits for the device per batch.

Counted on the CPU by :class:`fedlt.bench.host_syncs.HostSyncs` (the same calls synchronise on a
GPU): a round with three local epochs makes no more of them than a round with one.
"""

from __future__ import annotations

import pytest
import torch

from fedlt.api import prepare
from fedlt.bench.host_syncs import HostSyncs
from fedlt.config import load_config

SMALL = ["data.dataset=synthetic", "data.num_clients=4", "fl.participation=0.5", "data.imbalance_factor=10",
         "fl.batch_size=16", "run.device=cpu", "run.threads=1", "fl.rounds=2"]


def round_syncs(overrides: list[str], epochs: int) -> HostSyncs:
    sim = prepare(load_config(None, [*SMALL, *overrides, f"fl.local_epochs={epochs}"]))
    sim.setup()
    with HostSyncs() as syncs:
        sim.fit_round(1)
    sim.close()
    return syncs


@pytest.mark.parametrize("overrides", [
    ["method=fedavg"],
    ["method=fedavg", "loss.name=bsm", "data.augment=weak"],
    ["method=fedavg", "loss.name=ldam", "fl.grad_clip=1.0"],
    ["method=fedavg", "loss.name=bsm", "run.backend=vectorized"],
    ["method=fedprox"],
    ["method=fedloge", "method_args.sse_steps=50"],  # SSE-C runs before training: 50 of its steps will do
    ["method=sfd"],
    ["method=gbme", "loss.name=bsm"],
    ["method=creff"],
    ["method=fedyoyo", "method_args.student_view=weak"],
], ids=lambda o: " ".join(o))
def test_a_local_epoch_never_waits_for_the_device(overrides):
    one, three = round_syncs(overrides, 1), round_syncs(overrides, 3)
    grown = {site: n for site, n in three.calls.items() if n > one.calls.get(site, 0)}
    assert not grown, f"host synchronisations that grow with the local epochs: {grown}"


@pytest.mark.parametrize("overrides", [
    ["method=fedyoyo"],  # the strong view with AutoAugment's CIFAR-10 policy
    ["method=fedyoyo", "method_args.strong_policy=randaugment"],
    ["method=fedavg", "data.augment=strong"],
], ids=lambda o: " ".join(o))
def test_strong_views_as_a_gpu_draws_them_never_wait_for_the_device(monkeypatch, overrides):
    """On a CPU the policies pick the images of each op by index (the host reads their count: free
    there, and the random stream of the committed results); a GPU masks instead. Run that way here."""
    from fedlt.data import augment

    monkeypatch.setattr(augment, "selection_for", lambda x: "mask")
    test_a_local_epoch_never_waits_for_the_device(overrides)


def test_the_counter_sees_reads_masks_and_host_copies():
    x = torch.arange(6.0)
    with HostSyncs() as syncs:
        float(x.sum())
        x[x > 2]
        torch.tensor([1.0, 2.0], device=x.device)
        x[0] = 5.0  # the number is copied from the host
        x[1:3] + torch.as_tensor(x)[:2]  # a slice and a tensor passed through: no synchronisation
        x[2] = x[3]
    assert sorted(name for name, _ in syncs.calls) == ["__float__", "__getitem__", "__setitem__", "tensor"]
    assert all(site.startswith("outside") for _, site in syncs.calls)


@pytest.mark.parametrize("partition", ["dirichlet", "pathological", "iid"])
def test_a_clients_rows_and_class_counts_come_without_waiting_for_the_device(partition):
    """All clients' rows go to the device in one copy, the first time; a client's class counts come
    from the partition's host counts (a copy queued like a kernel on a GPU) and equal its labels' count."""
    sim = prepare(load_config(None, [*SMALL, f"data.partition={partition}", "data.classes_per_client=3"]))
    runtime, data = sim.clients, sim.clients.train_data
    with HostSyncs() as first:
        data.client_indices(0)
    assert first.total == 1  # the one copy of every client's rows
    for cid in range(data.num_clients):
        with HostSyncs() as syncs:
            ctx = runtime.context(cid, 1, {})
            counts = ctx.data.class_counts()
        assert syncs.total == 0, syncs.calls
        assert counts.dtype == torch.int64 and counts.device == ctx.data.labels.device
        assert torch.equal(counts, torch.bincount(ctx.data.labels[ctx.data.indices], minlength=ctx.data.num_classes))
        assert torch.equal(ctx.data.indices.cpu(), torch.as_tensor(data.partition.client_indices[cid]))
    counts = runtime.context(0, 1, {}).data.class_counts()
    counts += 1  # the caller's own tensor: the partition's counts stay as they were
    assert torch.equal(runtime.context(0, 1, {}).data.class_counts() + 1, counts)


@pytest.mark.parametrize("method", ["fedavg", "fedprox"])
def test_a_graphed_round_waits_for_the_device_no_more_often_with_more_clients(method):
    """The graphed backend reads every client's training loss in one copy after the lanes are done,
    and a client's start (rows, class counts, prior) never waits: on a GPU the host makes the next
    clients while the lanes train, and a wait per client would stall it."""
    counts = []
    for clients in (2, 4):
        sim = prepare(load_config(None, [*SMALL, f"data.num_clients={clients}", "fl.participation=1.0",
                                         f"method={method}", "run.backend=graphed"]))
        sim.setup()
        sim.fit_round(1)  # the rows' one copy
        with HostSyncs() as syncs:
            sim.fit_round(2)
        sim.close()
        counts.append(syncs.total)
    assert counts[0] == counts[1], counts


#: methods whose loss holds per-class terms (priors, margins, offsets) made for each client
PER_CLASS_TERMS = [
    ["method=fedavg", "loss.name=bsm"],
    ["method=fedavg", "loss.name=la", "loss.prior=global"],
    ["method=fedavg", "loss.name=ldam"],
    ["method=fedlc"],
    ["method=fedrod"],
    ["method=fedetf"],
    ["method=sfd", "method_args.scl_delta=true"],
    ["method=gbme", "loss.name=bsm"],
    ["method=fedyoyo"],
    ["method=fedyoyo", "method_args.prior=fused_estimate", "method_args.prior_features=train"],
]


@pytest.mark.parametrize("overrides", PER_CLASS_TERMS, ids=lambda o: " ".join(o))
def test_a_clients_start_never_waits_and_its_per_class_terms_land_on_its_device(monkeypatch, overrides):
    """What the host makes for a client before its first step (its context, and its objective with
    the loss's per-class terms: priors, margins, offsets) never waits: the terms are made from the
    host's counts and the server's host tensors, then copied like a kernel. On a GPU the host makes
    the next clients while the lanes train; a wait per client would stall it. And the copies go to
    the client's device: with its data on another one (``meta`` stands in for a GPU), every tensor
    the objective's loss holds is there, not on the host."""
    from dataclasses import replace
    from functools import partial

    sim = prepare(load_config(None, [*SMALL, "fl.rounds=3", "fl.participation=1.0", "run.backend=graphed", *overrides]))
    sim.setup()
    sim.fit_round(1)  # the rows' one copy, the server's priors
    syncs, made = HostSyncs(), []

    def counted(make):
        def counted_make(*args):
            with syncs:
                made.append(make(*args))
            return made[-1]
        return counted_make

    with monkeypatch.context() as patch:
        patch.setattr(sim, "_context", counted(sim._context))
        patch.setattr(sim.client, "local_objective", counted(sim.client.local_objective))
        sim.fit_round(2)
    objectives = [m for m in made if not hasattr(m, "data")]
    assert len(objectives) == 4 and all(o is not None for o in objectives)  # every client trained graphed
    assert syncs.total == 0, syncs.calls

    cid = sim.server.select_clients(3, sim.schedule[2])[0]
    msg, ctx = sim.server.fit_message(3, cid), sim._context(cid, 3)
    ctx.data = replace(ctx.data, **{k: getattr(ctx.data, k).to("meta") for k in ("images", "labels", "indices")})
    monkeypatch.setattr(ctx, "generator", lambda purpose: torch.Generator())  # meta has no generator
    ctx.model.to("meta")  # the model is where the data are (FedYoYo embeds them before training)
    objective = sim.client.local_objective(ctx, msg)
    sim.close()

    def held(fn):
        while isinstance(fn, partial):
            yield from (v for v in fn.keywords.values() if isinstance(v, torch.Tensor))
            yield from (t for v in fn.keywords.values() if callable(v) for t in held(v))
            fn = fn.func

    tensors = [*held(objective.loss), *(objective.step_tensors(1).values() if objective.step_tensors else ())]
    assert tensors, "the objective holds no per-class term"
    assert all(t.device.type == "meta" for t in tensors), [(t.shape, t.device) for t in tensors]


def test_the_host_work_script_counts_a_graphed_clients_operations_and_profiles_them():
    """scripts/client_host_work.py (run on a GPU by scripts/gpu_speed.sh host-work): one wait a round, the
    operations and time per client, and the profile's rows per client."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "scripts" / "client_host_work.py"
    done = subprocess.run([sys.executable, str(script), "3", "--profile", "model.name=cnn", "data.image_size=16",
                           "run.device=cpu"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    first, heading, *rows = done.stdout.splitlines()
    assert first.startswith("cnn, 3 clients, fedavg, cpu: 1 host synchronisations a round")
    assert re.search(r"; [0-9.]+ operations per client, making [0-9.]+ tensors in new memory; .*; [0-9.]+ ms per "
                     r"client", first)
    assert heading.startswith("profiled round") and len(rows) == 20
    assert all(re.match(r" +[0-9.]+ +[0-9.]+  \S", row) for row in rows)
    # the GPU's paths, taken on the CPU: a reply's state in one buffer, the products rewritten in place
    as_on_gpu = subprocess.run([sys.executable, str(script), "3", "--as-on=gpu", "model.name=cnn", "data.image_size=16",
                                "run.device=cpu"], capture_output=True, text=True, timeout=300)
    made = [float(re.search(r"making ([0-9.]+) tensors", line).group(1)) for line in (first, as_on_gpu.stdout)]
    assert as_on_gpu.returncode == 0 and made[0] - made[1] >= 7, made  # the CNN's 8 tensors a reply in one buffer
    refused = subprocess.run([sys.executable, str(script), "0"], capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and refused.stderr.strip().endswith("at least 1, got '0'")
