"""A stand-in for the megatron backend on CPU: rank 0 starts the other ranks through
:class:`trainer.megatron._ranks.Followers` and every method marked ``collective`` runs on
all of them, over gloo. Used by ``test_ranks.py``:

    python -m tests.trainer.megatron.fake_ranks ok|die
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from agentenv import ConfigError
from trainer._files import free_port
from trainer.megatron._ranks import FOLLOWER_DEVICE, Followers, collective, open_channel


class Counter:
    def __init__(self, world: int = 2) -> None:
        self.device = torch.device("cpu")
        self.followers: Followers | None = None
        if os.environ.get(FOLLOWER_DEVICE) is None:  # rank 0
            rank, port = 0, free_port()
            factory = "tests.trainer.megatron.fake_ranks:Counter"
            self.followers = Followers(world, factory, {"world": world}, ["cpu"] * world, port)
        else:
            rank, port = int(os.environ["RANK"]), int(os.environ["MASTER_PORT"])
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        open_channel()

    @collective
    def add(self, x: int) -> int:
        """Every rank adds x times (its rank + 1)."""
        t = torch.tensor([x * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return int(t)

    @collective
    def refuse(self) -> None:
        raise ConfigError("bad input, found on every rank")

    @collective
    def die(self) -> None:
        if dist.get_rank() != 0:
            os._exit(3)

    def shutdown(self) -> None:
        dist.destroy_process_group()

    def close(self) -> None:
        if self.followers is not None:
            self.followers.close()
        self.shutdown()


def main(mode: str) -> None:
    c = Counter(world=3)
    print("add", c.add(1), flush=True)  # 1 + 2 + 3
    try:
        c.refuse()
    except ConfigError as e:
        print("refused", e, flush=True)
    print("add", c.add(2), flush=True)  # the others are still there
    if mode == "die":
        c.die()
        c.add(1)  # rank 1 is gone: the watchdog ends this process
        print("not reached", flush=True)
    c.close()
    print("closed", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
