"""``agentenv train --dry-run``: a slime launch script's flags map over line by line, are
validated with the environment and the prompt data, and nothing loads or is written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from agentenv.cli import main

# slime's GLM-Z1-9B GRPO launch script (scripts/run-glm4-9B.sh), its five groups of flags.
SLIME_GLM_Z1_9B: dict[str, list[str]] = {
    "checkpoint": [
        "--hf-checkpoint", "/root/GLM-Z1-9B-0414",
        "--ref-load", "/root/GLM-Z1-9B-0414_torch_dist",
        "--load", "{run}",
        "--save", "{run}",
        "--save-interval", "20",
    ],
    "rollout": [
        "--prompt-data", "{prompts}",
        "--input-key", "prompt",
        "--label-key", "label",
        "--apply-chat-template",
        "--rollout-shuffle",
        "--rm-type", "deepscaler",
        "--num-rollout", "3000",
        "--rollout-batch-size", "32",
        "--n-samples-per-prompt", "8",
        "--rollout-max-response-len", "8192",
        "--rollout-temperature", "0.8",
        "--global-batch-size", "256",
    ],
    "algorithm": [
        "--advantage-estimator", "grpo",
        "--use-kl-loss",
        "--kl-loss-coef", "0.00",
        "--kl-loss-type", "low_var_kl",
        "--entropy-coef", "0.00",
        "--eps-clip", "0.2",
        "--eps-clip-high", "0.28",
        "--calculate-per-token-loss",
    ],
    "parallelism": [
        "--tensor-model-parallel-size", "2",
        "--sequence-parallel",
        "--pipeline-model-parallel-size", "1",
        "--context-parallel-size", "2",
        "--use-dynamic-batch-size",
        "--max-tokens-per-gpu", "4608",
        "--rollout-num-gpus-per-engine", "2",
    ],
    "optimizer": [
        "--optimizer", "adam",
        "--lr", "1e-6",
        "--lr-decay-style", "constant",
        "--weight-decay", "0.1",
        "--adam-beta1", "0.9",
        "--adam-beta2", "0.98",
    ],
}  # fmt: skip

# What the script does not say because slime has no other choice (megatron, SGLang, the
# GPUs of its Ray job). Without --env the prompts are scored by --rm-type (prompt_data).
OURS = [
    "--backend", "megatron", "--actor-num-gpus-per-node", "4",
    "--rollout-engine", "sglang", "--device", "cuda", "--sglang-mem-fraction-static", "0.5",
]  # fmt: skip


def test_the_script_keeps_the_flags_of_slimes_glm_script() -> None:
    flags = [a for group in SLIME_GLM_Z1_9B.values() for a in group if a.startswith("--")]
    assert len(flags) == len(set(flags)) == 38


def _argv(tmp_path: Path, *, without: tuple[str, ...] = ()) -> list[str]:
    prompts = tmp_path / "dapo-math-17k.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt": f"{i} + {i} = ?", "label": str(2 * i)}) + "\n" for i in range(40)
        )
    )
    out: list[str] = []
    for group in SLIME_GLM_Z1_9B.values():
        skip = False
        for arg in group:
            if arg.startswith("--"):
                skip = arg in without
            if not skip:
                out.append(arg.format(run=tmp_path / "run", prompts=prompts))
    return out + OURS


def _train(argv: list[str]) -> int:
    try:
        return main(["train", "--dry-run", *argv])
    except SystemExit as e:  # argparse refuses a flag
        return int(str(e.code))


def test_a_dry_run_accepts_the_script_and_prints_the_resolved_settings(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(_argv(tmp_path)) == 0
    out = json.loads(capsys.readouterr().out)
    config = out["config"]
    assert config["data"] == config["data"] | {"env": None, "rm_type": "deepscaler"}
    assert config["rollout"]["sampling"]["max_new_tokens"] == 8192
    assert config["rollout"]["global_batch_size"] == 256
    assert config["algorithm"] == config["algorithm"] | {
        "eps_clip_high": 0.28, "aggregation": "per_token", "use_kl_loss": True,
        "kl_loss_coef": 0.0,
    }  # fmt: skip
    # The temperature is the rollouts' alone; the log-probs are of their distribution.
    assert "temperature" not in config["algorithm"]
    assert config["rollout"]["sampling"]["temperature"] == 0.8
    assert out["resolved"]["logprob_temperature"] == 0.8
    assert config["optimizer"]["lr_decay_iters"] == 3000  # the whole run
    assert config["parallel"]["megatron_args"] == [
        "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--pipeline-model-parallel-size", "1", "--context-parallel-size", "2",
    ]  # fmt: skip
    assert out["found"] == {
        "train_tasks": 40, "held_out_tasks": 0, "resume_from": None, "skipped_rows": [],
    }  # fmt: skip
    assert out["megatron"]["tensor_model_parallel_size"] == 2
    assert not (tmp_path / "run").exists()  # --load == --save: a fresh start; nothing written


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--rm-type", "deepscalar"], "--rm-type 'deepscalar' is not a reward type; known: "
                                      "dapo, deepscaler, f1, math, remote_rm"),
        (["--rm-type", "remote_rm"], "--rm-type remote_rm needs --rm-url"),
        (["--rm-type", "math", "--custom-rm-path", "x:y"], "both name the reward: pass one"),
        (["--rm-type", "math", "--env", "nim"], "--rm-type: --env nim (NimEnv) scores its own"),
    ],
)  # fmt: skip
def test_bad_reward_flags_are_refused_naming_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    assert _train([*_argv(tmp_path, without=("--rm-type",)), *argv]) == 2
    assert message in capsys.readouterr().err


def test_without_a_reward_the_prompts_need_an_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train(_argv(tmp_path, without=("--rm-type",))) == 2
    assert "--prompt-data without --env needs a reward: --rm-type" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--global-batch-size", "200"], r"rollout_batch_size (32) x n_samples_per_prompt (8)"),
        (["--label-key", "answer"], "has no key 'answer'"),
        (["--env", "nowhere.module:Env"], "cannot import 'nowhere.module'"),
        (["--backend", "torch"], "megatron flags (--tensor-model-parallel-size 2"),
        (["--actor-num-gpus-per-node", "2"], "--actor-num-gpus-per-node 2: world size 2 is not"),
        (
            ["--actor-num-nodes", "3", "--actor-num-gpus-per-node", "2"],
            "--actor-num-nodes 3 x --actor-num-gpus-per-node 2 = 6 GPUs: world size 6 is not a "
            "multiple of TP × PP × CP = 2 × 1 × 2 = 4",
        ),
        (
            ["--rollout-num-gpus", "3"],
            "--rollout-num-gpus 3 is not a multiple of --rollout-num-gpus-per-engine 2",
        ),
        (
            ["--colocate", "--rollout-device", "cuda:4"],
            "--colocate puts the engines on the trainer's GPUs, but --rollout-device is for",
        ),
        (["--ray-address", "nowhere"], "--ray-address must be auto, local, HOST:PORT or ray://"),
        (["--device", "cuda:1"], "--device cuda:1: on Ray the placement picks each rank's GPU"),
        (["--rollout-engine", "serve"], "--sglang-* flags (--mem-fraction-static 0.5)"),
        (
            ["--use-kl-loss", "--kl-loss-coef", "0.1"],
            "--ref-load '/root/GLM-Z1-9B-0414_torch_dist'",
        ),
        (["--rollout-batch-size", "64", "--global-batch-size", "512"], "only 40 distinct tasks"),
    ],
)
def test_a_dry_run_finds_what_a_run_would_stop_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: list[str], message: str
) -> None:
    assert _train([*_argv(tmp_path), *change]) == 2
    err = capsys.readouterr().err
    assert err.startswith("agentenv train: error: ") and message in err


def test_the_torch_backend_refuses_megatrons_reference_and_parallelism_clearly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    megatron_only = ("--tensor-model-parallel-size", "--sequence-parallel",
                     "--pipeline-model-parallel-size", "--context-parallel-size")  # fmt: skip
    argv = [a for a in _argv(tmp_path, without=megatron_only) if a != "megatron"]
    argv = [a for a in argv if a != "--backend"]
    assert _train([*argv, "--backend", "torch"]) == 2
    err = capsys.readouterr().err
    assert "--ref-load '/root/GLM-Z1-9B-0414_torch_dist' is a megatron reference checkpoint" in err
    assert "leave --ref-load out, or pass --backend megatron" in err
    assert _train([*_argv(tmp_path), "--backend", "torch"]) == 2
    assert "need --backend megatron" in capsys.readouterr().err


def test_slimes_placement_flags_are_read_into_the_placement_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    placement = ["--actor-num-nodes", "1", "--rollout-num-gpus", "4", "--ray-address", "auto"]
    assert _train([*_argv(tmp_path), *placement]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placement"] == (
        "8 bundles of {GPU: 1, CPU: 1} (1 node(s) x 4 trainer GPUs + 4 engine GPUs, disaggregated)"
    )
    config = out["config"]
    assert config["placement"] == {
        "ray_address": "auto", "actor_num_nodes": 1, "rollout_num_gpus": 4,
        "colocate": False, "placement_timeout": 120.0, "rollout_num_workers": 0,
        "rollout_num_cpus_per_worker": 1.0, "rollout_worker_resource": None,
        "rollout_worker_retries": 2, "rollout_worker_max_rss_mb": None,
    }  # fmt: skip
    assert _train([*_argv(tmp_path), "--colocate"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["placement"]["colocate"] is True


def test_a_dry_run_resolves_the_settings_left_unset_for_the_device(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert _train(["--env", "arithmetic"]) == 0
    resolved = json.loads(capsys.readouterr().out)["resolved"]
    assert resolved == {
        "max_tokens_per_gpu": 1024, "rollout_device": "cpu", "offload_rollout": True,
        "eps_clip_high": 0.2, "global_batch_size": 32, "logprob_temperature": 1.0,
        "precision": "fp32", "compile": False, "gradient_checkpointing": True,
    }  # fmt: skip
    argv = ["--env", "arithmetic", "--device", "cuda", "--schedule", "async",
            "--eps-clip-high", "0.3", "--max-tokens-per-gpu", "512"]  # fmt: skip
    assert _train(argv) == 0
    resolved = json.loads(capsys.readouterr().out)["resolved"]
    assert resolved == resolved | {
        "max_tokens_per_gpu": 512, "rollout_device": "cuda", "offload_rollout": False,
        "eps_clip_high": 0.3, "precision": "bf16-autocast", "compile": True,
    }  # fmt: skip


def test_a_row_nested_too_deep_is_skipped_like_other_bad_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "deep.jsonl"
    good = "".join(json.dumps({"prompt": f"{i}?", "label": str(i)}) + "\n" for i in range(4))
    prompts.write_text(good + '{"prompt": ' + "[" * 100_000 + "\n")
    argv = ["--prompt-data", str(prompts), "--rm-type", "math", "--rollout-batch-size", "4"]
    assert _train(argv) == 0
    found = json.loads(capsys.readouterr().out)["found"]
    assert found["skipped_rows"] == ["deep.jsonl line 5: JSON nested too deep to parse"]


LONG_ENV = """
from agentenv import Rubric, SingleTurnEnv, Task


class LongEnv(SingleTurnEnv):
    rubric = Rubric(lambda task, state: 1.0)
    sampling = {"max_new_tokens": 96, "temperature": 0.5}

    def tasks(self, split="train"):
        return [Task(id=str(i), prompt=f"say {i}") for i in range(8)]
"""


def test_a_dry_run_shows_the_sampling_that_will_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "long_env.py").write_text(LONG_ENV)
    env = ["--env", f"{tmp_path / 'long_env.py'}:LongEnv"]
    assert _train(env) == 0  # the environment's defaults replace the command's
    out = json.loads(capsys.readouterr().out)
    sampling = out["config"]["rollout"]["sampling"]
    assert (sampling["max_new_tokens"], sampling["temperature"]) == (96, 0.5)
    assert out["resolved"]["logprob_temperature"] == 0.5  # the log-probs follow
    assert out["env_sampling"] == {"max_new_tokens": 96, "temperature": 0.5}
    assert _train([*env, "--rollout-max-response-len", "32"]) == 0  # the flag wins
    out = json.loads(capsys.readouterr().out)
    sampling = out["config"]["rollout"]["sampling"]
    assert (sampling["max_new_tokens"], sampling["temperature"]) == (32, 0.5)
    assert out["env_sampling"] == {"temperature": 0.5}
    assert (
        "--rollout-max-response-len 32 wins over LongEnv.sampling's max_new_tokens=96"
        in caplog.text
    )
