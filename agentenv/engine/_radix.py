"""The prefix cache: a radix tree over token ids whose values are key/value pool slots.

SGLang's RadixAttention, one token per page: every edge is a run of token ids with the
pool slots holding their keys and values. A new request takes the longest cached prefix
of its prompt (:meth:`RadixCache.match`) and computes only the rest; a finished request's
tokens go into the tree (:meth:`RadixCache.insert`), so the ``n`` samples of a GRPO group
share their prompt and the next turn of an episode reuses the previous turn. A node in
use by a running request is locked; unlocked leaves are evicted least recently used
first when the pool needs room (:meth:`RadixCache.evict`). The tree holds one pool
reference per slot it stores (see :class:`~agentenv.engine._pool.KVPool`), so dropping a
whole tree (:meth:`RadixCache.drop`, after a weight update) frees what no request uses.
"""

from __future__ import annotations

import heapq
import itertools

from agentenv.engine._pool import KVPool

__all__ = ["Node", "RadixCache"]


class Node:
    __slots__ = ("children", "key", "last", "lock", "parent", "value")

    def __init__(self, parent: Node | None, key: list[int], value: list[int]) -> None:
        self.parent = parent
        self.key = key
        self.value = value
        self.children: dict[int, Node] = {}
        self.lock = 0
        self.last = 0


class RadixCache:
    """Cached prefixes of token sequences, their keys and values in ``pool``."""

    def __init__(self, pool: KVPool) -> None:
        self.pool = pool
        self.root = Node(None, [], [])
        self.root.lock = 1  # never evicted
        self.size = 0  # tokens stored
        self.protected = 0  # tokens in locked nodes
        self._clock = itertools.count(1)
        self.dead = False

    @property
    def evictable(self) -> int:
        """Tokens that eviction could free (in nodes no running request uses)."""
        return self.size - self.protected

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node``'s edge after ``at`` tokens; return the new upper part."""
        parent = node.parent
        assert parent is not None
        upper = Node(parent, node.key[:at], node.value[:at])
        upper.lock, upper.last = node.lock, node.last
        upper.children[node.key[at]] = node
        parent.children[node.key[0]] = upper
        node.parent = upper
        node.key, node.value = node.key[at:], node.value[at:]
        return upper

    def match(self, tokens: list[int]) -> tuple[list[int], Node]:
        """The slots of the longest cached prefix of ``tokens`` and its last node."""
        node, i, slots = self.root, 0, []
        tick = next(self._clock)
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            key = child.key
            m = 0
            limit = min(len(key), len(tokens) - i)
            while m < limit and key[m] == tokens[i + m]:
                m += 1
            if m < len(key):
                child = self._split(child, m)
            child.last = tick
            slots.extend(child.value)
            node, i = child, i + m
            if m < len(key):
                break
        return slots, node

    def insert(self, tokens: list[int], slots: list[int]) -> tuple[list[int], Node]:
        """Store ``tokens`` with their ``slots``; where a prefix is cached already the
        tree keeps its own slots. Returns the tree's slots for all of ``tokens`` (the
        caller swaps its duplicates for them) and the last node."""
        have, node = self.match(tokens)
        n = len(have)
        if n < len(tokens):
            rest_key, rest = tokens[n:], slots[n:]
            leaf = Node(node, rest_key, rest)
            leaf.last = next(self._clock)
            node.children[rest_key[0]] = leaf
            self.pool.share(rest)
            self.size += len(rest)
            node = leaf
            have = have + rest
        return have, node

    def lock(self, node: Node) -> None:
        if self.dead:
            return
        while node is not self.root and node is not None:
            if node.lock == 0:
                self.protected += len(node.key)
            node.lock += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: Node) -> None:
        if self.dead:
            return
        while node is not self.root and node is not None:
            node.lock -= 1
            if node.lock == 0:
                self.protected -= len(node.key)
            assert node.parent is not None
            node = node.parent

    def evict(self, n: int) -> int:
        """Drop least recently used unlocked leaves until ``n`` slots are free again (or
        nothing more can go); return how many slots were freed."""
        pool = self.pool
        start = pool.available
        nodes = self._nodes()
        leaves = [(x.last, id(x), x) for x in nodes if not x.children and not x.lock]
        heapq.heapify(leaves)
        while leaves and pool.available - start < n:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            pool.release(node.value)
            self.size -= len(node.value)
            if parent is not self.root and not parent.children and not parent.lock:
                heapq.heappush(leaves, (parent.last, id(parent), parent))
        return pool.available - start

    def drop(self) -> None:
        """Give back every slot the tree holds (those requests still use stay theirs). The
        tree is dead after it: requests that locked its nodes may still unlock them, and
        the engine starts a new tree."""
        for node in self._nodes():
            self.pool.release(node.value)
        self.root.children.clear()
        self.size = self.protected = 0
        self.dead = True

    def _nodes(self) -> list[Node]:
        out, stack = [], list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out
