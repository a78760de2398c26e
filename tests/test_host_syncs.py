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
