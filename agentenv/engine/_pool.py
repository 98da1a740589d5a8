"""The key/value pool: memory that follows the live tokens, allocated once.

As SGLang's ``TokenToKVPool`` and ``ReqToTokenPool``: :class:`KVPool` holds the keys and
values of ``size`` tokens (``kv``: ``[layers, 2, kv_heads, size + 1, head_dim]``) and hands
out token slots (slot 0 never: padding rows write their keys there, unused table entries
point at it). A sequence's row of :attr:`KVPool.table` lists the slots of its positions,
and the forward passes gather keys and values by those indices. The tensors never move
or grow, so captured CUDA graphs stay valid; a slot is free again when nothing refers to
it (the requests and the prefix cache, :mod:`agentenv.engine._radix`, count references).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from agentenv._errors import ConfigError

__all__ = ["KVPool", "bytes_per_token"]


def bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Key and value bytes of one token over every layer."""
    size = torch.empty(0, dtype=dtype).element_size()
    return int(2 * config.num_layers * config.num_kv_heads * config.head_dim * size)


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros (finite: a masked key's value is multiplied by 0, never NaN). On CPU from
    ``calloc`` (numpy), whose pages the system maps, and counts in the RSS, only once
    written: a pool sized for many tokens costs the memory of those actually used."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
    raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    return raw.view(dtype).view(shape)


class KVPool:
    """``size`` tokens' keys and values, a free list, and the slot table of ``rows`` rows."""

    def __init__(
        self,
        config: Any,
        size: int,
        rows: int,
        context_length: int,
        dtype: torch.dtype,
        device: Any,
    ) -> None:
        if size < 1:
            raise ConfigError(f"the key/value pool needs at least 1 token, got {size}")
        self.size = size
        self.rows = rows
        self.context_length = context_length
        self.dtype = dtype
        self.device = torch.device(device)
        # Per layer the keys' heads, then the values', each [slots, head_dim]: one gather
        # reads both, into the [heads, sequences, positions, head_dim] order the
        # attention's matrix products read in place.
        shape = (config.num_layers, 2, config.num_kv_heads, size + 1, config.head_dim)
        self.kv = _zeros(shape, dtype, self.device)
        self.table = torch.zeros((rows, context_length), dtype=torch.int64, device=self.device)
        # Lowest slots first (popped from the end), so a small load touches few pages.
        self._free = list(range(size, 0, -1))
        self._refs = [0] * (size + 1)

    @property
    def available(self) -> int:
        """Slots free now."""
        return len(self._free)

    def alloc(self, n: int) -> list[int]:
        """``n`` free slots (each with one reference); raises when fewer are free."""
        if n > len(self._free):
            raise MemoryError(f"the key/value pool has {len(self._free)} free slots, {n} asked")
        if n == 0:
            return []
        out = self._free[-n:]
        del self._free[-n:]
        refs = self._refs
        for s in out:
            refs[s] = 1
        return out

    def share(self, slots: list[int]) -> None:
        """One more reference to each of ``slots``."""
        refs = self._refs
        for s in slots:
            refs[s] += 1

    def release(self, slots: list[int]) -> None:
        """Drop one reference to each of ``slots``; a slot nobody refers to is free again."""
        refs, free = self._refs, self._free
        for s in slots:
            refs[s] -= 1
            if refs[s] == 0:
                free.append(s)

    def set_row(self, row: int, start: int, slots: list[int]) -> None:
        """Table row ``row``, positions ``start ..``: ``slots``."""
        if slots:
            values = torch.tensor(slots, dtype=torch.int64)
            self.table[row, start : start + len(slots)].copy_(values, non_blocking=True)

    def set_cells(self, rows: list[int], cols: list[int], slots: list[int]) -> None:
        """Table cells ``(rows[i], cols[i])``: ``slots[i]`` (a decode step's new slots,
        one write for the whole batch)."""
        if slots:
            cells = torch.tensor([rows, cols, slots], dtype=torch.int64)
            cells = cells.to(self.table.device, non_blocking=True)
            self.table[cells[0], cells[1]] = cells[2]

    def move_row(self, src: int, dst: int, length: int) -> None:
        self.table[dst, :length] = self.table[src, :length]
