"""The torch backend on two data-parallel Ray actors (gloo on CPU) against one rank in
this process: the same batch gives the same gradient, the same weights after the step
and the same metrics (to fp32 tolerance); log-probs and checkpoints are the one rank's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agentenv import Sample
from tests.trainer.test_loop import tiny_llama
from trainer import LossConfig, OptimConfig, TorchBackend
from trainer.distributed import Placement, TrainerGroup


def _batch() -> tuple[list[Sample], list[float]]:
    g = torch.Generator().manual_seed(0)
    samples = [
        Sample(
            prompt_ids=torch.randint(3, 400, (3 + i % 4,), generator=g).tolist(),
            completion_ids=torch.randint(3, 400, (2 + (i * 5) % 7,), generator=g).tolist(),
            reward=float(i % 2),
        )
        for i in range(6)
    ]
    return samples, [1.0, -1.0, 0.5, -0.5, 2.0, -2.0]


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_two_rank_step_equals_a_one_rank_step(ray_cluster: Any, tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "tiny")
    samples, advantages = _batch()
    # SGD at lr 1 without clipping: the change of each weight is minus its gradient.
    kwargs: dict[str, Any] = dict(
        optim=OptimConfig(optimizer="sgd", lr=1.0, grad_clip=0.0, weight_decay=0.0),
        loss=LossConfig(), max_tokens_per_micro_batch=24,  # several micro-batches
    )  # fmt: skip
    one = TorchBackend(model, **kwargs)
    before = {k: v.clone() for k, v in one.state_dict().items()}
    want = one.train_step(samples, advantages)
    placed = Placement(actor_num_gpus_per_node=2).place(ray_cluster, timeout=30)
    group = TrainerGroup.start(placed, model, device="cpu", release=True, **kwargs)
    try:
        assert group.world_size == 2
        got = group.train_step(samples, advantages)
        assert got["micro_batches"] == want["micro_batches"] > 2
        assert 0 < got["micro_batches_this_rank"] < got["micro_batches"]  # rank 0's share
        for key in ("loss", "pg_loss", "clipfrac", "ratio_mean", "grad_norm", "entropy"):
            assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-7), key
        mine, theirs = one.state_dict(), group.state_dict()
        for name, w in mine.items():
            grad_one, grad_two = before[name] - w, before[name] - theirs[name]
            # fp32 sums in another order: within 1e-5 of the gradient's scale.
            assert (grad_two - grad_one).abs().max() <= 1e-5 * grad_one.abs().max(), name
        # Both ranks hold the same weights: each rank's log-probs are the one rank's.
        lps = group.logprobs(samples)
        for a, b in zip(lps, one.logprobs(samples), strict=True):
            assert torch.allclose(a, b, atol=1e-5)
        # One micro-batch for two ranks: rank 1 has none, and still takes part in the sum.
        small = [samples[0]]
        assert one.train_step(small, [1.0])["micro_batches"] == 1
        got = group.train_step(small, [1.0])
        assert got["micro_batches"] == 1
        for name, w in one.state_dict().items():
            torch.testing.assert_close(group.state_dict()[name], w, rtol=1e-4, atol=1e-5)
        group.save_checkpoint(tmp_path / "ckpt", {"step": 1})
        assert one.load_checkpoint(tmp_path / "ckpt") == {"step": 1}  # one rank resumes it
        assert group.load_checkpoint(tmp_path / "ckpt") == {"step": 1} and group.steps == 2
    finally:
        group.close()
