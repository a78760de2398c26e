"""Client sampling and learning-rate schedules, fixed up front from the config."""

from __future__ import annotations

import math

from fedlt.config import FLConfig
from fedlt.seeding import numpy_rng


def sampling_schedule(seed: int, num_clients: int, per_round: int, rounds: int) -> list[list[int]]:
    """The sampled clients of every round (sorted ids), drawn once from the ``sampling`` stream.

    Drawing the whole sequence up front means every method — whatever else it draws — trains
    the same clients in the same rounds, and a resumed run continues the same sequence.
    """
    rng = numpy_rng(seed, "sampling")
    return [sorted(int(c) for c in rng.choice(num_clients, size=per_round, replace=False)) for _ in range(rounds)]


def lr_at(fl: FLConfig, rnd: int) -> float:
    """Learning rate of round ``rnd`` (1-based) under the configured schedule."""
    if fl.lr_schedule == "cosine":
        return fl.lr * 0.5 * (1 + math.cos(math.pi * (rnd - 1) / fl.rounds))
    if fl.lr_schedule == "step":
        passed = sum(1 for frac in fl.lr_decay_at if rnd > frac * fl.rounds)
        return fl.lr * fl.lr_decay**passed
    return fl.lr
