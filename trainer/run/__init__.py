"""A training run: its settings (:class:`TrainConfig`, the tree of every group), the
pieces it is set up from (environment and tasks, backend, engines, run directory), the GRPO
loop on its three schedules, evaluation, reporting, and ``agentenv train`` (the command,
``_cli.py``).

The names load on first use (the loop needs torch; the settings and the command's
parser do not), so ``trainer.TrainConfig`` and ``agentenv train --help`` stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer import _lazy

if TYPE_CHECKING:
    from trainer.run._cli import config_from_flags
    from trainer.run._config import (
        CheckpointConfig,
        DataConfig,
        EngineConfig,
        EvalConfig,
        LoggingConfig,
        ModelConfig,
        ParallelismConfig,
        TrainConfig,
    )
    from trainer.run._loop import StepHooks, run_grpo
    from trainer.run._servers import engine_dtypes, rollout_engine
    from trainer.run._setup import build_backend, place_run
    from trainer.run._train import train

__all__ = [
    "CheckpointConfig",
    "DataConfig",
    "EngineConfig",
    "EvalConfig",
    "LoggingConfig",
    "ModelConfig",
    "ParallelismConfig",
    "StepHooks",
    "TrainConfig",
    "build_backend",
    "config_from_flags",
    "engine_dtypes",
    "place_run",
    "rollout_engine",
    "run_grpo",
    "train",
]

# Each name from the first of these modules that exports it (the light ones first).
__getattr__, __dir__ = _lazy.lazy_names(
    __name__,
    __all__,
    tuple(f"trainer.run._{m}" for m in ("config", "cli", "setup", "servers", "train", "loop")),
)
