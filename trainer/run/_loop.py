"""The GRPO loop: roll out, train, sync the weights, repeat -- on one of three schedules
(``sync``, ``one_step_off``, ``async``: what each overlaps and how stale its samples may be
is in docs/trainer.md, "Schedules").

Each step takes the kept groups of ``rollout_batch_size`` prompts from the Data Buffer
(failed samples and dynamic-sampling filters drop groups; over-sampling makes up for
them; a multi-agent episode gives one group per role), computes advantages, runs
``num_steps_per_rollout`` optimizer steps, syncs the weights (``WeightSync``) and
acknowledges the batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import torch

from agentenv import ConfigError, Environment, Sample, Task, Tokenizer
from agentenv.buffer import Batch, Buffer
from agentenv.engine import use_torch_threads
from agentenv.games import game_metrics
from trainer._resources import peak_rss_gib
from trainer.algorithm import compute_advantages, gradient_without_advantage
from trainer.backends import Backend, CheckpointWriter
from trainer.config import GRPOConfig, logprob_temperature
from trainer.engines import OffloadHooks, RolloutEngine, WeightSync
from trainer.run._producer import Producer, RoundStats, TaskStream

if TYPE_CHECKING:
    from trainer.distributed import RolloutWorkers

__all__ = ["StepHooks", "run_grpo"]


class StepHooks(Protocol):
    """What the driver does around each training step, beside the loop's own work (the
    engines of a run on Ray: :class:`~trainer.distributed.EngineHooks`)."""

    async def before_train(self, step: int) -> None:
        """Before step ``step``'s optimizer steps, after its rollout (e.g. engines that
        share the trainer's GPUs give their memory back)."""

    async def after_train(self, step: int) -> None:
        """After the optimizer steps, before the weight sync (e.g. the engines take their
        memory back, so that they can load the new weights)."""

    def metrics(self) -> dict[str, float]:
        """Metrics added to each step's (e.g. the engines' deaths and replacements)."""


async def run_grpo(
    env: Environment,
    tasks: Sequence[Task],
    backend: Backend,
    engine: RolloutEngine,
    tokenizer: Tokenizer,
    config: GRPOConfig | None = None,
    *,
    sync: WeightSync | None = None,
    on_step: Callable[[dict[str, float]], None] | None = None,
    checkpoint: str | os.PathLike[str] | None = None,
    buffer_path: str | os.PathLike[str] | None = None,
    save_interval: int = 10,
    keep_checkpoints: int = 1,
    evaluate: Callable[[], Awaitable[float | None]] | None = None,
    eval_interval: int = 0,
    hooks: StepHooks | None = None,
    workers: RolloutWorkers | None = None,
    on_batch: Callable[[int, Batch], None] | None = None,
) -> list[dict[str, float]]:
    """Train ``backend``'s model on ``env`` with samples from ``engine`` (a
    :class:`~trainer.RolloutEngine`); one metrics dict per rollout step (docs/trainer.md,
    "The loop", and "Checkpoint and resume" for what follows in detail).

    The new weights reach the engine after every step (``sync``: a push in place of
    :meth:`RolloutEngine.sync_weights <trainer.RolloutEngine.sync_weights>`). With
    ``checkpoint`` the model, optimizer, RNG state and the loop's position are saved there
    every ``save_interval`` steps and after the last, atomically (in the background where
    the backend has :meth:`~trainer.Backend.checkpoint_snapshot`; complete when this
    returns), the ``keep_checkpoints`` newest kept; a run that finds one resumes after its
    step (another batch schedule is refused). Every run goes through one
    :class:`~agentenv.buffer.Buffer` (:meth:`GRPOConfig.buffer_config`); with
    ``buffer_path`` it is durable there, and a run killed at any moment resumes with every
    group committed to it: none played again, none trained twice, none lost.

    ``evaluate`` runs every ``eval_interval`` steps (``eval/reward_mean``); ``on_step(metrics)``
    runs in a worker thread after each step (a report's file writes do not hold up the
    episodes); ``hooks`` (:class:`StepHooks`) run around each step's training, by default
    :class:`~trainer.OffloadHooks` for an engine that ``config.offloads``; ``workers``
    (:class:`~trainer.distributed.RolloutWorkers`) play the rounds on Ray, the Buffer served
    to them; ``on_batch(step, batch)`` runs once each step's batch is acknowledged.
    """
    # The environment's sampling in place of the settings not given (once: train() did).
    config = (config or GRPOConfig()).for_env(env)
    config.check_tasks(tasks)
    sync = sync or engine.sync_weights
    if hooks is None and config.offloads(engine):
        if engine.device is None:
            raise ConfigError(
                f"offload_rollout (--offload-rollout) needs an embedded engine, not a "
                f"{type(engine).__name__} (engines on Ray release theirs with --colocate)"
            )
        hooks = OffloadHooks(engine)
    stream = TaskStream(tasks, seed=config.seed, shuffle=config.shuffle)
    history: list[dict[str, float]] = []
    first = 0
    schedule = _schedule(config)
    roles = _roles(env)
    if checkpoint is not None and await anyio.Path(checkpoint, "checkpoint.json").exists():
        saved = backend.load_checkpoint(checkpoint)
        if saved.get("schedule") != schedule:
            raise ConfigError(
                f"cannot resume {str(checkpoint)!r} with another schedule: it was saved with "
                f"{saved.get('schedule')}, this run has {schedule}"
            )
        first = int(saved["step"]) + 1
        stream.restore(saved["tasks"])
    # The engines serve the trainer's weights, stamped with integer versions (staleness).
    await sync(backend, first)
    # What a checkpoint after step k saves: the task position before step k + 1's rounds.
    positions: dict[int, dict[str, Any]] = {first: stream.state()}
    # The log-probs are of the distribution the rollouts sample from.
    temperature = logprob_temperature(config.sampling)
    concurrency = config.concurrency_for(engine)
    # The producer runs in a task group: an error of its own or of a step surfaces as
    # itself (a ConfigError found at run time reads like one found before the start).
    with _lone_error():
        async with contextlib.AsyncExitStack() as stack:
            buffer = await stack.enter_async_context(
                Buffer(config.buffer_config(roles), path=buffer_path)
            )
            if workers is not None:
                await stack.enter_async_context(workers.serving(buffer))
            tg = await stack.enter_async_context(anyio.create_task_group())
            writer = CheckpointWriter(tg, keep=keep_checkpoints)
            await buffer.set_policy_version(first)
            producer = Producer(
                env, stream, engine, tokenizer, buffer, config, concurrency=concurrency,
                players=workers, max_groups_per_prompt=roles,
            )  # fmt: skip
            # A durable Buffer left by a run that stopped: it and the producer's note in it
            # take over from the checkpoint (which is older), the steps after it rewound.
            replay: dict[int, int] = {}
            if buffer_path is not None:
                await producer.resume(schedule)
                replay = await _rewind(buffer, first)
                if (await buffer.statistics()).ready:
                    producer.first_put.set()
            if config.schedule == "async":
                tg.start_soon(producer.run_forever, first)
            else:
                await producer.replay_open()
            ahead: anyio.Event | None = None  # one_step_off: the next step's rollout is done
            peaks: dict[str, float] = {}  # each role's peak resident set so far
            stored = (await buffer.statistics()).store_s  # the store's seconds so far
            for step in range(first, config.num_rollout):
                writer.check()  # a checkpoint written in the background failed: stop
                if backend.device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(backend.device)
                t0 = time.perf_counter()
                batch = await _take_batch(config, producer, buffer, step, ahead, replay.get(step))
                rounds = producer.take_stats()
                positions[step + 1] = stream.state()
                if config.schedule == "one_step_off" and step + 1 < config.num_rollout:
                    ahead = anyio.Event()
                    tg.start_soon(_fill_then_set, producer, step + 1, config, ahead)
                samples = [s for s in batch.samples if s.trainable] if batch else []
                t1 = time.perf_counter()
                metrics = _rollout_metrics(step, rounds, samples)
                metrics["rollout/concurrency"] = float(concurrency)
                plan = _plan_train(backend, samples, config) if samples else None
                if plan is not None and plan.live:
                    if hooks is not None:
                        await hooks.before_train(step)
                    metrics.update(
                        await anyio.to_thread.run_sync(_train, backend, plan, step, temperature)
                    )
                    if hooks is not None:
                        await hooks.after_train(step)
                if plan is not None:
                    metrics["train/skipped_no_gradient"] = float(plan.skipped)
                    # The schedule's rate at the step's last planned update, taken or not.
                    last = step * plan.steps + len(plan.parts) - 1
                    metrics["train/lr"] = backend.optim_config.lr_at(last)
                t2 = time.perf_counter()
                if ahead is not None:
                    await ahead.wait()  # one_step_off: weights change between rollouts only
                t3 = time.perf_counter()
                await sync(backend, step + 1)
                await buffer.set_policy_version(step + 1)
                if batch is not None:
                    await buffer.ack(batch, step=step)
                    if on_batch is not None:
                        on_batch(step, batch)
                t4 = time.perf_counter()
                # What the Buffer's store took since the last step (durable: the fsyncs of
                # puts, acknowledgement and notes; mostly in a thread, beside the step).
                stored, was = (await buffer.statistics()).store_s, stored
                metrics["buffer/store_s"] = stored - was
                trained = [s for j in plan.live for s in plan.parts[j]] if plan else []
                tokens = sum(len(s.prompt_ids) + len(s.completion_ids) for s in trained)
                metrics.update(
                    time_rollout_s=t1 - t0,
                    time_train_s=t2 - t1,
                    time_wait_s=t3 - t2,
                    time_sync_s=t4 - t3,
                    time_step_s=t4 - t0,
                    **{"perf/train_tokens_per_s": tokens / (t2 - t1) if trained else 0.0},
                )
                # The engines', the hooks' (which may report the engines' too) and the workers'.
                metrics.update(engine.metrics())
                metrics.update(hooks.metrics() if hooks is not None else {})
                metrics.update(workers.metrics() if workers is not None else {})
                # The backend's processes elsewhere (the ranks on Ray) answer in a thread.
                metrics.update(await anyio.to_thread.run_sync(backend.memory_metrics))
                metrics.update(_peak_memory(backend.device, metrics, peaks))
                if evaluate is not None and eval_interval > 0 and (step + 1) % eval_interval == 0:
                    held_out = await evaluate()
                    if held_out is not None:
                        metrics["eval/reward_mean"] = held_out
                if checkpoint is not None and (
                    (step + 1) % max(save_interval, 1) == 0 or step == config.num_rollout - 1
                ):
                    extra = {"step": step, "schedule": schedule, "tasks": positions[step + 1]}
                    metrics["time_checkpoint_s"] = await writer.save(backend, checkpoint, extra)
                positions.pop(step, None)
                history.append(metrics)
                if on_step is not None:  # off the event loop: reports write files
                    await anyio.to_thread.run_sync(on_step, metrics)
            await writer.wait()  # the last checkpoint is complete
            tg.cancel_scope.cancel()  # async / one_step_off: rollouts nobody will train on
    return history


async def _take_batch(
    config: GRPOConfig,
    producer: Producer,
    buffer: Buffer,
    step: int,
    ahead: anyio.Event | None,
    redo: int | None = None,
) -> Batch | None:
    """Step ``step``'s batch. async: the next full batch within the staleness bound (the
    producer plays continuously). sync / one_step_off: this step's rounds (played now, or,
    one_step_off, already under way), then whatever the filters kept, at most a batch --
    never waiting for groups that will not come. ``redo``: the step was trained before the
    run resumed, on that many groups -- the oldest ready now, which it takes again."""
    # (groups_per_prompt is known once rounds have been played: a game's roles.)
    if config.schedule == "async":
        await producer.first_put.wait()
        groups = redo or config.rollout_batch_size * producer.groups_per_prompt
        return await buffer.get_batch(groups, policy_version=step)
    if ahead is None:
        await producer.fill(step, config.rollout_batch_size)
    else:
        await ahead.wait()
    await buffer.drop_stale()
    ready = (await buffer.statistics()).ready
    n = min(ready, redo or config.rollout_batch_size * producer.groups_per_prompt)
    return await buffer.get_batch(n) if n else None


#: The key of the loop's note in a durable Buffer: the groups each step took that a
#: resume rewound, until the step is trained again.
REDO = "redo"


async def _rewind(buffer: Buffer, first: int) -> dict[int, int]:
    """Give back to ``buffer`` what the steps from ``first`` on (after the checkpoint the
    run resumes from) consumed; returns how many groups each of them took. Noted in the
    Buffer before the rewind forgets it, with what an earlier resume rewound and no step
    took again since (a run killed again before it redid them)."""
    noted = await buffer.note(REDO) or {}
    redo = {int(k): int(n) for k, n in noted.items() if int(k) >= first}
    redo.update(await buffer.steps_after(first - 1))
    await buffer.set_note(REDO, {str(k): n for k, n in sorted(redo.items())})
    await buffer.rewind(first - 1)
    return redo


def _roles(env: Environment) -> int:
    """The groups one prompt gives: one per role of a game (its ``roles``), else one."""
    roles = getattr(env, "roles", None)
    if isinstance(roles, (tuple, list)) and roles and all(isinstance(r, str) for r in roles):
        return len(roles)
    return 1


@dataclasses.dataclass(frozen=True, slots=True)
class TrainPlan:
    """A rollout step's optimizer steps: ``steps`` planned (``num_steps_per_rollout``),
    each on its share of the samples (``parts``, with their ``advantages``); ``live``
    the indices of the parts that carry a gradient -- the others are not run."""

    steps: int
    parts: list[list[Sample]]
    advantages: list[torch.Tensor]
    live: list[int]

    @property
    def skipped(self) -> int:
        """Optimizer steps not run: none of their samples carries a gradient."""
        return len(self.parts) - len(self.live)


def _plan_train(backend: Backend, samples: list[Sample], config: GRPOConfig) -> TrainPlan:
    """Advantages (one baseline per prompt and role, times each sample's
    ``advantage_scale``), the optimizer steps' shares of the samples, and which of them
    carry a gradient: not a share whose advantages are all 0 (or with no token in the
    loss) when the loss has no term that acts without one
    (:func:`~trainer.algorithm._losses.gradient_without_advantage`). Such a step is not run
    by any backend -- with AdamW a zero gradient would still move the weights -- while the
    rollout step goes on as usual (docs/trainer.md, "Steps without a gradient")."""
    adv = compute_advantages(
        [s.reward for s in samples],
        [(s.group_id, s.role) for s in samples],
        config.advantage_estimator,
    ).double() * torch.tensor([s.advantage_scale for s in samples], dtype=torch.float64)
    steps = config.num_steps_per_rollout
    per = -(-len(samples) // steps)
    bounds = range(0, len(samples), per)
    parts = [samples[k : k + per] for k in bounds]
    advantages = [adv[k : k + per] for k in bounds]
    always = gradient_without_advantage(backend.loss_config)
    live = [
        j
        for j, (part, a) in enumerate(zip(parts, advantages, strict=True))
        if any((always or float(x) != 0.0) and _in_loss(s) for s, x in zip(part, a, strict=True))
    ]
    return TrainPlan(steps=steps, parts=parts, advantages=advantages, live=live)


def _in_loss(sample: Sample) -> bool:
    """Whether a token of ``sample`` is in the loss (its loss mask is not all 0)."""
    return bool(sample.completion_ids) and (sample.loss_mask is None or any(sample.loss_mask))


@contextlib.contextmanager
def _lone_error() -> Iterator[None]:
    """Re-raise a task group's lone error as itself, not inside an ExceptionGroup."""
    try:
        yield
    except BaseExceptionGroup as group:
        lone: BaseException = group
        while isinstance(lone, BaseExceptionGroup) and len(lone.exceptions) == 1:
            lone = lone.exceptions[0]
        if isinstance(lone, BaseExceptionGroup):
            raise
        raise lone from None


async def _fill_then_set(
    producer: Producer, step: int, config: GRPOConfig, done: anyio.Event
) -> None:
    try:
        await producer.fill(step, config.rollout_batch_size)
    finally:
        done.set()


def _train(
    backend: Backend, plan: TrainPlan, rollout_step: int, temperature: float
) -> dict[str, float]:
    """The optimizer steps of ``plan`` that carry a gradient, on a worker thread (the
    event loop keeps serving the episodes still running), its log-probs at
    ``temperature`` (the rollouts'); the last one's metrics. The
    learning rate follows the planned steps (``plan.steps`` per rollout step), also where
    filters left fewer samples than steps, steps were not run, or no batch came at all."""
    use_torch_threads("trainer")  # this worker thread's torch threads, chosen once
    samples = [s for j in plan.live for s in plan.parts[j]]
    # Several steps per rollout: the old policy is the one before the first update, so
    # its log-probs are taken first (one step: train_step does it with its own
    # micro-batches, which makes the ratio exactly 1 on fresh on-policy data).
    t = temperature
    old = backend.logprobs(samples, temperature=t) if len(plan.live) > 1 else None
    ref = (
        backend.logprobs(samples, reference=True, temperature=t) if backend.has_reference else None
    )
    metrics: dict[str, float] = {}
    k = 0
    for j in plan.live:
        n = len(plan.parts[j])
        part = backend.train_step(
            plan.parts[j],
            plan.advantages[j],
            old_logprobs=old[k : k + n] if old is not None else None,
            ref_logprobs=ref[k : k + n] if ref is not None else None,
            lr_step=rollout_step * plan.steps + j,
            temperature=t,
        )
        k += n
        for name, value in part.items():
            metrics[f"train/{name}" if "/" not in name else name] = value
    return metrics


def _rollout_metrics(step: int, rounds: RoundStats, samples: list[Sample]) -> dict[str, float]:
    rewards = [s.reward for s in samples]
    versions = [int(v) for s in samples for v in s.weight_versions if v.isdigit()]
    gen = rounds.busy_s
    batch_reward = sum(rewards) / len(rewards) if rewards else 0.0
    played = sum(rounds.rewards) / len(rounds.rewards) if rounds.rewards else batch_reward
    return {
        "step": float(step),
        # What was played for this step (async: the rounds finished since the last step);
        # batch/ is what trains: the kept groups, maybe played a step earlier.
        "reward_mean": played,
        "batch/reward_mean": batch_reward,
        "samples": float(len(samples)),
        # Groups whose rewards are all equal get advantage 0 (no policy gradient); at 1.0
        # the step learns nothing from its rewards.
        "rollout/zero_std_groups": _zero_std_fraction(samples),
        "failed_episodes": float(rounds.failed),
        "rollout/busy_s": gen,
        "rollout/rounds": float(rounds.rounds),
        "rollout/prompts": float(rounds.prompts),
        "rollout/completion_tokens": float(rounds.completion_tokens),
        "rollout/peak_requests": float(rounds.peak_requests),
        "rollout/staleness_max": float(step - min(versions)) if versions else 0.0,
        # The oldest policy that generated a token of the batch (-1: none was stamped with
        # a version of the trainer's, e.g. an engine that never got the trainer's weights).
        "rollout/weight_version_min": float(min(versions)) if versions else -1.0,
        "perf/rollout_tokens_per_s": rounds.completion_tokens / gen if gen > 0 else 0.0,
        # Games: per-role reward, win/draw/loss and invalid-move rates of the batch.
        **game_metrics(samples),
    }


#: The peak resident set of the run's processes (GiB); per role under ``RSS/ROLE``.
RSS = "perf/peak_rss_gib"


def _peak_memory(
    device: torch.device, metrics: dict[str, float], peaks: dict[str, float] | None = None
) -> dict[str, float]:
    """The step's peak memory: on CUDA the trainer's GPU's most allocated and reserved
    bytes since the step began; on every device the peak resident set so far of each
    process of the run, largest per role (``RSS/driver``: this process; the processes on
    Ray bring theirs in ``metrics``), and ``RSS`` the largest of all (docs/trainer.md:
    the metrics per step). ``peaks`` (updated) keeps each role's over the steps: a role reports only
    with the steps it works in."""
    out: dict[str, float] = {}
    if device.type == "cuda":
        out["perf/peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["perf/peak_memory_reserved_gib"] = torch.cuda.max_memory_reserved(device) / 2**30
    peaks = {} if peaks is None else peaks
    now = {k: v for k, v in metrics.items() if k.startswith(RSS + "/")}
    now[RSS + "/driver"] = peak_rss_gib()
    for role, gib in now.items():
        peaks[role] = max(peaks.get(role, 0.0), gib)
    return {**out, **peaks, RSS: max(peaks.values())}


def _zero_std_fraction(samples: list[Sample]) -> float:
    """The share of the batch's groups (per prompt and role, as the advantages see them)
    whose rewards are all equal; 0.0 for an empty batch."""
    rewards: dict[tuple[str | None, str | None], set[float]] = {}
    for s in samples:
        rewards.setdefault((s.group_id, s.role), set()).add(s.reward)
    if not rewards:
        return 0.0
    return sum(len(r) == 1 for r in rewards.values()) / len(rewards)


def _schedule(config: GRPOConfig) -> dict[str, Any]:
    """What a resumed run must share with the saved one."""
    return {
        "rollout_batch_size": config.rollout_batch_size,
        "n_samples_per_prompt": config.n_samples_per_prompt,
        "global_batch_size": config.samples_per_step,
        "num_steps_per_rollout": config.num_steps_per_rollout,
        "seed": config.seed,
    }
