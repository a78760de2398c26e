"""Named ranges of a local training step, which ``fedlt bench profile`` reads from torch's profiler.

A range costs a few microseconds when a profiler runs and nothing otherwise (one flag read), so
the training loops can always mark them.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch.autograd.profiler as _profiler
from torch.profiler import record_function

BATCH = "fedlt/batch"  # gather, augment and standardise the batch
FORWARD = "fedlt/forward+loss"
BACKWARD = "fedlt/backward"
GRADIENT = "fedlt/forward+backward"  # the vectorized backend's vmap of both
OPTIMIZER = "fedlt/optimizer"  # clipping and the SGD update


def scope(name: str) -> AbstractContextManager:
    return record_function(name) if _profiler._is_profiler_enabled else nullcontext()
