"""Workers for the rank-group tests: gloo collectives on CPU, bad input, a rank that dies."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from agentenv import ConfigError
from trainer.distributed import Rendezvous


class Counter:
    """Joins the gloo group of its rendezvous; ``spec`` is echoed back."""

    def __init__(self, spec: object, rendezvous: Rendezvous) -> None:
        self.spec, self.rendezvous = spec, rendezvous
        dist.init_process_group(
            "gloo",
            init_method=rendezvous.init_method,
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
        )

    def add(self, x: int) -> int:
        """Every rank adds x times (its rank + 1)."""
        t = torch.tensor([x * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return int(t)

    def rank(self) -> tuple[int, int | str, str]:
        return self.rendezvous.rank, self.rendezvous.device, str(self.spec)

    def refuse(self) -> None:
        raise ConfigError("bad input, found on every rank")

    def die(self) -> int:
        """Rank 1 exits; rank 0 waits for it in a collective."""
        if dist.get_rank() == 1:
            os._exit(3)
        return self.add(1)

    def shutdown(self) -> None:
        dist.destroy_process_group()
