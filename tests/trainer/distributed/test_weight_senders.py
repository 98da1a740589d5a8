"""Weights leave from the trainer ranks' actors, never through the driver: a broadcast
from rank 0's actor into two ``agentenv serve`` engine actors behind the router (gloo),
and, colocated, each engine handed the weights by handle from the trainer rank in its
bundle (``/update_weights_from_tensor``). Either way every engine then generates with the
trainer's weights, at the exact version."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import torch

from agentenv import Sample, SamplingParams
from agentenv.sglang import SGLangClient
from tests.trainer.test_loop import tiny_llama
from trainer import OptimConfig
from trainer.distributed import EngineGroup, EngineSlot, EngineSpec, Placement, TrainerGroup

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), pytest.mark.anyio]

PROMPT = [1, 1000, 1001, 1002]
PARAMS = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3)


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny"))


def _samples() -> tuple[list[Sample], list[float]]:
    samples = [
        Sample(prompt_ids=PROMPT, completion_ids=[1003 + i, 1010], reward=0.0) for i in range(4)
    ]
    return samples, [1.0, -1.0, 0.5, -0.5]


@pytest.fixture
async def run(
    ray_cluster: Any, model: Path, request: pytest.FixtureRequest
) -> AsyncIterator[tuple[TrainerGroup, EngineGroup]]:
    """A trainer group and two engine actors on one placement (``request.param``:
    colocated or not), the trainer one big step away from the checkpoint."""
    colocate = bool(request.param)
    ranks = 2 if colocate else 1
    placement = Placement(
        actor_num_gpus_per_node=ranks, rollout_num_gpus=2, colocate=colocate, gpus=False
    )
    placed = placement.place(ray_cluster, timeout=60)
    trainer = TrainerGroup.start(
        placed, model, device="cpu", optim=OptimConfig(optimizer="sgd", lr=50.0, grad_clip=0.0)
    )
    try:
        trainer.train_step(*_samples())  # the engines hold the checkpoint: now it differs
        spec = EngineSpec(
            str(model), kind="serve", host="127.0.0.1", server_args=("--max-running", "4"),
            cpus_per_engine=placement.share, health_timeout=120,
        )  # fmt: skip
        slots = [EngineSlot(placed.group, b[0].index, num_gpus=0.0) for b in placed.engines]
        async with EngineGroup(spec, len(slots), slots=slots) as engines:
            yield trainer, engines
    finally:
        trainer.close()
        placed.release()


async def _matches(trainer: TrainerGroup, url: str) -> bool:
    """The engine at ``url`` samples with the trainer's weights: its log-probs are the
    trainer's on what it sampled."""
    async with SGLangClient(url) as client:
        c = await client.generate(PROMPT, PARAMS)
    sample = Sample(prompt_ids=PROMPT, completion_ids=c.output_ids, reward=0.0)
    mine = trainer.logprobs([sample])[0].double()
    return torch.allclose(mine, torch.tensor(c.logprobs, dtype=torch.float64), atol=1e-4)


def _no_driver_copy(trainer: TrainerGroup) -> None:
    def refuse() -> None:
        raise AssertionError("the weights were read into the driver")

    trainer.state_dict = refuse  # type: ignore[method-assign,assignment]


@pytest.mark.parametrize("run", [False], indirect=True, ids=["disaggregated"])
async def test_a_broadcast_leaves_from_rank_0s_actor(run: tuple[TrainerGroup, EngineGroup]) -> None:
    trainer, engines = run
    assert not await _matches(trainer, engines.engines[0].url)  # the checkpoint's weights
    _no_driver_copy(trainer)
    sync = engines.weight_sync("distributed", backend="gloo", bucket_bytes=1 << 20, timeout=60)
    try:
        await sync(trainer, 1)
        await sync(trainer, 2)  # the group stays formed in rank 0's actor
    finally:
        await sync.aclose()
    assert engines.statistics().weight_version == "2"
    for info in engines.engines:
        assert await _matches(trainer, info.url), info.url


@pytest.mark.parametrize("run", [True], indirect=True, ids=["colocated"])
async def test_colocated_engines_get_the_weights_by_handle_from_the_rank_beside_them(
    run: tuple[TrainerGroup, EngineGroup],
) -> None:
    trainer, engines = run
    sync = engines.weight_sync("tensor")
    clients = [m.client for m in engines._live()]
    plan = sync._colocated(trainer, clients)
    # Each engine from the trainer rank in its own bundle: rank 0 and rank 1, one each.
    assert [(s.rank, [engines.bundle_of(c) for c in cs]) for s, cs in plan] == [
        (r, [trainer.ranks.bundles[r].index]) for r in range(2)
    ]
    _no_driver_copy(trainer)
    await sync(trainer, 7)
    assert engines.statistics().weight_version == "7"
    for info in engines.engines:
        async with SGLangClient(info.url) as client:
            assert await client.weight_version() == "7"
        assert await _matches(trainer, info.url), info.url
