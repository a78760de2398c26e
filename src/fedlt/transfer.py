"""Host-to-device copies that never make the host wait.

A copy from ordinary (pageable) host memory to a GPU returns only when the device has it, so the host
stops queueing work until the device catches up. Copied from pinned memory without blocking, it is
queued like a kernel; the pinned buffer is kept until the copy is done (torch's host allocator
records it on the stream)."""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: np.ndarray | list[int], device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A new ``dtype`` tensor of ``values`` on ``device`` (never sharing memory with ``values``)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
