"""What the host does per graphed client besides its captured step, counted on any device: the host
synchronisations of a round (fedlt.bench.host_syncs.HostSyncs), the torch operations it dispatches
per client and the tensors they make (batch making, the client's start and reply, the aggregation),
with the step itself replaced by nothing, and the time that takes per client. On a GPU each operation is host
time (a kernel launch or an allocation) and each synchronisation stalls the host until the device
catches up; on a CPU the time also holds the copies' arithmetic. With --profile it also lists the
Python functions that take most of that time (their own time, per client, in one more round).
Where the paths chosen for a GPU and a CPU differ (a reply's state packed in one buffer per dtype, the
aggregation's products rewritten in place), --as-on=gpu takes the GPU's on any device and --as-on=cpu
the CPU's, to count the GPU's operations on a CPU or time both on one GPU.

    python scripts/client_host_work.py [CLIENTS] [--profile] [--as-on=cpu|gpu] [override ...]
    e.g. python scripts/client_host_work.py 40 model.name=resnet32
"""

from __future__ import annotations

import cProfile
import pstats
import sys
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fedlt.api import prepare
from fedlt.bench.host_syncs import HostSyncs
from fedlt.config import load_config
from fedlt.errors import FedltError
from fedlt.methods import aggregation
from fedlt.training import graphed


TIMED_ROUNDS = 5
PROFILE_ROWS = 20


class Operations(TorchDispatchMode):
    """The operations dispatched, and the tensors they make in new memory (outputs whose storage is none
    of their inputs'; views are not counted): on a GPU each is an allocation from the caching allocator."""

    def __init__(self) -> None:
        super().__init__()
        self.count: Counter[str] = Counter()
        self.made = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count[str(func)] += 1
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        inputs = {t.untyped_storage().data_ptr() for t in tensors}
        self.made += sum(isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in inputs
                         for t in tree_flatten(out)[0])
        return out


def main(clients: int, overrides: list[str], profile: bool = False, as_on: str | None = None) -> None:
    if as_on is not None:  # the devices on which each of those paths is taken
        graphed.PACKED_ON = aggregation.REWRITTEN_ON = frozenset({"cpu", "cuda"} if as_on == "gpu" else ())
    cfg = load_config(None, ["data.dataset=synthetic", "data.image_size=32", "data.partition=iid",
                             "data.imbalance_factor=1", f"data.num_clients={clients}", "fl.participation=1.0",
                             "fl.local_epochs=2", "model.name=resnet8", "run.backend=graphed", "run.threads=1",
                             *overrides, f"fl.rounds={4 + TIMED_ROUNDS}"])
    sim = prepare(cfg)
    a = getattr(sim.client, "args", None)
    if cfg.method == "fedyoyo" and a.dla and a.prior_source == "estimated" and a.prior_features == "train":
        raise FedltError("FedYoYo's estimated prior reads the features of the step this script leaves out; "
                         "add method_args.prior_source=counts")
    sim.setup()
    graphed.GraphedTrainer._run_step = lambda *args: None  # everything but the step itself
    sim.fit_round(1)
    with HostSyncs() as syncs:
        sim.fit_round(2)
    with Operations() as ops:
        sim.fit_round(3)
    seconds = []
    for rnd in range(4, 4 + TIMED_ROUNDS):
        start = time.perf_counter()
        sim.fit_round(rnd)
        seconds.append(time.perf_counter() - start)
    print(f"{cfg.model.name}, {clients} clients, {cfg.method}, {sim.device}: "
          f"{syncs.total} host synchronisations a round {dict(syncs.calls)}; "
          f"{sum(ops.count.values()) / clients:.1f} operations per client, making {ops.made / clients:.1f} tensors "
          "in new memory; "
          f"most frequent: {ops.count.most_common(5)}; "
          f"{1000 * min(seconds) / clients:.2f} ms per client (the fastest of {TIMED_ROUNDS} rounds)")
    if profile:
        profiler = cProfile.Profile()
        profiler.runcall(sim.fit_round, 4 + TIMED_ROUNDS)
        stats = pstats.Stats(profiler).stats
        rows = sorted(stats.items(), key=lambda item: -item[1][2])[:PROFILE_ROWS]
        print(f"profiled round, own time per client (us), calls per client, function:")
        for (path, line, name), (_, calls, own, _, _) in rows:
            where = f"{path.split('site-packages/')[-1].split('src/')[-1]}:{line}" if line else path
            print(f"  {1e6 * own / clients:8.1f} {calls / clients:7.1f}  {name} ({where})")


if __name__ == "__main__":
    arguments = [a for a in sys.argv[1:] if a != "--profile" and not a.startswith("--as-on")]
    count = arguments[0] if arguments else "40"
    paths = [a for a in sys.argv[1:] if a.startswith("--as-on")]
    try:
        if not count.isdigit() or int(count) < 1:
            raise FedltError(f"CLIENTS must be a whole number of at least 1, got '{count}'")
        if paths and paths[-1] not in ("--as-on=cpu", "--as-on=gpu"):
            raise FedltError(f"{paths[-1]}: write --as-on=cpu or --as-on=gpu")
        main(int(count), arguments[1:], profile="--profile" in sys.argv,
             as_on=paths[-1].removeprefix("--as-on=") if paths else None)
    except FedltError as error:
        print(f"client_host_work: error: {error}", file=sys.stderr)
        sys.exit(2)
