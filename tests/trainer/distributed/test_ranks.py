"""Trainer ranks as Ray actors (trainer.distributed.RankGroup) on a local cluster: calls
fanned out to every rank over gloo, bad input raised on every rank without stopping them,
a clean close, and a rank that dies stopping the run with its rank and node."""

from __future__ import annotations

from typing import Any

import pytest

from agentenv import ClosedResourceError, ConfigError
from tests.trainer.distributed.workers import Counter
from trainer.distributed import Placement, RankGroup, TrainerRankError


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_the_ranks_run_every_call_together_and_close(ray_cluster: Any) -> None:
    placed = Placement(actor_num_gpus_per_node=3).place(ray_cluster, timeout=30)
    ranks: RankGroup[Counter] = RankGroup(Counter, "spec", placed, device="cpu", release=True)
    assert ranks.world_size == 3 and ranks.local is None
    assert ranks.call(Counter.add, 1) == 6  # 1 + 2 + 3, over gloo
    each = ranks.call_each(Counter.rank, [((), {})] * 3)
    assert each == [(0, "cpu", "spec"), (1, "cpu", "spec"), (2, "cpu", "spec")]
    with pytest.raises(ConfigError, match="bad input, found on every rank"):
        ranks.call(Counter.refuse)
    assert ranks.call(Counter.add, 2) == 12  # the ranks went on
    assert ranks.exited() == {}
    ranks.close()
    ranks.close()  # idempotent
    with pytest.raises(ClosedResourceError, match="cannot call add: the trainer ranks were"):
        ranks.call(Counter.add, 1)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_a_rank_that_dies_stops_the_run_naming_its_rank_and_node(ray_cluster: Any) -> None:
    placed = Placement(actor_num_gpus_per_node=2).place(ray_cluster, timeout=30)
    ranks: RankGroup[Counter] = RankGroup(Counter, None, placed, device="cpu", release=True)
    node = placed.trainer[1].node_id[:8]
    with pytest.raises(TrainerRankError) as caught:
        ranks.call(Counter.die)  # rank 0 would wait in its all-reduce forever
    message = str(caught.value)
    assert caught.value.rank == 1
    assert f"trainer rank 1 on node {node} (" in message and "died running die" in message
    assert "resume it from its last checkpoint with --load" in message
    with pytest.raises(ClosedResourceError):  # every rank was ended with it
        ranks.call(Counter.add, 1)
    assert ranks.exited() == {0: -1, 1: -1}
