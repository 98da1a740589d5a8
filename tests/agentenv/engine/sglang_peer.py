"""One rank of a weight update group formed the way SGLang servers and slime trainers form
theirs: torch's ``tcp://`` rendezvous, a store prefixed with the group's name, and torch's
own process-group helper (registered so that ``torch.distributed.broadcast`` accepts it).
The tests run it beside agentenv's end of the group to show that the two interoperate.

    python tests/agentenv/engine/sglang_peer.py ADDRESS PORT RANK WORLD_SIZE GROUP_NAME

Rank 0 waits for a line on stdin, then broadcasts ``PAYLOAD`` (float32); any other rank
receives a tensor of that shape and prints its values as JSON.
"""

from __future__ import annotations

import datetime
import json
import sys

import torch
from torch.distributed import distributed_c10d as c10d

PAYLOAD = torch.arange(576, dtype=torch.float32) / 576  # SmolLM2's hidden size


def main(address: str, port: int, rank: int, world: int, name: str) -> None:
    timeout = datetime.timedelta(seconds=30)
    url = f"tcp://{address}:{port}"
    store, rank, world = next(c10d.rendezvous(url, rank, world, timeout=timeout))
    store.set_timeout(timeout)
    group, _ = c10d._new_process_group_helper(
        world, rank, [], c10d.Backend("gloo"), c10d.PrefixStore(name, store),
        group_name=name, timeout=timeout,
    )  # fmt: skip
    c10d._world.pg_group_ranks[group] = {r: r for r in range(world)}
    if rank == 0:
        sys.stdin.readline()
        torch.distributed.broadcast(PAYLOAD.clone(), src=0, group=group)
    else:
        received = torch.empty_like(PAYLOAD)
        torch.distributed.broadcast(received, src=0, group=group)
        print(json.dumps(received.tolist()), flush=True)
    # Gloo's threads must be stopped before the interpreter exits (left to process teardown
    # they end it with std::terminate now and then).
    c10d.destroy_process_group(group)


if __name__ == "__main__":
    address, port, rank, world, name = sys.argv[1:6]
    main(address, int(port), int(rank), int(world), name)
