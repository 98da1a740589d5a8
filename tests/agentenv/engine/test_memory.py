"""Freed C-heap memory goes back to the system (glibc's malloc_trim)."""

from __future__ import annotations

import ctypes
import sys

import pytest

from agentenv.engine import release_freed_memory

BLOCK = 100 * 1024  # below glibc's mmap threshold: from the heap


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_freed_heap_blocks_leave_the_resident_set() -> None:
    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(400)]  # 40 MB
    for b in blocks:
        ctypes.memset(b, 1, BLOCK)
    for b in blocks[:-1]:  # the last one stays: free() cannot shrink the heap's top
        libc.free(b)
    before = _rss()
    assert release_freed_memory() is True
    after = _rss()
    libc.free(blocks[-1])
    assert before - after > 30 * 2**20, (before, after)
