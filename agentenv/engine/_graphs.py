"""CUDA graphs for the decode step: one kernel launch per step instead of hundreds.

A decode step of a small model is bound by kernel launches, not by the GPU's arithmetic:
each of its ~40 kernels per layer costs the CPU more to launch than the GPU to run.
:class:`DecodeGraphs` captures :meth:`LlamaModel._decode <agentenv.engine._model.LlamaModel>`
once per batch-size bucket and replays it. A graph reads its inputs from fixed buffers,
writes its logits into one buffer that every bucket shares (rows ``0 .. b-1``: a graph's own
output would stay allocated in the graphs' memory pool, one ``[b, V]`` float32 tensor per
bucket -- 1.7 GB for SmolLM2's vocabulary at 512 requests), and
attends to the whole cache capacity (positions beyond a row's length are masked), so it
stays valid while sequences grow; when the cache or the RoPE table is reallocated (the cache
doubled), the graphs are captured again. Rows past the live batch write their keys to the
last cache position, which no sequence uses (the model keeps one position spare).
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from agentenv.engine._model import KVCache, LlamaModel

__all__ = ["DecodeGraphs"]


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then steps of 8 up to 64, of 16 beyond."""
    sizes = {1, 2, 4, 8, max_batch}
    sizes.update(range(8, min(max_batch, 64) + 1, 8))
    sizes.update(range(64, max_batch + 1, 16))
    return sorted(s for s in sizes if s <= max_batch)


class DecodeGraphs:
    """The captured decode graphs of one model and cache (CUDA only)."""

    def __init__(self, model: LlamaModel, max_batch: int) -> None:
        if model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        self.model = model
        self.buckets = buckets(max_batch)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._key: tuple[int, ...] = ()
        self._ids = torch.zeros(max_batch, dtype=torch.int64, device=model.device)
        self._pos = torch.zeros(max_batch, dtype=torch.int64, device=model.device)
        # Outside the graphs' pool: it outlives a recapture.
        self._logits = torch.empty(
            (max_batch, model.config.vocab_size), dtype=torch.float32, device=model.device
        )
        self.captures = 0

    def decode(self, ids: list[int], positions: list[int], cache: KVCache) -> torch.Tensor:
        """Like the eager decode: logits [len(ids), V] float32 (a view, valid until the next
        call)."""
        model = self.model
        model._rope_table(cache.capacity)
        key = (cache.k.data_ptr(), cache.v.data_ptr(), cache.capacity, model._cos.data_ptr())
        if key != self._key:  # reallocated: the old graphs read stale memory
            self._graphs.clear()
            self._pool = torch.cuda.graph_pool_handle()  # the old pool goes with them
            self._key = key
        n = len(ids)
        b = self.buckets[bisect.bisect_left(self.buckets, n)]
        entry = self._graphs.get(b)
        if entry is None:
            entry = self._graphs[b] = self._capture(b, cache)
        graph, out = entry
        spare = cache.capacity - 1
        self._ids[:n].copy_(torch.tensor(ids), non_blocking=True)
        self._pos[:n].copy_(torch.tensor(positions), non_blocking=True)
        if b > n:
            self._ids[n:b].zero_()
            self._pos[n:b].fill_(spare)
        graph.replay()
        return out[:n]

    def _capture(self, b: int, cache: KVCache) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        model = self.model
        ids, pos = self._ids[:b], self._pos[:b]
        ids.zero_()
        pos.fill_(cache.capacity - 1)  # every row writes to the spare position
        with torch.cuda.device(model.device):  # capture on the model's GPU, not cuda:0
            side = torch.cuda.Stream(device=model.device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(model.device))
            with torch.cuda.stream(side):  # warm-up: lazy initialisations outside capture
                model._decode(ids, pos, cache, cache.capacity)
            torch.cuda.current_stream(model.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a trainer on another thread of this process may launch work
            # on the same GPU meanwhile; only this thread's calls may break the capture.
            with torch.cuda.graph(
                graph, pool=self._pool, stream=side, capture_error_mode="thread_local"
            ):
                logits = model._decode(ids, pos, cache, cache.capacity)
                out = self._logits[:b]
                out.copy_(logits)
            del logits  # its pool memory goes back to the pool for the next capture
        self.captures += 1
        return graph, out
