"""``agentenv train`` (an ``agentenv`` plug-in): GRPO on an environment, torch backend.

    agentenv train --env arithmetic --hf-checkpoint smollm2-135m --num-rollout 10 \\
        --rollout-batch-size 8 --n-samples-per-prompt 4 --lr 1e-6 --save runs/a --json

Flags use slime's names. The configuration (the batch identity included) is validated
before anything heavy loads. The run evaluates held-out tasks before and after training
(greedy by default), prints one progress line per rollout step, writes every step's
metrics to ``SAVE/metrics.jsonl``, a checkpoint (model, optimizer, RNG, position) to
``SAVE/checkpoint`` every ``--save-interval`` steps, and the trained model to
``SAVE/model``. Run the same command again (or pass ``--load RUN``) and it resumes after
the last checkpoint, as if it had never stopped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import pydantic

from agentenv import ConfigError, Task

__all__ = ["TrainConfig", "add_parser"]


class TrainConfig(pydantic.BaseModel):
    """Settings of ``agentenv train`` (slime's flag names)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    env: str = pydantic.Field(description="registered environment name or module:Class")
    env_args: dict[str, Any] = pydantic.Field(
        default_factory=dict, description="JSON object of keyword arguments for the environment"
    )
    hf_checkpoint: str = pydantic.Field("smollm2-135m", description="model name or HF directory")
    prompt_data: Path | None = pydantic.Field(
        None, description="JSONL of training prompts (default: the environment's train split)"
    )
    input_key: str = pydantic.Field("prompt", description="the prompt's key in --prompt-data")
    label_key: str | None = pydantic.Field(
        "label", description="the answer's key in --prompt-data (the reward compares with it)"
    )
    save: Path | None = pydantic.Field(
        None, description="directory for metrics, checkpoints (SAVE/checkpoint) and the model"
    )
    save_interval: int = pydantic.Field(1, ge=1, description="rollout steps between checkpoints")
    load: Path | None = pydantic.Field(
        None, description="resume from this run directory's checkpoint (default: --save's)"
    )
    num_rollout: int = pydantic.Field(10, ge=1, description="rollout steps")
    rollout_batch_size: int = pydantic.Field(8, ge=1, description="prompts per rollout step")
    n_samples_per_prompt: int = pydantic.Field(4, ge=1, description="episodes per prompt")
    global_batch_size: int | None = pydantic.Field(
        None, ge=1, description="samples per optimizer step (default: a whole rollout)"
    )
    num_steps_per_rollout: int = pydantic.Field(1, ge=1, description="optimizer steps per rollout")
    rollout_max_response_len: int = pydantic.Field(128, ge=1, description="tokens per turn")
    rollout_temperature: float = pydantic.Field(1.0, ge=0.0, description="sampling temperature")
    rollout_seed: int = pydantic.Field(0, description="seed of task order and sampling")
    advantage_estimator: Literal["grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline"] = (
        pydantic.Field("grpo", description="advantage estimator")
    )
    eps_clip: float = pydantic.Field(0.2, ge=0.0, description="lower clip of the ratio")
    eps_clip_high: float | None = pydantic.Field(None, ge=0.0, description="upper clip")
    entropy_coef: float = pydantic.Field(0.0, ge=0.0, description="entropy bonus weight")
    use_kl_loss: bool = pydantic.Field(
        False, description="penalise KL to the starting model (loads a frozen copy)"
    )
    kl_loss_coef: float = pydantic.Field(0.0, ge=0.0, description="weight of the KL penalty")
    kl_loss_type: Literal["k1", "k2", "k3", "low_var_kl"] = pydantic.Field(
        "low_var_kl", description="KL estimator"
    )
    calculate_per_token_loss: bool = pydantic.Field(
        False, description="average the loss over tokens instead of samples"
    )
    use_tis: bool = pydantic.Field(False, description="truncated importance sampling")
    lr: float = pydantic.Field(1e-6, gt=0.0, description="learning rate")
    weight_decay: float = pydantic.Field(0.0, ge=0.0, description="AdamW weight decay")
    adam_beta1: float = pydantic.Field(0.9, ge=0.0, lt=1.0, description="Adam beta1")
    adam_beta2: float = pydantic.Field(0.98, ge=0.0, lt=1.0, description="Adam beta2")
    clip_grad: float = pydantic.Field(1.0, ge=0.0, description="gradient norm clip (0: off)")
    max_tokens_per_gpu: int = pydantic.Field(4096, ge=1, description="micro-batch token budget")
    n_eval: int = pydantic.Field(64, ge=0, description="held-out tasks evaluated before/after")
    eval_interval: int = pydantic.Field(
        0, ge=0, description="also evaluate every N rollout steps (0: only before and after)"
    )
    eval_temperature: float = pydantic.Field(0.0, ge=0.0, description="evaluation sampling")
    device: str = pydantic.Field("cpu", description="cpu, cuda or cuda:N")

    @pydantic.model_validator(mode="after")
    def _clips(self) -> TrainConfig:
        if self.use_kl_loss and self.kl_loss_coef <= 0:
            raise ValueError("--use-kl-loss needs --kl-loss-coef > 0")
        if self.eps_clip_high is not None and self.eps_clip_high < self.eps_clip:
            raise ValueError(
                f"--eps-clip-high ({self.eps_clip_high}) must be >= --eps-clip ({self.eps_clip})"
            )
        return self


def add_parser(sub: Any) -> None:
    from agentenv.cli._config import add_model_arguments

    parser: argparse.ArgumentParser = sub.add_parser(
        "train",
        help="train a model on an environment with GRPO",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_model_arguments(parser, TrainConfig)
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    from agentenv.cli._config import build_config

    config = build_config(TrainConfig, args)
    try:
        result = train(config)
    except ConfigError as e:
        print(f"agentenv train: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0


def train(config: TrainConfig) -> dict[str, Any]:
    """Run ``config``; returns the summary (rewards before and after, timings)."""
    import anyio
    import torch

    from agentenv import ChatTokenizer, RolloutConfig, SamplingParams, load_environment
    from agentenv import run_rollouts as rollouts
    from agentenv.engine import Engine
    from trainer._loop import GRPOConfig, run_grpo
    from trainer._losses import LossConfig
    from trainer._torch import OptimConfig, TorchBackend

    sampling = SamplingParams(
        max_new_tokens=config.rollout_max_response_len, temperature=config.rollout_temperature
    )
    grpo = GRPOConfig(  # checks the batch identity before anything heavy loads
        num_rollout=config.num_rollout,
        rollout_batch_size=config.rollout_batch_size,
        n_samples_per_prompt=config.n_samples_per_prompt,
        global_batch_size=config.global_batch_size,
        num_steps_per_rollout=config.num_steps_per_rollout,
        advantage_estimator=config.advantage_estimator,
        sampling=sampling,
        seed=config.rollout_seed,
    )
    loss = LossConfig(
        eps_clip=config.eps_clip,
        eps_clip_high=config.eps_clip_high,
        entropy_coef=config.entropy_coef,
        aggregation="per_token" if config.calculate_per_token_loss else "per_sample",
        kl_coef=config.kl_loss_coef if config.use_kl_loss else 0.0,
        kl_type=config.kl_loss_type,
        use_tis=config.use_tis,
    )
    optim = OptimConfig(
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        weight_decay=config.weight_decay,
        grad_clip=config.clip_grad,
    )
    env = load_environment(config.env, config.env_args)
    train_tasks: Sequence[Task]
    if config.prompt_data is not None:
        from trainer._data import load_prompt_data

        train_tasks = load_prompt_data(
            config.prompt_data, input_key=config.input_key, label_key=config.label_key
        )
    else:
        train_tasks = env.tasks("train")
    eval_tasks = env.tasks("test")[: config.n_eval]
    tokenizer = ChatTokenizer.load(config.hf_checkpoint)
    started = time.perf_counter()
    backend = TorchBackend(
        config.hf_checkpoint,
        device=config.device,
        optim=optim,
        loss=loss,
        max_tokens_per_micro_batch=config.max_tokens_per_gpu,
    )
    metrics_file = None
    checkpoint = None
    if config.save is not None:
        config.save.mkdir(parents=True, exist_ok=True)
        checkpoint = config.save / "checkpoint"
        source = (config.load or config.save) / "checkpoint"
        if config.load is not None and not source.is_dir():
            raise ConfigError(f"--load {str(config.load)!r} has no checkpoint directory")
        if source != checkpoint and source.is_dir():
            import shutil

            shutil.rmtree(checkpoint, ignore_errors=True)
            shutil.copytree(source, checkpoint)
        resuming = checkpoint.is_dir()
        metrics_file = (config.save / "metrics.jsonl").open("a" if resuming else "w")
    elif config.load is not None:
        raise ConfigError("--load needs --save (where the resumed run writes)")

    def report(m: dict[str, float]) -> None:
        line = (
            f"step {int(m['step']) + 1}/{config.num_rollout}  reward {m['reward_mean']:.3f}  "
            f"rollout {m['time_rollout_s']:.1f}s  train {m['time_train_s']:.1f}s  "
            f"sync {m['time_sync_s']:.2f}s"
        )
        print(line, file=sys.stderr, flush=True)
        if metrics_file is not None:
            metrics_file.write(json.dumps(m) + "\n")
            metrics_file.flush()

    async def evaluate(engine: Any) -> float | None:
        if not eval_tasks:
            return None
        stats = await rollouts(
            env,
            eval_tasks,
            engine,
            tokenizer=tokenizer,
            config=RolloutConfig(
                n_samples_per_prompt=1,
                sampling=SamplingParams(
                    max_new_tokens=config.rollout_max_response_len,
                    temperature=config.eval_temperature,
                ),
                seed=12345,
                progress=False,
            ),
        )
        return stats.reward_mean

    async def go() -> dict[str, Any]:
        dtype = torch.bfloat16 if config.device.startswith("cuda") else torch.float32
        async with Engine(
            config.hf_checkpoint, device=config.device, dtype=dtype, tokenizer=tokenizer
        ) as engine:
            before = await evaluate(engine)
            print(f"held-out reward before: {before}", file=sys.stderr, flush=True)
            history = await run_grpo(
                env, train_tasks, backend, engine, tokenizer, grpo, on_step=report,
                checkpoint=checkpoint, save_interval=config.save_interval,
                evaluate=lambda: evaluate(engine), eval_interval=config.eval_interval,
            )  # fmt: skip
            after = await evaluate(engine)
            print(f"held-out reward after: {after}", file=sys.stderr, flush=True)
        return {"before": before, "after": after, "history": history}

    try:
        out = anyio.run(go)
    finally:
        if metrics_file is not None:
            metrics_file.close()
    before, after = out["before"], out["after"]
    plot = None
    if config.save is not None:
        backend.model.save_pretrained(config.save / "model", safe_serialization=True)
        if out["history"]:
            try:
                from trainer._plot import plot_run

                plot = str(
                    plot_run(
                        out["history"],
                        config.save / "metrics.png",
                        title=f"GRPO on {config.env}",
                        eval_before=before,
                        eval_after=after,
                    )
                )
                print(f"plot: {plot}", file=sys.stderr)
            except ImportError:
                print("no plot: matplotlib is not installed (agentenv[train])", file=sys.stderr)
    return {
        "env": config.env,
        "steps": config.num_rollout,
        "eval_tasks": len(eval_tasks),
        "eval_reward_before": before,
        "eval_reward_after": after,
        "eval_gain": None if before is None or after is None else after - before,
        "train_reward_first": out["history"][0]["reward_mean"] if out["history"] else None,
        "train_reward_last": out["history"][-1]["reward_mean"] if out["history"] else None,
        "wall_s": round(time.perf_counter() - started, 1),
        "plot": plot,
    }
