"""The GRPO trainer: advantages, losses, batching (backends, weight sync, the loop and
checkpoints build on these).

It consumes :class:`agentenv.Sample` batches from the Data Buffer. The algorithm functions
here are shared by every backend (plain torch on one machine, megatron-core on GPU nodes).

``train(TrainConfig(...))`` runs what ``agentenv train`` runs (``config_from_flags(FLAGS)``:
the config that command's flags make); the config tree's groups are the objects the
components take (``TrainConfig.rollout`` is a :class:`GRPOConfig`, ``.algorithm`` a
:class:`LossConfig`, ``.optimizer`` an :class:`OptimConfig`). A run's pieces, for a loop of
one's own: :func:`place_run` (its Ray placement, or none), :func:`build_backend`,
:func:`rollout_engine` (the engines and their weight sync; :func:`engine_dtypes` gives
them the backend's numerics) and :func:`run_grpo`.

The names load on first use (most of them need torch), so importing ``trainer`` -- or
``trainer._cli``, which defines ``agentenv train``'s flags -- stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from trainer._advantages import ESTIMATORS, compute_advantages
    from trainer._algorithm import AGGREGATIONS, KL_TYPES, LossConfig
    from trainer._backend import Backend
    from trainer._batching import pack_by_tokens
    from trainer._cli import config_from_flags
    from trainer._config import (
        CheckpointConfig,
        DataConfig,
        EngineConfig,
        EvalConfig,
        LoggingConfig,
        ModelConfig,
        ParallelismConfig,
        TrainConfig,
    )
    from trainer._data import load_prompt_data
    from trainer._engines import EmbeddedEngine, RolloutEngine, ServerEngine
    from trainer._loop import StepHooks, run_grpo
    from trainer._losses import (
        kl_estimate,
        logprob_temperature,
        policy_loss,
        tempered_logits,
        token_weights,
    )
    from trainer._offload import OffloadHooks
    from trainer._optimizer import OptimConfig
    from trainer._precision import PRECISIONS, Precision
    from trainer._rollout import SCHEDULES, GRPOConfig
    from trainer._servers import engine_dtypes, rollout_engine
    from trainer._setup import build_backend, place_run
    from trainer._sync import DiskSync, DistributedSync, InProcessSync, TensorSync, WeightSync
    from trainer._torch import TorchBackend
    from trainer._train import train

__all__ = [
    "AGGREGATIONS",
    "ESTIMATORS",
    "KL_TYPES",
    "PRECISIONS",
    "SCHEDULES",
    "Backend",
    "CheckpointConfig",
    "DataConfig",
    "DiskSync",
    "DistributedSync",
    "EmbeddedEngine",
    "EngineConfig",
    "EvalConfig",
    "GRPOConfig",
    "InProcessSync",
    "LoggingConfig",
    "LossConfig",
    "ModelConfig",
    "OffloadHooks",
    "OptimConfig",
    "ParallelismConfig",
    "Precision",
    "RolloutEngine",
    "ServerEngine",
    "StepHooks",
    "TensorSync",
    "TorchBackend",
    "TrainConfig",
    "WeightSync",
    "build_backend",
    "compute_advantages",
    "config_from_flags",
    "engine_dtypes",
    "kl_estimate",
    "load_prompt_data",
    "logprob_temperature",
    "pack_by_tokens",
    "place_run",
    "policy_loss",
    "rollout_engine",
    "run_grpo",
    "tempered_logits",
    "token_weights",
    "train",
]

# Where each public name lives (the imports above, for the type checker).
_MODULES = {
    "AGGREGATIONS": "trainer._algorithm",
    "ESTIMATORS": "trainer._advantages",
    "KL_TYPES": "trainer._algorithm",
    "PRECISIONS": "trainer._precision",
    "SCHEDULES": "trainer._rollout",
    "Backend": "trainer._backend",
    "CheckpointConfig": "trainer._config",
    "DataConfig": "trainer._config",
    "DiskSync": "trainer._sync",
    "DistributedSync": "trainer._sync",
    "TensorSync": "trainer._sync",
    "EmbeddedEngine": "trainer._engines",
    "RolloutEngine": "trainer._engines",
    "ServerEngine": "trainer._engines",
    "EngineConfig": "trainer._config",
    "EvalConfig": "trainer._config",
    "GRPOConfig": "trainer._rollout",
    "InProcessSync": "trainer._sync",
    "LoggingConfig": "trainer._config",
    "LossConfig": "trainer._algorithm",
    "ModelConfig": "trainer._config",
    "OffloadHooks": "trainer._offload",
    "OptimConfig": "trainer._optimizer",
    "ParallelismConfig": "trainer._config",
    "Precision": "trainer._precision",
    "StepHooks": "trainer._loop",
    "TorchBackend": "trainer._torch",
    "TrainConfig": "trainer._config",
    "WeightSync": "trainer._sync",
    "build_backend": "trainer._setup",
    "compute_advantages": "trainer._advantages",
    "config_from_flags": "trainer._cli",
    "engine_dtypes": "trainer._servers",
    "kl_estimate": "trainer._losses",
    "load_prompt_data": "trainer._data",
    "logprob_temperature": "trainer._losses",
    "pack_by_tokens": "trainer._batching",
    "place_run": "trainer._setup",
    "policy_loss": "trainer._losses",
    "rollout_engine": "trainer._servers",
    "run_grpo": "trainer._loop",
    "tempered_logits": "trainer._losses",
    "token_weights": "trainer._losses",
    "train": "trainer._train",
}


def __getattr__(name: str) -> Any:
    module = _MODULES.get(name)
    if module is None:
        raise AttributeError(f"module 'trainer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
