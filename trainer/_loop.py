"""The synchronous GRPO loop: roll out with the current weights, train, sync, repeat.

Each rollout step plays ``rollout_batch_size`` tasks ``n_samples_per_prompt`` times on the
engine, through the Data Buffer (groups, the failed-sample policy, the batch identity),
takes the batch, computes advantages, runs ``num_steps_per_rollout`` optimizer steps of
``global_batch_size`` samples, installs the new weights in the engine in-process (tokens
generated after it carry the new weight version), and acknowledges the batch.
"""

from __future__ import annotations

import dataclasses
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import anyio

from agentenv import (
    ConfigError,
    Environment,
    RolloutConfig,
    SamplingParams,
    Task,
    Tokenizer,
    run_rollouts,
)
from agentenv.buffer import Buffer, BufferConfig
from trainer._advantages import ESTIMATORS, compute_advantages
from trainer._torch import TorchBackend

__all__ = ["GRPOConfig", "run_grpo"]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class GRPOConfig:
    """The loop's schedule (slime's flag names).

    ``rollout_batch_size × n_samples_per_prompt`` must equal
    ``global_batch_size × num_steps_per_rollout``: every sample of a rollout is trained
    on exactly once.
    """

    num_rollout: int = 10
    rollout_batch_size: int = 8
    n_samples_per_prompt: int = 4
    global_batch_size: int | None = None  # default: a whole rollout per optimizer step
    num_steps_per_rollout: int = 1
    advantage_estimator: str = "grpo"
    sampling: SamplingParams = dataclasses.field(
        default_factory=lambda: SamplingParams(max_new_tokens=128, temperature=1.0)
    )
    concurrency: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("num_rollout", "rollout_batch_size", "n_samples_per_prompt"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.advantage_estimator not in ESTIMATORS:
            raise ConfigError(
                f"unknown advantage estimator {self.advantage_estimator!r}; "
                f"valid: {', '.join(ESTIMATORS)}"
            )
        self.buffer_config()  # checks the batch identity, naming the four numbers

    @property
    def samples_per_step(self) -> int:
        return self.global_batch_size or self.rollout_batch_size * self.n_samples_per_prompt

    def buffer_config(self) -> BufferConfig:
        return BufferConfig(
            n_samples_per_prompt=self.n_samples_per_prompt,
            rollout_batch_size=self.rollout_batch_size,
            global_batch_size=self.samples_per_step,
            num_steps_per_rollout=self.num_steps_per_rollout,
        )


def _task_stream(tasks: Sequence[Task], seed: int) -> Callable[[int], list[Task]]:
    """Take ``n`` tasks at a time, reshuffling (seeded) at each pass over the data."""
    rng = random.Random(seed)
    order: list[Task] = []

    def take(n: int) -> list[Task]:
        out: list[Task] = []
        ids: set[str] = set()
        while len(out) < n:
            if not order:
                order.extend(tasks)
                rng.shuffle(order)
            task = order.pop()
            if task.id in ids:  # a new pass began mid-batch: keep it for the next batch
                order.insert(0, task)
                continue
            ids.add(task.id)
            out.append(task)
        return out

    return take


async def run_grpo(
    env: Environment,
    tasks: Sequence[Task],
    backend: TorchBackend,
    engine: Any,
    tokenizer: Tokenizer,
    config: GRPOConfig | None = None,
    *,
    on_step: Callable[[dict[str, float]], None] | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    save_interval: int = 1,
    evaluate: Callable[[], Awaitable[float | None]] | None = None,
    eval_interval: int = 0,
) -> list[dict[str, float]]:
    """Train ``backend``'s model on ``env`` with samples from ``engine`` (an embedded
    :class:`~agentenv.engine.Engine`, whose weights follow the trainer's after every
    rollout step). Returns one metrics dict per rollout step run.

    With ``checkpoint``, the model, optimizer, RNG state and the loop's position are saved
    there every ``save_interval`` steps (and after the last); a run that finds a
    checkpoint there resumes after its step, as if it had never stopped. Resuming with
    another batch schedule is refused. ``evaluate`` (e.g. the reward on held-out tasks)
    runs every ``eval_interval`` steps, into that step's ``eval/reward_mean``.
    """
    config = config or GRPOConfig()
    if len({t.id for t in tasks}) < config.rollout_batch_size:
        raise ConfigError(
            f"rollout_batch_size is {config.rollout_batch_size} but there are only "
            f"{len({t.id for t in tasks})} distinct tasks"
        )
    take = _task_stream(tasks, config.seed)
    history: list[dict[str, float]] = []
    first = 0
    schedule = _schedule(config)
    if checkpoint is not None and await anyio.Path(checkpoint, "checkpoint.json").exists():
        saved = backend.load_checkpoint(checkpoint)
        if saved.get("schedule") != schedule:
            raise ConfigError(
                f"cannot resume {str(checkpoint)!r} with another schedule: it was saved with "
                f"{saved.get('schedule')}, this run has {schedule}"
            )
        first = int(saved["step"]) + 1
        for _ in range(first):  # the task stream is seeded: replay its position
            take(config.rollout_batch_size)
        await engine.update_weights(backend.state_dict(), weight_version=str(first))
    async with Buffer(config.buffer_config()) as buffer:
        for step in range(first, config.num_rollout):
            t0 = time.perf_counter()
            rollout = await run_rollouts(
                env,
                take(config.rollout_batch_size),
                engine,
                tokenizer=tokenizer,
                sink=buffer,
                config=RolloutConfig(
                    n_samples_per_prompt=config.n_samples_per_prompt,
                    sampling=config.sampling,
                    concurrency=config.concurrency,
                    seed=config.seed + step,
                    progress=False,
                ),
            )
            # Every group of this rollout is in the Buffer now, kept or dropped (failed
            # samples, filters): take what was kept, never wait for groups that will not come.
            ready = (await buffer.statistics()).ready
            batch = await buffer.get_batch(ready) if ready else None
            samples = [s for s in batch.samples if s.trainable] if batch else []
            t1 = time.perf_counter()
            metrics: dict[str, float] = {
                "step": float(step),
                "reward_mean": rollout.reward_mean,
                "samples": float(len(samples)),
                "failed_episodes": float(sum(rollout.failed.values())),
            }
            if samples:
                adv = compute_advantages(
                    [s.reward for s in samples],
                    [s.group_id for s in samples],
                    config.advantage_estimator,
                )
                per = config.samples_per_step
                # Several steps per rollout: the old policy is the one that sampled, so its
                # log-probs are taken before the first update (one step: train_step does it
                # with its own micro-batches, which makes the ratio exactly 1).
                old = backend.logprobs(samples) if len(samples) > per else None
                ref = backend.logprobs(samples, reference=True) if backend.reference else None
                for k in range(0, len(samples), per):
                    part = backend.train_step(
                        samples[k : k + per],
                        adv[k : k + per],
                        old_logprobs=old[k : k + per] if old is not None else None,
                        ref_logprobs=ref[k : k + per] if ref is not None else None,
                    )
                    for name, value in part.items():
                        metrics[f"train/{name}" if "/" not in name else name] = value
            t2 = time.perf_counter()
            await engine.update_weights(backend.state_dict(), weight_version=str(step + 1))
            if batch is not None:
                await buffer.ack(batch, step=step)
            t3 = time.perf_counter()
            metrics.update(time_rollout_s=t1 - t0, time_train_s=t2 - t1, time_sync_s=t3 - t2)
            if evaluate is not None and eval_interval > 0 and (step + 1) % eval_interval == 0:
                held_out = await evaluate()
                if held_out is not None:
                    metrics["eval/reward_mean"] = held_out
            if checkpoint is not None and (
                (step + 1) % max(save_interval, 1) == 0 or step == config.num_rollout - 1
            ):
                backend.save_checkpoint(checkpoint, {"step": step, "schedule": schedule})
            history.append(metrics)
            if on_step is not None:
                on_step(metrics)
    return history


def _schedule(config: GRPOConfig) -> dict[str, Any]:
    """What a resumed run must share with the saved one."""
    return {
        "rollout_batch_size": config.rollout_batch_size,
        "n_samples_per_prompt": config.n_samples_per_prompt,
        "global_batch_size": config.samples_per_step,
        "num_steps_per_rollout": config.num_steps_per_rollout,
        "seed": config.seed,
    }
