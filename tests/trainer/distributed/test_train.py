"""``trainer.train`` placed on Ray (the session's local cluster): two data-parallel torch
ranks as actors on CPU, the embedded engine in this process; the checkpoint it writes
resumes the run (what ``--load`` does after a trainer rank died)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import trainer
from tests.trainer.test_loop import tiny_llama


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_run_trains_on_two_ranks_and_resumes_from_its_checkpoint(
    ray_cluster: Any, tmp_path: Path
) -> None:
    model = tiny_llama(tmp_path / "tiny")
    base: dict[str, Any] = dict(
        env="tests.trainer.test_loop:GoodTokensEnv", hf_checkpoint=str(model), device="cpu",
        actor_num_gpus_per_node=2, ray_address="local", rollout_batch_size=2,
        n_samples_per_prompt=4, rollout_max_response_len=6, n_eval=2, lr=1e-2,
        save=tmp_path / "run", save_interval=1, use_tensorboard=False,
    )  # fmt: skip
    first = trainer.train(trainer.TrainConfig(**base, num_rollout=2))
    assert first["steps"] == 2
    assert (tmp_path / "run" / "model" / "config.json").is_file()  # rank 0's weights
    again = trainer.train(trainer.TrainConfig(**base, num_rollout=3, load=tmp_path / "run"))
    assert again["steps"] == 3
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert len(metrics) == 3  # resumed at step 2, not from the start
    # The peak resident set covers the rank actors' processes, not only this one's.
    last = json.loads(metrics[-1])
    ranks, driver = last["perf/peak_rss_gib/trainer_ranks"], last["perf/peak_rss_gib/driver"]
    assert ranks > 0.1 and last["perf/peak_rss_gib"] == max(ranks, driver)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_agentenv_train_on_ray_two_trainer_actors_and_an_engine_actor_behind_the_router(
    tmp_path: Path,
) -> None:
    """``--ray-address local`` starts a Ray of the run's own: two trainer ranks as actors,
    one ``agentenv serve`` engine actor behind sglang-router, the weights synced from disk
    every step."""
    import json
    import subprocess
    import sys

    model = tiny_llama(tmp_path / "tiny")
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "train",
         "--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint", str(model),
         "--ray-address", "local", "--actor-num-gpus-per-node", "2",
         "--rollout-num-gpus", "1", "--rollout-engine", "serve", "--device", "cpu",
         "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
         "--rollout-max-response-len", "6", "--n-eval", "2",
         "--json"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "starting 1 engine actor(s) (serve) behind sglang-router" in out.stderr
    # The summary is the last JSON line (Ray may print a warning of its own after it).
    summary = json.loads([x for x in out.stdout.splitlines() if x.startswith("{")][-1])
    assert summary["steps"] == 2 and summary["eval_reward_after"] is not None
