"""Large CPU buffers kept for reuse when freed, so each batch does not fault in fresh pages.

glibc's malloc hands every allocation above its mmap threshold (at most 32 MiB, adapting upward from
128 KiB) straight from the kernel and gives it back when freed. An evaluation batch of 1000 images
makes activations of about 100 MB, so every batch's buffers came back as new pages that the kernel
zero-filled one page fault at a time: on the small CNN that was most of a run's system time (3.8 of
19.5 s for three evaluated rounds of the reference protocol, 0.6 of 15 s with the buffers kept).
Raising the mmap and trim thresholds keeps them in the heap. Where memory comes from never changes a
number; the process keeps up to its peak heap. Linux with glibc only; elsewhere nothing changes.
"""

from __future__ import annotations

import ctypes
import sys

#: glibc's ``mallopt`` parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: allocations up to this size come from the heap, and freed memory up to this much is kept
MMAP_THRESHOLD, TRIM_THRESHOLD = 256 << 20, 512 << 20

_kept = False


def keep_freed_buffers() -> bool:
    """Set the thresholds once per process; whether they are set (False off glibc)."""
    global _kept
    if _kept or not sys.platform.startswith("linux"):
        return _kept
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    _kept = bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _kept
