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

_MODULES = {
    "CheckpointConfig": "trainer.run._config",
    "DataConfig": "trainer.run._config",
    "EngineConfig": "trainer.run._config",
    "EvalConfig": "trainer.run._config",
    "LoggingConfig": "trainer.run._config",
    "ModelConfig": "trainer.run._config",
    "ParallelismConfig": "trainer.run._config",
    "StepHooks": "trainer.run._loop",
    "TrainConfig": "trainer.run._config",
    "build_backend": "trainer.run._setup",
    "config_from_flags": "trainer.run._cli",
    "engine_dtypes": "trainer.run._servers",
    "place_run": "trainer.run._setup",
    "rollout_engine": "trainer.run._servers",
    "run_grpo": "trainer.run._loop",
    "train": "trainer.run._train",
}


__getattr__, __dir__ = _lazy.lazy_names(__name__, _MODULES)
