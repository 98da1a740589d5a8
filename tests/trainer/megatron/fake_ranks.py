"""A stand-in for the megatron backend's ranks on CPU: rank 0 starts the other ranks
through :class:`trainer.megatron._ranks.ProcessRanks` and every call runs on all of them,
over gloo. Used by ``test_ranks.py``:

    python -m tests.trainer.megatron.fake_ranks ok|die
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from agentenv import ConfigError
from trainer.megatron._ranks import ProcessRanks, Rendezvous


class Counter:
    """A worker: joins the gloo group of its rendezvous; ``spec`` is unused."""

    def __init__(self, spec: object, rendezvous: Rendezvous) -> None:
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

    def refuse(self) -> None:
        raise ConfigError("bad input, found on every rank")

    def die(self) -> None:
        if dist.get_rank() != 0:
            os._exit(3)

    def shutdown(self) -> None:
        dist.destroy_process_group()


class Echo:
    """A worker of one rank that touches no process group."""

    def __init__(self, spec: object, rendezvous: Rendezvous) -> None:
        self.spec, self.rendezvous, self.shut = spec, rendezvous, 0

    def echo(self, x: int, *, times: int = 1) -> list[object]:
        return [self.spec, x * times]

    def shutdown(self) -> None:
        self.shut += 1


class BrokenRank0(Counter):
    """Rank 0 fails while it builds; the others wait for it in the rendezvous."""

    def __init__(self, spec: object, rendezvous: Rendezvous) -> None:
        if rendezvous.rank == 0:
            raise RuntimeError("rank 0 could not build")
        super().__init__(spec, rendezvous)


def main(mode: str) -> None:
    ranks: ProcessRanks[Counter] = ProcessRanks(
        "tests.trainer.megatron.fake_ranks:Counter", None, ["cpu"] * 3
    )
    print("add", ranks.call(Counter.add, 1), flush=True)  # 1 + 2 + 3
    try:
        ranks.call(Counter.refuse)
    except ConfigError as e:
        print("refused", e, flush=True)
    print("add", ranks.call(Counter.add, 2), flush=True)  # the others are still there
    if mode == "die":
        ranks.call(Counter.die)
        ranks.call(Counter.add, 1)  # rank 1 is gone: the watchdog ends this process
        print("not reached", flush=True)
    ranks.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
