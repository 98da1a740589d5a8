"""The pieces a training run is set up from, each from its group of the config: the
environment and its tasks (``config.data``, checked before any model loads), the
tokenizer, the backend (``config.parallel``), the run directory (``config.checkpoint``);
and :func:`dry_run`, which checks them all without loading a model."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv import ConfigError, Environment, Task
from trainer.config import EnvSpec, build_env

if TYPE_CHECKING:
    from agentenv import ChatTokenizer
    from trainer.backends import Backend
    from trainer.distributed import Placed
    from trainer.run._config import TrainConfig

__all__ = [
    "RAW_TEMPLATE",
    "RunTasks",
    "build_backend",
    "checkpoint_dir",
    "dry_run",
    "load_tasks",
    "load_tokenizer",
    "place_run",
    "weights_dir",
]

log = logging.getLogger("trainer.data")

# Prompts as they are, no chat markers (--no-apply-chat-template).
RAW_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


@dataclasses.dataclass(frozen=True, slots=True)
class RunTasks:
    """The environment, the tasks it trains on, the held-out tasks it is scored on, and
    the prompt data rows skipped (each with its file, line and key)."""

    env: Environment
    train: Sequence[Task]
    held_out: Sequence[Task]
    skipped: Sequence[str] = ()


def load_tasks(config: TrainConfig) -> RunTasks:
    """The environment (``--env``; without it, ``prompt_data`` over ``--prompt-data``),
    its training tasks (``--prompt-data``, else its train split; refused when a round
    would need more distinct tasks) and the first ``--n-eval`` of its test split. The
    reward flags (``--rm-type``, ``--custom-rm-path``) replace the environment's rubric."""
    data = config.data
    keys: dict[str, Any] = {"input_key": data.input_key, "label_key": data.label_key,
            "metadata_key": data.metadata_key}  # fmt: skip
    skipped: list[str] = []
    train: Sequence[Task]
    env = build_env(env_spec(config))
    if data.env is None:
        train = env.tasks("train")
        skipped += getattr(env, "skipped", [])
    else:
        if data.prompt_data is not None:
            from agentenv import read_prompt_data

            rows = read_prompt_data(
                data.prompt_data, **keys, check_rm_type=data.custom_rm_path is None
            )
            for problem in rows.skipped:
                log.warning("%s; skipped", problem)
            train, skipped = rows.tasks, rows.skipped
        else:
            train = env.tasks("train")
    config.rollout.check_tasks(train)
    return RunTasks(env, train, env.tasks("test")[: config.eval.n_eval], skipped)


def env_spec(config: TrainConfig) -> EnvSpec:
    """What builds the run's environment (here, and in every rollout worker): ``--env``
    with ``--env-args`` and the reward flags, or ``prompt_data`` over ``--prompt-data``."""
    data = config.data
    if data.env is None:
        assert data.prompt_data is not None  # the config's rule
        keys = {"input_key": data.input_key, "label_key": data.label_key,
                "metadata_key": data.metadata_key}  # fmt: skip
        args = {"path": str(data.prompt_data), **keys, **data.reward_args, **data.env_args}
        return EnvSpec("prompt_data", args, {})
    return EnvSpec(data.env, dict(data.env_args), dict(data.reward_args))


def load_tokenizer(config: TrainConfig) -> ChatTokenizer:
    """The model's tokenizer, with its chat template unless ``--no-apply-chat-template``."""
    from agentenv import ChatTokenizer

    tokenizer = ChatTokenizer.load(config.model.hf_checkpoint)
    return tokenizer if config.data.apply_chat_template else tokenizer.with_template(RAW_TEMPLATE)


def place_run(config: TrainConfig) -> Placed | None:
    """The run's placement on Ray (``config.placement``: the cluster joined, the bundles
    reserved and measured), or ``None`` for a run in one process (``not
    config.uses_ray``; Ray is then not imported)."""
    if not config.uses_ray:
        return None
    from trainer.distributed import Placement, check_worker_room, connect

    placement = Placement.from_config(config)
    p = config.placement
    workers = math.ceil(p.rollout_num_workers * p.rollout_num_cpus_per_worker)
    # A cluster started for this run (local) has room for the bundles, the driver and
    # the rollout workers whatever the cores; a running one is checked before anything
    # is placed or loaded.
    ray = connect(p.ray_address, num_cpus=placement.num_bundles + 1 + workers)
    if p.rollout_num_workers:
        check_worker_room(
            ray, num_workers=p.rollout_num_workers, num_cpus=p.rollout_num_cpus_per_worker,
            resources={p.rollout_worker_resource: 1.0} if p.rollout_worker_resource else None,
            reserved={k: v * placement.num_bundles for k, v in placement.bundle.items()},
        )  # fmt: skip
    return placement.place(ray, timeout=p.placement_timeout)


def build_backend(config: TrainConfig, placed: Placed | None = None) -> Backend:
    """The trainer backend ``--backend`` names, with the loss (``config.algorithm``) and the
    optimizer (``config.optimizer``); on ``placed``'s trainer bundles when given
    (:func:`place_run`): megatron's ranks as Ray actors, the torch backend as a
    :class:`~trainer.distributed.TrainerGroup` of data-parallel ranks."""
    from trainer.config import default_micro_batch_tokens

    parallel = config.parallel
    common: dict[str, Any] = dict(
        optim=config.optimizer, loss=config.algorithm,
        max_tokens_per_micro_batch=default_micro_batch_tokens(
            parallel.max_tokens_per_gpu, config.model.device
        ),
    )  # fmt: skip
    device = config.model.device
    if parallel.backend == "megatron":
        from trainer.megatron import MegatronBackend, ray_launcher

        return MegatronBackend(
            config.model.hf_checkpoint,
            parallel=parallel.megatron_parallel(),
            num_gpus=config.trainer_ranks,
            qkv_format=parallel.qkv_format,
            launcher=None if placed is None else ray_launcher(placed),
            device=device,
            **common,
        )
    torch_args: dict[str, Any] = dict(
        precision=parallel.precision,
        gradient_checkpointing=parallel.gradient_checkpointing,
        compile=parallel.compile,
        **common,
    )
    if placed is not None:
        from trainer.distributed import TrainerGroup

        kind = "cuda" if device.startswith("cuda") else "cpu"
        return TrainerGroup.start(placed, config.model.hf_checkpoint, device=kind, **torch_args)
    from trainer.backends import TorchBackend

    return TorchBackend(config.model.hf_checkpoint, device=device, **torch_args)


def _load_source(config: TrainConfig) -> Path | None:
    """``--load``'s checkpoint directory, checked; ``None``: none to start from (no
    ``--load``, or ``--load`` equal to ``--save`` before its first checkpoint, as slime's
    scripts pass them)."""
    ckpt = config.checkpoint
    if ckpt.load is None or ckpt.save is None:
        return None
    source = ckpt.load / "checkpoint"
    if (source / "checkpoint.json").is_file():
        return source
    if ckpt.load.resolve() == ckpt.save.resolve():
        return None
    raise ConfigError(f"--load {str(ckpt.load)!r} has no checkpoint")


def checkpoint_dir(config: TrainConfig) -> tuple[Path | None, bool]:
    """``SAVE/checkpoint`` (seeded from ``--load``'s) and whether it resumes."""
    save = config.checkpoint.save
    if save is None:
        return None, False
    from trainer._resources import replace_dir

    source = _load_source(config)
    save.mkdir(parents=True, exist_ok=True)
    checkpoint = save / "checkpoint"
    # This run's own checkpoint, once it has one, is newer than the one it began from.
    if (
        source is not None
        and not (checkpoint / "checkpoint.json").is_file()
        and source.resolve() != checkpoint.resolve()
    ):
        with replace_dir(checkpoint) as tmp:
            shutil.copytree(source, tmp, dirs_exist_ok=True)
    return checkpoint, (checkpoint / "checkpoint.json").is_file()


@contextlib.contextmanager
def weights_dir(config: TrainConfig) -> Iterator[Path]:
    """Where servers read the new weights from (``SAVE/weights``, else a temporary
    directory), removed once the run is done."""
    save = config.checkpoint.save
    if save is None:
        with tempfile.TemporaryDirectory(prefix="agentenv-weights-") as tmp:
            yield Path(tmp)
        return
    yield save / "weights"
    shutil.rmtree(save / "weights", ignore_errors=True)


def resolved_defaults(config: TrainConfig) -> dict[str, Any]:
    """The settings left unset (``null`` in the config) that the run resolves from the
    device, the backend and the engine, as it will use them."""
    from trainer.config import (
        default_checkpointing,
        default_compile,
        default_micro_batch_tokens,
        default_precision,
        logprob_temperature,
    )

    parallel, device = config.parallel, config.model.device
    rollout_device = config.server_device()
    out: dict[str, Any] = {
        "max_tokens_per_gpu": default_micro_batch_tokens(parallel.max_tokens_per_gpu, device),
        "rollout_device": rollout_device,
        "offload_rollout": config.rollout.offloads_on(
            rollout_device if config.engine.embedded else None
        ),
        "eps_clip_high": config.algorithm.clip_high,
        "global_batch_size": config.rollout.samples_per_step,
        # The trainer's log-probs are of the distribution the rollouts sample from.
        "logprob_temperature": logprob_temperature(config.rollout.sampling),
    }
    if parallel.backend == "torch":
        out["precision"] = default_precision(parallel.precision, device)
        out["compile"] = default_compile(parallel.compile, device)
        out["gradient_checkpointing"] = default_checkpointing(parallel.gradient_checkpointing)
    return out


def dry_run(config: TrainConfig) -> dict[str, Any]:
    """Check what a run of ``config`` would start from -- the environment loads, the
    prompt data parses and has enough distinct tasks for a round, ``--load`` has a
    checkpoint -- without loading a model or writing anything (the tree itself, the batch
    identity and the pass-through flags included, was validated when it was built).
    Returns the settings, those left unset as the run resolves them (``resolved``), what
    was found, (``--backend megatron``) megatron's parallel layout as the backend reads it
    and (on Ray) the placement it will ask for."""
    tasks = load_tasks(config)
    config = config.for_env(tasks.env)  # what will run: the environment's sampling included
    source = _load_source(config)
    out: dict[str, Any] = {
        "config": config.model_dump(mode="json"),
        "found": {
            "train_tasks": len(tasks.train),
            "held_out_tasks": len(tasks.held_out),
            "skipped_rows": list(tasks.skipped),
            "resume_from": None if source is None else str(source),
        },
    }
    out["resolved"] = resolved_defaults(config)
    # The environment's own sampling defaults the run takes (the flags given win over them).
    own = getattr(tasks.env, "sampling", None) or {}
    out["env_sampling"] = {k: v for k, v in own.items() if k not in config.rollout.sampling_given}
    if config.parallel.backend == "megatron":  # its own flags, as the backend reads them
        out["megatron"] = dataclasses.asdict(config.parallel.megatron_parallel())
    if config.uses_ray:  # what the run will ask the cluster for (nothing is placed here)
        from trainer.distributed import Placement

        out["placement"] = Placement.from_config(config).describe()
    return out
