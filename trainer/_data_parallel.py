"""Data parallelism for a backend whose step is a loop over micro-batches: every rank
gets the whole step (its samples, advantages and loss weights, which are the step's),
runs its share of the micro-batches, and the gradients are summed over the ranks once,
before the clipping and the update. Each micro-batch's loss is already its share of the
step's (:func:`~trainer._losses.token_weights`), so the summed gradient is the step's
gradient on one rank, up to the order of the fp32 additions, and every rank applies the
same update to the same weights.

    dp = DataParallel(rank=1, world_size=2)   # after torch.distributed is set up
    mine = dp.share(groups, tokens)           # this rank's micro-batches
    dp.sum_gradients(params)                  # after the backward of all of them
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["DataParallel"]


@dataclasses.dataclass(frozen=True, slots=True)
class DataParallel:
    """This rank's place among ``world_size`` data-parallel ranks (torch.distributed's
    default group, set up by the caller: gloo on CPU, NCCL on GPUs)."""

    rank: int
    world_size: int

    def share(self, groups: Sequence[list[int]], tokens: Sequence[int]) -> list[list[int]]:
        """This rank's micro-batches: the largest first, each to the rank with the fewest
        tokens so far (ties: the lower rank); the same deal on every rank."""
        load = [0] * self.world_size
        mine: list[list[int]] = []
        order = sorted(range(len(groups)), key=lambda g: -sum(tokens[i] for i in groups[g]))
        for g in order:
            rank = min(range(self.world_size), key=lambda r: (load[r], r))
            load[rank] += sum(tokens[i] for i in groups[g])
            if rank == self.rank:
                mine.append(groups[g])
        return mine

    def sum_gradients(self, params: Sequence[torch.Tensor]) -> None:
        """Every rank's gradients of ``params`` summed (one all-reduce per dtype and
        device of one flat buffer); a rank without micro-batches adds zeros."""
        import torch.distributed as dist

        buckets: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p)
        for members in buckets.values():
            flat = torch.cat([p.grad.reshape(-1) for p in members])  # type: ignore[union-attr]
            dist.all_reduce(flat)
            offset = 0
            for p in members:
                n = p.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p))  # type: ignore[union-attr]
                offset += n

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out
