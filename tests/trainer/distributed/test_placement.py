"""Placement on a local Ray cluster with 4 logical GPUs: the bundles of slime's flags,
disaggregated and colocated, in (node id, GPU id) order as measured inside each bundle,
and a placement the cluster cannot hold refused after a bounded wait with the numbers."""

from __future__ import annotations

from typing import Any

import pytest

from agentenv import ConfigError
from trainer import TrainConfig
from trainer.distributed import Placement, PlacementTimeoutError, connect


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_disaggregated_the_engines_get_the_bundles_after_the_trainers(ray_cluster: Any) -> None:
    placement = Placement(actor_num_gpus_per_node=2, rollout_num_gpus=2)
    placed = placement.place(ray_cluster, timeout=30)
    try:
        assert len(placed.bundles) == 4
        # Measured in the bundles: one node, GPUs 0..3 in order, each bundle its own GPU.
        assert [b.gpu_ids for b in placed.bundles] == [(0,), (1,), (2,), (3,)]
        assert len({b.node_id for b in placed.bundles}) == 1
        assert [b.gpu_ids for b in placed.trainer] == [(0,), (1,)]
        assert [[b.gpu_ids for b in e] for e in placed.engines] == [[(2,)], [(3,)]]
        assert placed.actor_options(placed.trainer[0])["num_gpus"] == 1.0
    finally:
        placed.release()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_colocated_trainers_and_engines_share_the_bundles(ray_cluster: Any) -> None:
    config = TrainConfig(
        env="x", actor_num_gpus_per_node=2, colocate=True, rollout_engine="sglang",
        rollout_num_gpus_per_engine=2, device="cuda",
    )  # fmt: skip
    placement = Placement.from_config(config)
    assert placement.rollout_num_gpus == 2 and placement.num_bundles == 2  # max(2, 2)
    placed = placement.place(ray_cluster, timeout=30)
    try:
        assert placed.trainer == placed.engines[0]  # one engine of 2 GPUs, on the trainer's
        assert [b.gpu_ids for b in placed.trainer] == [(0,), (1,)]
        assert placed.actor_options(placed.trainer[0])["num_gpus"] == 0.5
    finally:
        placed.release()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_more_gpus_than_the_cluster_has_stop_after_the_timeout_with_the_numbers(
    ray_cluster: Any,
) -> None:
    placement = Placement(actor_num_nodes=2, actor_num_gpus_per_node=4, rollout_num_gpus=4)
    with pytest.raises(PlacementTimeoutError) as caught:  # (the test's timeout: not after 60 s)
        placement.place(ray_cluster, timeout=1)
    message = str(caught.value)
    assert "not ready after 1 s: asked for 12 bundles of {GPU: 1, CPU: 1}" in message
    assert "(2 node(s) x 4 trainer GPUs + 4 engine GPUs, disaggregated), GPU 12, CPU 12" in message
    assert "the cluster has GPU 4 (4 free), CPU 8" in message and "on 1 node(s)" in message
    # Nothing stays reserved: the next placement gets the GPUs.
    Placement(actor_num_gpus_per_node=4).place(ray_cluster, timeout=30).release()


@pytest.mark.timeout(60)
def test_an_address_that_does_not_answer_is_refused_within_seconds() -> None:
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConfigError, match=rf"--ray-address 127.0.0.1:{port}: nothing answers"):
        connect(f"127.0.0.1:{port}")  # (the test's timeout: within a minute)


def test_engines_must_divide_their_gpus() -> None:
    with pytest.raises(ConfigError, match="--rollout-num-gpus 3 is not a multiple of"):
        Placement(rollout_num_gpus=3, rollout_num_gpus_per_engine=2)


def test_a_run_without_placement_flags_stays_in_one_process_without_ray() -> None:
    import subprocess
    import sys

    code = (
        "import sys, trainer, trainer.megatron, trainer.distributed\n"
        "from trainer.run._setup import place_run\n"
        "assert place_run(trainer.TrainConfig(env='arithmetic')) is None\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
