"""``trainer.train(config)``: a training run, wired from the groups of a validated
:class:`~trainer.TrainConfig` -- what ``agentenv train`` runs after parsing its flags."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer.backends import Backend
    from trainer.run._config import TrainConfig

__all__ = ["train"]


def train(config: TrainConfig) -> dict[str, Any]:
    """Train with GRPO as ``config`` says: evaluate the held-out tasks, run
    ``config.rollout.num_rollout`` steps (roll out, train, sync the weights, report,
    checkpoint), evaluate again, save the model. Returns the summary (rewards before and
    after, timings). Everything that can be checked without a model is checked before
    one loads."""
    import shutil

    import anyio

    from trainer.backends import checkpoint_step
    from trainer.engines import OffloadHooks
    from trainer.run._evaluation import Evaluator
    from trainer.run._loop import run_grpo
    from trainer.run._reporting import Reporter, completed, plot, record, summary
    from trainer.run._servers import engine_dtypes, rollout_engine, rollout_workers
    from trainer.run._setup import (
        build_backend,
        checkpoint_dir,
        load_tasks,
        load_tokenizer,
        place_run,
        weights_dir,
    )

    done = completed(config)  # a complete run says so and does nothing again
    if done is not None:
        return done
    tasks = load_tasks(config)
    config = config.for_env(tasks.env)  # the environment's sampling, the flags winning
    tokenizer = load_tokenizer(config)
    checkpoint, resuming = checkpoint_dir(config)
    started = time.perf_counter()
    placed = place_run(config)  # None: this process trains (no Ray)
    backend = build_backend(config, placed)
    dtypes = engine_dtypes(backend, config.engine.rollout_device or config.model.device)
    evaluate = Evaluator(tasks.env, tasks.held_out, tokenizer, config)
    saved = checkpoint_step(checkpoint) if checkpoint is not None and resuming else None
    start = 0 if saved is None else saved + 1  # the lines of later steps are dropped
    save = config.checkpoint.save
    buffer = None if save is None else save / "buffer"  # the run's durable Buffer
    report = Reporter(config, save, start)
    report.backend(backend)
    n_eval = config.eval.n_eval

    async def run(weights: Path) -> tuple[float | None, float | None, list[dict[str, float]]]:
        async with rollout_engine(config, tokenizer, weights, dtypes, placed) as policy:
            n = config.rollout.concurrency_for(policy)
            before = await evaluate(policy, n)
            report.held_out("before", before, n_eval)
            history = await run_grpo(
                tasks.env, tasks.train, backend, policy, tokenizer, config.rollout,
                on_step=report, checkpoint=checkpoint, buffer_path=buffer,
                save_interval=config.checkpoint.save_interval,
                keep_checkpoints=config.checkpoint.keep_checkpoints,
                evaluate=lambda: evaluate(policy, n), eval_interval=config.eval.eval_interval,
                # Engines sharing the trainer's GPUs give their memory back while it trains.
                hooks=OffloadHooks(policy) if config.placement.colocate else None,
                workers=rollout_workers(config, policy, n), on_batch=report.batch,
            )  # fmt: skip
            after = await evaluate(policy, n)
            report.held_out("after", after, n_eval)
        return before, after, history

    try:
        with weights_dir(config) as weights:
            before, after, history = anyio.run(run, weights)
        if save is not None:
            save_model(backend, config, checkpoint)
    finally:
        report.close()
        backend.close()  # its ranks end (on Ray)
        if placed is not None:  # the bundles go back
            placed.release()
    # The torch backend's numerics, or its ranks'; megatron's are bf16 (fp32 main weights).
    precision = backend.precision.name if backend.precision is not None else "bf16"
    result = summary(
        config, history, precision=precision, eval_tasks=len(tasks.held_out),
        before=before, after=after, wall_s=time.perf_counter() - started,
        plot=plot(config, history, before, after),
    )  # fmt: skip
    record(config, result)
    if checkpoint is not None and config.checkpoint.keep_checkpoints == 0:
        # Complete, its model saved and its result recorded: no resume will need them.
        shutil.rmtree(checkpoint)
        shutil.rmtree(checkpoint.parent / "buffer", ignore_errors=True)
    return result


def save_model(backend: Backend, config: TrainConfig, checkpoint: Path | None) -> None:
    """The trained model into ``SAVE/model``, replaced atomically: hard links to the last
    checkpoint's model when that is of the last step (the same weights: the run then
    holds them once on disk), else the backend's export."""
    from trainer._resources import replace_dir
    from trainer.backends import link_model

    assert config.checkpoint.save is not None
    target = config.checkpoint.save / "model"
    last = config.rollout.num_rollout - 1
    if checkpoint is not None and link_model(checkpoint, target, last):
        return
    with replace_dir(target) as tmp:
        backend.save_hf(tmp)
