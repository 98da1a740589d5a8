"""``agentenv bench grpo --vs trl``: both sides run the same prompts, the same number of
steps, and report finite times and rewards (the CPU smoke test of the GPU comparison)."""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tomllib
from importlib.metadata import EntryPoint
from pathlib import Path

import pytest

from benchmarks import grpo as bench

ROOT = Path(__file__).resolve().parents[2]


def _workload(**changes: object) -> bench.Workload:
    values: dict[str, object] = dict(
        model="m", device="cuda", steps=8, prompts=64, samples=8, max_new_tokens=48,
        lr=5e-6, seed=0, trl_micro_batch=64,
    )  # fmt: skip
    values.update(changes)
    return bench.Workload(**values)  # type: ignore[arg-type]


def test_trl_takes_one_generation_and_one_optimizer_step_per_rollout(tmp_path: Path) -> None:
    from trl.trainer.grpo_config import GRPOConfig

    w = _workload(device="cpu")
    config = GRPOConfig(
        **bench._known_fields(GRPOConfig, bench.trl_config_kwargs(w, str(tmp_path)))
    )
    # 512 completions generated at once, trained in 8 micro-batches of one optimizer step.
    assert config.generation_batch_size == 512
    assert config.num_generations == 8
    assert config.steps_per_generation == config.gradient_accumulation_steps == 8
    assert config.per_device_train_batch_size * config.gradient_accumulation_steps == 512
    assert (config.beta, config.num_iterations, config.shuffle_dataset) == (0.0, 1, False)
    assert (config.adam_beta1, config.adam_beta2, config.learning_rate) == (0.9, 0.98, 5e-6)
    assert config.max_completion_length == 48


def test_a_micro_batch_that_does_not_divide_the_step_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--trl-micro-batch 60 must divide the step's 512"):
        bench.trl_config_kwargs(_workload(trl_micro_batch=60), str(tmp_path))


def test_the_agentenv_side_is_agentenv_train_without_shuffling(tmp_path: Path) -> None:
    w = _workload(agentenv_args=("--rollout-max-running", "256"))
    config = bench.agentenv_config(w, str(tmp_path / "run")).flat()  # by slime's names
    assert config["env"] == "benchmarks.grpo:RecordedArithmeticEnv"
    assert config["env_args"] == {"max_operand": 9}
    assert config["rollout_shuffle"] is False
    assert (config["rollout_batch_size"], config["n_samples_per_prompt"]) == (64, 8)
    assert (config["rollout_max_response_len"], config["lr"], config["adam_beta2"]) == (
        48, 5e-6, 0.98,
    )  # fmt: skip
    assert config["max_tokens_per_gpu"] == 16384
    assert config["rollout_max_running"] == 256  # --agentenv-args win over the defaults
    assert config["save_interval"] == 8  # one checkpoint, after the last step's timings


def test_the_prompt_hash_ignores_order_not_content_or_counts() -> None:
    a = bench.prompt_hash(["What is 1 + 2?", "What is 3 * 4?"] * 4)
    assert a == bench.prompt_hash(["What is 3 * 4?", "What is 1 + 2?"] * 4)
    assert a != bench.prompt_hash(["What is 3 * 4?", "What is 1 + 2?"])
    assert a != bench.prompt_hash(["What is 1 + 2?", "What is 3 * 5?"] * 4)


def test_a_step_may_play_one_prompt_text_under_several_tasks() -> None:
    w = _workload(prompts=2, samples=4)
    bench._check_step("agentenv", 0, ["What is 1 + 2?"] * 8, w)  # two tasks, one text
    with pytest.raises(RuntimeError, match="expected 2 prompts x 4"):
        bench._check_step("agentenv", 0, ["What is 1 + 2?"] * 6 + ["What is 3 * 4?"] * 2, w)


def test_another_peer_is_refused_by_name() -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["grpo", "--vs", "verl", "--quick"])
    with pytest.raises(SystemExit, match="--vs 'verl': the only peer is trl"):
        args.handler(args)


def test_agentenv_bench_grpo_is_the_registered_bench() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    value = pyproject["project"]["entry-points"]["agentenv.benches"]["grpo"]
    assert EntryPoint("grpo", value, "agentenv.benches").load() is bench.add_parser
    bench_extra = pyproject["project"]["optional-dependencies"]["bench"]
    assert {"trl==1.16.0", "accelerate==1.15.0", "datasets==5.2.0"} <= set(bench_extra)


def test_extra_agentenv_train_flags_reach_the_agentenv_side() -> None:
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers())
    args = parser.parse_args(["grpo", "--agentenv-args", "--rollout-max-running 64 --lr 1e-5"])
    w = bench._workload(args, "m")
    assert w.agentenv_args == ("--rollout-max-running", "64", "--lr", "1e-5")
    assert (w.device, w.steps, w.prompts, w.samples, w.max_new_tokens) == ("cuda", 8, 64, 8, 48)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_quick_runs_both_sides_on_the_same_prompts() -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.grpo", "--quick", "--json"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=220, check=False,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["bench"] == "grpo"
    assert result["vs"] == "trl"
    assert result["same_prompts"] is True
    agentenv, trl = result["agentenv"], result["trl"]
    assert len(agentenv["prompt_hashes"]) == len(trl["prompt_hashes"]) == 2
    assert agentenv["prompt_hashes"] == trl["prompt_hashes"]
    assert agentenv["prompt_hashes"][0] != agentenv["prompt_hashes"][1]  # new prompts a step
    for side in (agentenv, trl):
        assert len(side["raw"]["steps"]) == 2
        for step in side["raw"]["steps"]:
            assert math.isfinite(step["step_s"]) and step["step_s"] > 0
            assert math.isfinite(step["generation_s"]) and step["generation_s"] > 0
            assert step["generated_tokens"] > 0
            if not step["skipped"]:  # (a step without gradient is not trained, and says so)
                assert math.isfinite(step["train_s"]) and step["train_s"] > 0
                assert step["trained_tokens"] > 0
        assert side["step_s"] > 0
        assert side["trained_tokens_per_s"] > 0 or all(s["skipped"] for s in side["raw"]["steps"])
        assert all(0.0 <= r <= 1.0 for r in side["reward"])
    assert not any(s["skipped"] for s in trl["raw"]["steps"])
    for name in ("step_s", "memory", "generated_tokens_per_s", "trained_tokens_per_s"):
        assert name in result["ratios"]
    assert result["ratios"]["step_s"] > 0
    # The table is on stderr, the JSON alone on the last line of stdout.
    assert "step, steady (s)" in out.stderr
