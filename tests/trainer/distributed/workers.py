"""Workers for the rank-group tests: gloo collectives on CPU, bad input, a rank that dies."""

from __future__ import annotations

import os
from pathlib import Path

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


class FakeMegatronRank:
    """A megatron rank without megatron: joins the gloo group and answers the backend's
    calls, each rank writing its own checkpoint shard."""

    def __init__(self, options: object, rendezvous: Rendezvous) -> None:
        self.options, self.rank = options, rendezvous.rank
        self.device = torch.device("cpu")
        dist.init_process_group(
            "gloo",
            init_method=rendezvous.init_method,
            rank=rendezvous.rank,
            world_size=rendezvous.world_size,
        )

    def train_step(
        self, samples: list[object], advantages: object, **_: object
    ) -> dict[str, float]:
        if len(samples) != len(list(advantages)):  # type: ignore[call-overload]
            raise ConfigError(f"{len(samples)} samples but the advantages differ")
        ranks = torch.tensor([1.0])
        dist.all_reduce(ranks)
        return {"ranks": float(ranks), "rank": float(self.rank)}

    def logprobs(
        self, samples: list[object], *, reference: bool = False, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        return [torch.full((2,), float(self.rank)) for _ in samples]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"w": torch.tensor([float(self.rank)])}

    def save_shards(self, directory: str) -> None:
        (Path(directory) / f"model_rank{self.rank}.pt").write_bytes(b"shard")
        dist.barrier()

    def load_shards(self, directory: str, steps: int) -> None:
        assert (Path(directory) / f"model_rank{self.rank}.pt").read_bytes() == b"shard"

    def shutdown(self) -> None:
        dist.destroy_process_group()
