"""Independent random streams derived from one config seed.

Separate streams mean that, e.g., changing the model does not change the data split, every
method sees the same partition and the same sampled clients in the same order, and a client's
training randomness depends only on (seed, round, client) — so a resumed run equals an
uninterrupted one.
"""

from __future__ import annotations

import numpy as np
import torch

STREAMS = {"data": 0, "sampling": 1, "model": 2, "train": 3, "local_test": 4, "server": 5, "secagg": 6, "worker": 7,
           "class_order": 8, "validation": 9,
           "local_val": 10}


def seed_for(seed: int, stream: str, *keys: int) -> int:
    """A 63-bit integer seed for ``stream`` and optional sub-keys (round, client id, ...)."""
    sequence = np.random.SeedSequence([seed, STREAMS[stream], *keys])
    return int(sequence.generate_state(1, dtype=np.uint64)[0]) >> 1


def numpy_rng(seed: int, stream: str, *keys: int) -> np.random.Generator:
    return np.random.default_rng(seed_for(seed, stream, *keys))


def torch_generator(seed: int, stream: str, *keys: int, device: torch.device | str = "cpu") -> torch.Generator:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed_for(seed, stream, *keys))
    return gen
