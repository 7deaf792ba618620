"""Keeping freed host memory for reuse, so that each training step does not page-fault it back.

glibc serves large allocations (an 8 MB gradient, a batch of activations) with mmap
and returns them to the OS on free, so the next step's allocation of the same size
is zero-filled page by page again. Its threshold for that adapts at run time, and an
evaluation pass or a checkpoint between epochs moves it. Fixing the mmap threshold at
32 MB (glibc's maximum) and the trim threshold at 128 MB keeps such blocks in the heap.
Measured on the `make bench` job: 2,023 against 1,766 samples/s (medians of 4
alternating pairs, see BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
MMAP_THRESHOLD = 32 << 20
TRIM_THRESHOLD = 128 << 20
# The same settings as glibc reads them from the environment: a user who sets either keeps
# their own, and a process that does not import hvdtrain can be given ours (make bench).
AS_ENVIRONMENT = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "MALLOC_TRIM_THRESHOLD_": str(TRIM_THRESHOLD)}


def keep_freed_memory() -> bool:
    """Sets glibc's thresholds; True when set. Leaves a user's own MALLOC_* settings alone."""
    if not sys.platform.startswith("linux") or any(name in os.environ for name in AS_ENVIRONMENT):
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc (musl, say): its allocator behaves otherwise
        return False
    return bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
