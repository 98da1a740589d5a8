"""The engine actors' command from a run's settings (no Ray needed)."""

from __future__ import annotations

import sys

import pytest
import torch

from agentenv import ConfigError
from trainer import TrainConfig
from trainer.run._servers import engine_spec


def test_serve_engines_take_the_runs_device_batch_dtypes_and_key(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("AGENTENV_API_KEY", raising=False)
    config = TrainConfig(
        env="x", rollout_engine="serve", rollout_max_running=32, device="cuda:3",
        rollout_num_gpus_per_engine=1, sglang_args=["--api-key", "k"],
    )  # fmt: skip
    spec = engine_spec(config, (torch.bfloat16, torch.float32))
    assert spec.kind == "serve" and spec.gpus_per_engine == 1
    assert spec.env == {"AGENTENV_API_KEY": "k"}
    command = spec.command("127.0.0.1", 4000)
    assert command[:3] == [sys.executable, "-m", "agentenv"]
    assert command[-8:] == [
        "--device", "cuda", "--max-running", "32",  # the actor sees only its own GPUs
        "--dtype", "bfloat16", "--residual-dtype", "float32",
    ]  # fmt: skip


def test_sglang_engines_pass_the_sglang_flags_and_their_tp_size() -> None:
    config = TrainConfig(
        env="x", rollout_engine="sglang", rollout_num_gpus_per_engine=2,
        sglang_args=["--mem-fraction-static", "0.8"],
    )  # fmt: skip
    command = engine_spec(config).command("10.0.0.2", 4000)
    assert command[1:3] == ["-m", "sglang.launch_server"]
    assert command[-6:] == ["--port", "4000", "--mem-fraction-static", "0.8", "--tp-size", "2"]
    assert "--base-gpu-id" not in command


def test_the_embedded_engine_is_refused() -> None:
    with pytest.raises(ConfigError, match="need --rollout-engine serve or sglang"):
        engine_spec(TrainConfig(env="x"))


def test_a_tensor_weight_sync_needs_a_trainer_rank_on_every_engines_gpu() -> None:
    base = dict(env="x", rollout_engine="serve", weight_sync="tensor", device="cpu")
    TrainConfig(**base, colocate=True, actor_num_gpus_per_node=2)  # engines on both ranks
    TrainConfig(**base)  # one process: the launched server on the trainer's device
    refusals = {
        "needs --colocate": dict(rollout_num_gpus=1),
        "but the server is on cpu:1": dict(rollout_device="cpu:1"),
        r"--rollout-num-gpus 3 \(per engine 1\) against 2 trainer GPUs": dict(
            colocate=True, actor_num_gpus_per_node=2, rollout_num_gpus=3
        ),
        "needs servers": dict(rollout_engine="embedded"),
    }
    for message, extra in refusals.items():
        with pytest.raises(ConfigError, match=message):
            TrainConfig(**{**base, **extra})
    with pytest.raises(ConfigError, match="megatron's ranks hold shards"):
        TrainConfig(**base, colocate=True, backend="megatron", actor_num_gpus_per_node=2)
