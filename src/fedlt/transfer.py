"""Host-to-device copies that never make the host wait.

A copy from ordinary (pageable) host memory to a GPU returns only when the device has it, so the host
stops queueing work until the device catches up. Copied from pinned memory without blocking, it is
queued like a kernel; the pinned buffer is kept until the copy is done (torch's host allocator
records it on the stream)."""

from __future__ import annotations

import numpy as np
import torch


def to_device(values: np.ndarray | list[int] | torch.Tensor, device: torch.device | str,
              dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """A new ``dtype`` tensor of ``values`` (host data: a list, an array or a CPU tensor) on ``device``,
    never sharing memory with ``values``."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"to_device copies host data; got a tensor on {values.device}")
        host = values.detach().to(dtype, copy=True)
    else:
        host = torch.tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def to_host(values: torch.Tensor) -> np.ndarray:
    """A NumPy copy of ``values`` on the host: free for a host tensor (a payload sent by an in-process
    server); one that arrived on a device (a Flower node's decoded message, a resumed state) is read
    back, which waits for it."""
    return values.detach().to("cpu", copy=True).numpy()
