"""Data parallelism for a backend whose step is a loop over micro-batches
(docs/trainer.md, "Data parallel"): every rank gets the whole step, runs its share of the
micro-batches, and torch's ``DistributedDataParallel`` sums the gradients during the
backward of the rank's last one (``no_sync`` for the others). Each micro-batch's loss is
already its share of the step's and DDP averages, so the loss goes backward times the
world size. The model stays unwrapped: only the training forward goes through DDP.

    dp = DataParallel(rank=1, world_size=2)      # after torch.distributed is set up
    dp.attach(model, forward)                    # forward(batch, with_entropy) -> lps, ents
    mine = dp.share(groups, tokens)              # this rank's micro-batches
    for k, group in enumerate(mine):
        with dp.micro_batch(last=k == len(mine) - 1):
            lps, ents = dp.forward(batch, with_entropy=True)
            (loss * dp.world_size).backward()
    dp.idle(batch) if not mine else None          # a rank without micro-batches joins the sum
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["DataParallel"]


class _Step(torch.nn.Module):
    """The training forward as one module, so that DDP wraps it: ``model`` is its
    submodule (DDP's parameters are the model's), ``forward`` the backend's."""

    def __init__(self, model: torch.nn.Module, forward: Callable[..., Any]) -> None:
        super().__init__()
        self.model = model
        self._forward = forward

    def forward(self, batch: Any, with_entropy: bool, temperature: float) -> Any:
        return self._forward(batch, with_entropy=with_entropy, temperature=temperature)


@dataclasses.dataclass(slots=True)
class DataParallel:
    """This rank's place among ``world_size`` data-parallel ranks (torch.distributed's
    default group, set up by the caller: gloo on CPU, NCCL on GPUs)."""

    rank: int
    world_size: int
    ddp: Any = None

    def attach(self, model: torch.nn.Module, forward: Callable[..., Any]) -> None:
        """Wrap the training forward of ``model`` (``forward(batch, with_entropy=,
        temperature=)``)
        in DDP; the ranks' weights are made rank 0's."""
        from torch.nn.parallel import DistributedDataParallel

        self.ddp = DistributedDataParallel(
            _Step(model, forward), broadcast_buffers=False, init_sync=True
        )

    def forward(self, batch: Any, *, with_entropy: bool, temperature: float = 1.0) -> Any:
        """The training forward, through DDP."""
        return self.ddp(batch, with_entropy, temperature)

    @contextlib.contextmanager
    def micro_batch(self, *, last: bool) -> Iterator[None]:
        """One micro-batch's forward and backward: its gradients only accumulate, unless
        it is the rank's last, whose backward sums every rank's."""
        with contextlib.nullcontext() if last else self.ddp.no_sync():
            yield

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

    def idle(self, forward_loss: Callable[[], torch.Tensor]) -> None:
        """A rank without micro-batches still takes part in the sum: one forward and a
        backward of ``forward_loss() * 0`` (zeros added to the others' gradients)."""
        (forward_loss() * 0.0).backward()  # type: ignore[no-untyped-call]

    def gather(self, obj: Any) -> list[Any]:
        """Every rank's ``obj`` (picklable), in rank order."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out
