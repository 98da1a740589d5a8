"""CUDA graphs for the decode step: one kernel launch per step instead of hundreds.

A decode step of a small model is bound by kernel launches, not by the GPU's arithmetic.
:class:`DecodeGraphs` captures :meth:`LlamaModel._decode <agentenv.engine._model.LlamaModel>`
once per (batch-size bucket, attended-length bucket: the smallest power-of-two multiple of
:data:`~agentenv.engine._model.KEY_BLOCK` covering the longest sequence) and replays it.
A graph reads its inputs from fixed buffers and the key/value pool and its slot table,
which never move, and writes its logits into one buffer that every graph shares (a
graph's own output would stay allocated in the graphs' memory pool, one ``[b, V]``
float32 tensor per graph). Rows past the live batch write their keys to pool slot 0,
which no sequence uses. A reallocated pool (memory released and taken back) is captured
again.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from agentenv.engine._model import LlamaModel
    from agentenv.engine._pool import KVPool

__all__ = ["DecodeGraphs"]


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then steps of 8 up to 64, of 16 beyond."""
    sizes = {1, 2, 4, 8, max_batch}
    sizes.update(range(8, min(max_batch, 64) + 1, 8))
    sizes.update(range(64, max_batch + 1, 16))
    return sorted(s for s in sizes if s <= max_batch)


def lengths(context: int, block: int) -> list[int]:
    """Attended lengths that get a graph: block, 2 * block, 4 * block, ... up to the
    table's width (``context`` rounded up to a block)."""
    top = -(-context // block) * block
    out, n = [], block
    while n < top:
        out.append(n)
        n *= 2
    out.append(top)
    return out


class DecodeGraphs:
    """The captured decode graphs of one model and key/value pool (CUDA only)."""

    def __init__(self, model: LlamaModel, max_batch: int, context: int) -> None:
        from agentenv.engine._model import KEY_BLOCK

        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.buckets = buckets(max_batch)
        self.lengths = lengths(context, KEY_BLOCK)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._key: tuple[int, ...] = ()
        # Token ids, positions and slots, one row each: a step's inputs are one copy.
        self._inputs = torch.zeros((3, max_batch), dtype=torch.int64, device=model.device)
        self._ids, self._pos, self._slots = self._inputs
        # Outside the graphs' pool: it outlives a recapture.
        self._logits = torch.empty(
            (max_batch, model.config.vocab_size), dtype=torch.float32, device=model.device
        )
        self.captures = 0

    def decode(
        self, ids: list[int], positions: list[int], slots: list[int], pool: KVPool
    ) -> torch.Tensor:
        """Like the eager decode: logits [len(ids), V] float32 (a view, valid until the next
        call)."""
        model = self.model
        key = (pool.kv.data_ptr(), pool.table.data_ptr(), model._cos.data_ptr())
        if key != self._key:  # reallocated: the old graphs read stale memory
            self._graphs.clear()
            self._pool = torch.cuda.graph_pool_handle()  # the old pool goes with them
            self._key = key
        n = len(ids)
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        length = self.lengths[bisect.bisect_left(self.lengths, max(positions) + 1)]
        entry = self._graphs.get((b, length))
        if entry is None:
            entry = self._graphs[(b, length)] = self._capture(b, length, pool)
        graph, out = entry
        pad = [0] * (self._inputs.shape[1] - n)  # rows past the batch: token 0 into slot 0
        self._inputs.copy_(
            torch.tensor([ids + pad, positions + pad, slots + pad]), non_blocking=True
        )
        graph.replay()
        return out[:n]

    def _capture(
        self, b: int, length: int, pool: KVPool
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        model = self.model
        ids, pos, slots = self._ids[:b], self._pos[:b], self._slots[:b]
        ids.zero_()
        pos.zero_()
        slots.zero_()  # every row writes to the spare slot 0
        with torch.cuda.device(model.device):  # capture on the model's GPU, not cuda:0
            side = torch.cuda.Stream(device=model.device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(model.device))
            with torch.cuda.stream(side):  # warm-up: lazy initialisations outside capture
                model._decode(ids, pos, slots, pool, length)
            torch.cuda.current_stream(model.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a trainer on another thread of this process may launch work
            # on the same GPU meanwhile; only this thread's calls may break the capture.
            with torch.cuda.graph(
                graph, pool=self._pool, stream=side, capture_error_mode="thread_local"
            ):
                logits = model._decode(ids, pos, slots, pool, length)
                out = self._logits[:b]
                out.copy_(logits)
            del logits  # its pool memory goes back to the pool for the next capture
        self.captures += 1
        return graph, out
