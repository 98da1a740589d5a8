"""Freed C-heap memory back to the system between the phases of a CPU run.

glibc keeps the memory of freed blocks in its heaps, one per thread that allocated it: a
training step's freed activations and gradients stay resident while the engine's thread
samples the next rollout in a heap of its own, and the process's peak is the sum of both.
``malloc_trim`` returns every heap's free pages to the system.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Any

__all__ = ["release_freed_memory"]


@functools.cache
def _malloc_trim() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the process's C library (glibc)
    except (OSError, AttributeError):  # another C library (musl has none)
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_freed_memory() -> bool:
    """Return the free memory of every C heap to the system; False where the C library
    cannot (not glibc). Costs milliseconds: call it between phases, not per tensor."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
