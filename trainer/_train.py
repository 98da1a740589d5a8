"""What ``agentenv train`` runs: a validated :class:`~trainer._config.TrainConfig` wired into
the backend, the rollout engines, the loop and the reports."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv import ConfigError, Task, resolve_name
from trainer._files import free_port

if TYPE_CHECKING:
    import torch

    from agentenv import Tokenizer
    from agentenv.buffer import GroupFilter
    from trainer._backend import Backend
    from trainer._config import TrainConfig
    from trainer._sync import WeightSync

__all__ = ["train"]

# Prompts as they are, no chat markers (--no-apply-chat-template).
RAW_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def load_filter(path: str) -> GroupFilter:
    """``module:name`` or ``module.name``: a group filter, or a class built without
    arguments (``agentenv.buffer.RewardStdFilter``)."""
    found = resolve_name(path, what="--dynamic-sampling-filter-path", kind="function")
    if isinstance(found, type):
        found = found()
    if not callable(found):
        raise ConfigError(f"--dynamic-sampling-filter-path {path!r} is not callable")
    filt: GroupFilter = found
    return filt


@contextlib.asynccontextmanager
async def rollout_engine(
    config: TrainConfig,
    tokenizer: Tokenizer,
    weights_dir: Path,
    dtypes: tuple[torch.dtype, torch.dtype] | None = None,
) -> AsyncIterator[tuple[Any, WeightSync]]:
    """The policy that plays the episodes and how the trainer's weights reach it.

    ``dtypes``: the embedded or ``serve`` engine's ``(dtype, residual_dtype)``, those of the
    trainer's numerics (:func:`engine_dtypes`); default: the engine's own."""
    from agentenv.engine import Engine, resolve_model
    from agentenv.sglang import Launcher, SGLangClient, server_command
    from trainer._sync import InProcessSync

    device = config.rollout_device or config.device
    dtype, residual_dtype = dtypes or (None, None)
    api_key = config.rollout_api_key()
    if config.rollout_url is not None:
        async with SGLangClient(config.rollout_url, api_key=api_key) as client:
            await client.wait_healthy(timeout=60.0)
            async with server_sync(config, client, weights_dir) as sync:
                yield client, sync
    elif config.rollout_engine == "embedded":
        async with Engine(
            config.hf_checkpoint, device=device, dtype=dtype, residual_dtype=residual_dtype,
            tokenizer=tokenizer, max_running=config.rollout_max_running,
        ) as engine:  # fmt: skip
            yield engine, InProcessSync(engine)
    else:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        model = str(resolve_model(config.hf_checkpoint))
        if config.rollout_engine == "serve":
            program = [sys.executable, "-m", "agentenv", "serve"]
            extra = ["--device", device, "--max-running", str(config.rollout_max_running)]
            if dtype is not None and residual_dtype is not None:
                extra += [
                    "--dtype",
                    _dtype_name(dtype),
                    "--residual-dtype",
                    _dtype_name(residual_dtype),
                ]
            command = server_command(model, port=port, program=program, extra=extra)
        else:
            extra = list(config.sglang_args)
            gpu = config.rollout_device
            if gpu is not None and gpu.startswith("cuda:") and config.sglang_base_gpu() is None:
                extra += ["--base-gpu-id", gpu.removeprefix("cuda:")]  # SGLang's GPU choice
            command = server_command(model, port=port, extra=extra)
        print(f"starting {' '.join(command)}", file=sys.stderr, flush=True)
        # agentenv serve reads the key from its environment (kept out of the process list);
        # SGLang has it among its flags already (--sglang-api-key).
        env = {"AGENTENV_API_KEY": api_key} if api_key and config.rollout_engine == "serve" else {}
        async with (
            Launcher(command, url, env=env),
            SGLangClient(url, api_key=api_key) as client,
            server_sync(config, client, weights_dir) as sync,
        ):
            yield client, sync


async def rollout_concurrency(config: TrainConfig, policy: Any) -> int | None:
    """Episodes in flight: what the engines decode together. The embedded engine says
    itself (``None``: its ``max_running``); an ``agentenv serve`` worker was launched with
    ``--rollout-max-running``; an SGLang server takes ``--sglang-server-concurrency``
    (slime's), times a router's workers."""
    if config.rollout_url is not None:
        from agentenv.sglang import SGLangError

        try:
            servers = len(await policy.list_workers())
        except SGLangError:  # a server, not a router
            servers = 1
        return config.sglang_server_concurrency * max(servers, 1)
    if config.rollout_engine == "serve":
        return config.rollout_max_running
    if config.rollout_engine == "sglang":
        return config.sglang_server_concurrency
    return None


def engine_dtypes(backend: Backend, device: str) -> tuple[torch.dtype, torch.dtype]:
    """The rollout engine's ``(dtype, residual_dtype)`` for ``backend``: the torch backend's
    precision (fp32 weights under bf16 autocast: bf16 matrices, fp32 embeddings, norms and
    residual stream); megatron's bf16 on CUDA, fp32 on CPU."""
    import torch

    from trainer._torch import TorchBackend

    if isinstance(backend, TorchBackend):
        return backend.precision.engine_dtypes()
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    return dtype, dtype


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@contextlib.asynccontextmanager
async def server_sync(
    config: TrainConfig, client: Any, weights_dir: Path
) -> AsyncIterator[WeightSync]:
    """How a server gets the trainer's weights (``--weight-sync``)."""
    from trainer._sync import DiskSync, DistributedSync

    if config.weight_sync == "disk":
        yield DiskSync([client], weights_dir)
        return
    backend = config.weight_sync_backend()
    print(
        f"weight sync: {backend} broadcast to the server in buckets of "
        f"{config.update_weight_buffer_size / 2**20:g} MiB",
        file=sys.stderr,
        flush=True,
    )
    async with DistributedSync(
        [client],
        backend=backend,
        master_address=config.weight_sync_master_address,
        bucket_bytes=config.update_weight_buffer_size,
    ) as sync:
        yield sync


class Reporter:
    """Per step: a progress bar (a line per step when stderr is no terminal), a JSONL line
    and TensorBoard scalars."""

    def __init__(self, config: TrainConfig, save: Path | None, resuming: bool) -> None:
        self.total = config.num_rollout
        self.metrics_file = None
        self.writer: Any = None
        self.bar: Any = None
        if save is not None:
            self.metrics_file = (save / "metrics.jsonl").open("a" if resuming else "w")
            if config.use_tensorboard:
                try:
                    from torch.utils.tensorboard import SummaryWriter
                except ImportError:
                    print(
                        "no TensorBoard: the tensorboard package is not installed "
                        "(agentenv[train])",
                        file=sys.stderr,
                    )
                else:
                    self.writer = SummaryWriter(str(save / "tensorboard"))
        if sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc="train", unit="step", file=sys.stderr)

    def __call__(self, m: dict[str, float]) -> None:
        step = int(m["step"])
        split = (
            f"rollout {m['time_rollout_s']:.1f}s  train {m['time_train_s']:.1f}s  "
            f"sync {m['time_sync_s']:.2f}s"
        )
        # All groups with equal rewards: every advantage is 0 and the step learns nothing.
        flat = "  no signal: every group's rewards are equal" if _no_signal(m) else ""
        if self.bar is not None:
            self.bar.n = step + 1
            self.bar.set_postfix_str(f"reward {m['reward_mean']:.3f}  {split}{flat}")
        else:
            line = f"step {step + 1}/{self.total}  reward {m['reward_mean']:.3f}  {split}{flat}"
            print(line, file=sys.stderr, flush=True)
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(m) + "\n")
            self.metrics_file.flush()
        if self.writer is not None:
            for name, value in m.items():
                if name != "step":
                    self.writer.add_scalar(name, value, step)
            self.writer.flush()

    def held_out(self, when: str, reward: float | None, n_eval: int) -> None:
        """The held-out reward before or after training (once, when there is none)."""
        if reward is not None:
            print(f"held-out reward {when}: {reward}", file=sys.stderr, flush=True)
        elif when == "before":
            why = "--n-eval 0" if n_eval == 0 else "the environment has no test tasks"
            print(f"held-out reward: skipped ({why})", file=sys.stderr, flush=True)

    def close(self) -> None:
        for thing in (self.bar, self.metrics_file, self.writer):
            if thing is not None:
                thing.close()


def _no_signal(m: dict[str, float]) -> bool:
    return m.get("samples", 0.0) > 0 and m.get("rollout/zero_std_groups", 0.0) == 1.0


def _checkpoint_dir(config: TrainConfig) -> tuple[Path | None, bool]:
    """``SAVE/checkpoint`` (seeded from ``--load``'s) and whether it resumes."""
    if config.save is None:
        if config.load is not None:
            raise ConfigError("--load needs --save (where the resumed run writes)")
        return None, False
    from trainer._files import replace_dir

    config.save.mkdir(parents=True, exist_ok=True)
    checkpoint = config.save / "checkpoint"
    if config.load is not None:
        source = config.load / "checkpoint"
        if not (source / "checkpoint.json").is_file():
            raise ConfigError(f"--load {str(config.load)!r} has no checkpoint")
        # This run's own checkpoint, once it has one, is newer than the one it began from.
        if not (checkpoint / "checkpoint.json").is_file() and (
            source.resolve() != checkpoint.resolve()
        ):
            with replace_dir(checkpoint) as tmp:
                shutil.copytree(source, tmp, dirs_exist_ok=True)
    return checkpoint, (checkpoint / "checkpoint.json").is_file()


def train(config: TrainConfig) -> dict[str, Any]:
    """Run ``config``; returns the summary (rewards before and after, timings)."""
    import anyio

    from agentenv import ChatTokenizer, RolloutConfig, SamplingParams, load_environment
    from agentenv import run_rollouts as rollouts
    from trainer._backend import OptimConfig
    from trainer._loop import GRPOConfig, run_grpo
    from trainer._losses import LossConfig, logprob_temperature
    from trainer._torch import TorchBackend

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
        schedule=config.schedule,
        max_staleness=config.max_staleness,
        over_sampling_batch_size=config.over_sampling_batch_size,
        filters=[load_filter(config.dynamic_sampling_filter_path)]
        if config.dynamic_sampling_filter_path
        else (),
        shuffle=config.rollout_shuffle,
        chat_template_kwargs=config.apply_chat_template_kwargs,
    )
    loss = LossConfig(
        eps_clip=config.eps_clip,
        eps_clip_high=config.eps_clip_high,
        entropy_coef=config.entropy_coef,
        aggregation="per_token" if config.calculate_per_token_loss else "per_sample",
        kl_coef=config.kl_loss_coef if config.use_kl_loss else 0.0,
        kl_type=config.kl_loss_type,
        use_tis=config.use_tis,
        temperature=logprob_temperature(sampling),
    )
    optim = OptimConfig(
        optimizer=config.optimizer,
        lr=config.lr,
        betas=(config.adam_beta1, config.adam_beta2),
        eps=config.adam_eps,
        weight_decay=config.weight_decay,
        grad_clip=config.clip_grad,
        lr_decay_style=config.lr_decay_style,
        lr_warmup_iters=config.lr_warmup_iters,
        lr_decay_iters=config.lr_decay_iters or config.num_rollout * config.num_steps_per_rollout,
        min_lr=config.min_lr,
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
    grpo.check_tasks(train_tasks)  # before the model loads and the first evaluation
    eval_tasks = env.tasks("test")[: config.n_eval]
    tokenizer = ChatTokenizer.load(config.hf_checkpoint)
    if not config.apply_chat_template:
        tokenizer = tokenizer.with_template(RAW_TEMPLATE)
    checkpoint, resuming = _checkpoint_dir(config)
    started = time.perf_counter()
    common: dict[str, Any] = dict(
        device=config.device, optim=optim, loss=loss,
        max_tokens_per_micro_batch=config.max_tokens_per_gpu,
    )  # fmt: skip
    backend: Backend
    if config.backend == "megatron":
        from trainer.megatron import MegatronBackend, parse_megatron_flags

        parallel = parse_megatron_flags(config.megatron_args)
        backend = MegatronBackend(
            config.hf_checkpoint,
            parallel=parallel,
            num_gpus=config.actor_num_gpus_per_node,
            qkv_format=config.qkv_format,
            **common,
        )
    else:
        backend = TorchBackend(
            config.hf_checkpoint,
            precision=config.precision,
            gradient_checkpointing=config.gradient_checkpointing,
            compile=config.compile,
            **common,
        )
        if backend.compile:
            print(
                "compiling the decoder layers (torch.compile): the first steps take longer; "
                "--no-compile skips it",
                file=sys.stderr,
                flush=True,
            )
    dtypes = engine_dtypes(backend, config.rollout_device or config.device)
    report = Reporter(config, config.save, resuming)

    async def evaluate(policy: Any, concurrency: int) -> float | None:
        if not eval_tasks:
            return None
        stats = await rollouts(
            env,
            eval_tasks,
            policy,
            tokenizer=tokenizer,
            config=RolloutConfig(
                n_samples_per_prompt=1,
                sampling=SamplingParams(
                    max_new_tokens=config.rollout_max_response_len,
                    temperature=config.eval_temperature,
                ),
                seed=12345,
                concurrency=concurrency,
                chat_template_kwargs=config.apply_chat_template_kwargs,
                progress=False,
            ),
        )
        return stats.reward_mean

    async def go(weights_dir: Path) -> dict[str, Any]:
        async with rollout_engine(config, tokenizer, weights_dir, dtypes) as (policy, sync):
            run = await rollout_concurrency(config, policy) or grpo.concurrency_for(policy)
            before = await evaluate(policy, run)
            report.held_out("before", before, config.n_eval)
            history = await run_grpo(
                env, train_tasks, backend, policy, tokenizer,
                dataclasses.replace(grpo, concurrency=run), sync=sync, on_step=report,
                checkpoint=checkpoint, save_interval=config.save_interval,
                evaluate=lambda: evaluate(policy, run), eval_interval=config.eval_interval,
            )  # fmt: skip
            after = await evaluate(policy, run)
            report.held_out("after", after, config.n_eval)
        return {"before": before, "after": after, "history": history}

    try:
        if config.save is not None:
            out = anyio.run(go, config.save / "weights")
        else:
            with tempfile.TemporaryDirectory(prefix="agentenv-weights-") as tmp:
                out = anyio.run(go, Path(tmp))
    finally:
        report.close()
    before, after = out["before"], out["after"]
    plot = None
    if config.save is not None:
        shutil.rmtree(config.save / "weights", ignore_errors=True)
        backend.save_hf(config.save / "model")
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
    history = out["history"]
    return {
        "env": config.env,
        "steps": config.num_rollout,
        "schedule": config.schedule,
        "precision": backend.precision.name if isinstance(backend, TorchBackend) else "bf16",
        "eval_tasks": len(eval_tasks),
        "eval_reward_before": before,
        "eval_reward_after": after,
        "eval_gain": None if before is None or after is None else after - before,
        "train_reward_first": history[0]["reward_mean"] if history else None,
        "train_reward_last": history[-1]["reward_mean"] if history else None,
        "time_rollout_s": round(sum(h["time_rollout_s"] for h in history), 1),
        "time_train_s": round(sum(h["time_train_s"] for h in history), 1),
        "time_sync_s": round(sum(h["time_sync_s"] for h in history), 2),
        "wall_s": round(time.perf_counter() - started, 1),
        "plot": plot,
    }
