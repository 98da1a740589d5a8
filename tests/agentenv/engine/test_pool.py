"""The key/value pool's slots and references, and the radix tree of cached prefixes
(matching, splitting, locking, least-recently-used eviction, dropping)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from agentenv import ConfigError
from agentenv.engine._pool import KVPool, bytes_per_token
from agentenv.engine._radix import RadixCache

CONFIG = SimpleNamespace(num_layers=2, num_kv_heads=1, head_dim=4)


def _pool(size: int) -> KVPool:
    return KVPool(CONFIG, size, rows=2, context_length=64, dtype=torch.float32, device="cpu")


def test_slots_are_freed_when_their_last_reference_goes() -> None:
    pool = _pool(4)
    assert pool.kv.shape == (2, 2, 1, 5, 4) and not pool.kv.any()  # slot 0: the spare
    a = pool.alloc(3)
    assert 0 not in a and pool.available == 1
    pool.share(a[:2])
    pool.release(a)
    assert pool.available == 2  # a[2] is free, a[:2] still shared
    pool.release(a[:2])
    assert pool.available == 4
    with pytest.raises(MemoryError, match="4 free slots, 5 asked"):
        pool.alloc(5)
    assert bytes_per_token(CONFIG, torch.bfloat16) == 2 * 2 * 1 * 4 * 2
    with pytest.raises(ConfigError, match="at least 1 token"):
        _pool(0)


def test_the_tree_shares_prefixes_and_splits_edges() -> None:
    pool = _pool(32)
    tree = RadixCache(pool)
    s1 = pool.alloc(5)
    have, _ = tree.insert([1, 2, 3, 4, 5], s1)
    assert have == s1 and tree.size == 5
    pool.release(s1)  # the tree's references keep them
    assert pool.available == 27
    got, _ = tree.match([1, 2, 3, 9])
    assert got == s1[:3]  # the edge was split after 3 tokens
    s2 = pool.alloc(6)
    have, _ = tree.insert([1, 2, 3, 7, 8, 9], s2)
    assert have == s1[:3] + s2[3:] and tree.size == 8  # the cached start kept its slots
    pool.release(s2)
    assert pool.available == 32 - 8
    assert tree.match([1, 2, 3, 4, 5, 6])[0] == s1
    assert tree.match([5])[0] == []


def test_eviction_takes_unlocked_leaves_least_recently_used_first() -> None:
    pool = _pool(12)
    tree = RadixCache(pool)
    for tokens in ([1, 2, 3], [4, 5, 6], [7, 8, 9]):
        slots = pool.alloc(3)
        tree.insert(tokens, slots)
        pool.release(slots)
    assert pool.available == 3 and tree.evictable == 9
    _, used = tree.match([4, 5, 6])  # the most recent now
    tree.lock(used)
    assert tree.evictable == 6
    assert tree.evict(3) == 3
    assert tree.match([1, 2, 3])[0] == []  # the oldest went
    assert len(tree.match([7, 8, 9])[0]) == 3
    assert tree.evict(100) == 3  # the locked one stays
    assert len(tree.match([4, 5, 6])[0]) == 3 and tree.evictable == 0
    tree.unlock(used)
    assert tree.evict(100) == 3 and pool.available == 12 and tree.size == 0


def test_a_dropped_tree_frees_what_no_request_holds() -> None:
    pool = _pool(8)
    tree = RadixCache(pool)
    slots = pool.alloc(4)
    _, node = tree.insert([1, 2, 3, 4], slots)
    tree.lock(node)
    tree.drop()
    assert pool.available == 4  # the request's references keep its slots
    tree.unlock(node)  # unlocking on a dropped tree changes nothing
    assert tree.size == 0 and tree.match([1, 2])[0] == []
    pool.release(slots)
    assert pool.available == 8
