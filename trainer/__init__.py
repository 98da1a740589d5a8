"""The GRPO trainer, grouped by job: ``config`` (the settings each component takes, no
torch), ``algorithm`` (advantages, the loss, packing), ``backends`` (torch; checkpoints),
``engines`` (the engines' seam and weight sync), ``distributed`` (Ray), ``megatron`` and
``run`` (``TrainConfig``, set-up, the loop, ``agentenv train``). Every public name is
``trainer.X``, defined in one module of those.

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
``trainer.run._cli``, which defines ``agentenv train``'s flags -- stays light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from trainer import _lazy

if TYPE_CHECKING:
    from trainer.algorithm import (
        ESTIMATORS,
        compute_advantages,
        kl_estimate,
        pack_by_tokens,
        policy_loss,
        tempered_logits,
        token_weights,
    )
    from trainer.backends import (
        PRECISIONS,
        Backend,
        Precision,
        TorchBackend,
    )
    from trainer.config import (
        AGGREGATIONS,
        KL_TYPES,
        SCHEDULES,
        GRPOConfig,
        LossConfig,
        OptimConfig,
        logprob_temperature,
    )
    from trainer.engines import (
        DiskSync,
        DistributedSync,
        EmbeddedEngine,
        InProcessSync,
        OffloadHooks,
        RolloutEngine,
        ServerEngine,
        TensorSync,
        WeightSync,
    )
    from trainer.run import (
        CheckpointConfig,
        DataConfig,
        EngineConfig,
        EvalConfig,
        LoggingConfig,
        ModelConfig,
        ParallelismConfig,
        StepHooks,
        TrainConfig,
        build_backend,
        config_from_flags,
        engine_dtypes,
        place_run,
        rollout_engine,
        run_grpo,
        train,
    )

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
    "AGGREGATIONS": "trainer.config._algorithm",
    "ESTIMATORS": "trainer.algorithm._advantages",
    "KL_TYPES": "trainer.config._algorithm",
    "PRECISIONS": "trainer.backends._precision",
    "SCHEDULES": "trainer.config._rollout",
    "Backend": "trainer.backends._backend",
    "CheckpointConfig": "trainer.run._config",
    "DataConfig": "trainer.run._config",
    "DiskSync": "trainer.engines._sync",
    "DistributedSync": "trainer.engines._sync",
    "EmbeddedEngine": "trainer.engines._engines",
    "EngineConfig": "trainer.run._config",
    "EvalConfig": "trainer.run._config",
    "GRPOConfig": "trainer.config._rollout",
    "InProcessSync": "trainer.engines._sync",
    "LoggingConfig": "trainer.run._config",
    "LossConfig": "trainer.config._algorithm",
    "ModelConfig": "trainer.run._config",
    "OffloadHooks": "trainer.engines._offload",
    "OptimConfig": "trainer.config._optimizer",
    "ParallelismConfig": "trainer.run._config",
    "Precision": "trainer.backends._precision",
    "RolloutEngine": "trainer.engines._engines",
    "ServerEngine": "trainer.engines._engines",
    "StepHooks": "trainer.run._loop",
    "TensorSync": "trainer.engines._sync",
    "TorchBackend": "trainer.backends._torch",
    "TrainConfig": "trainer.run._config",
    "WeightSync": "trainer.engines._sync",
    "build_backend": "trainer.run._setup",
    "compute_advantages": "trainer.algorithm._advantages",
    "config_from_flags": "trainer.run._cli",
    "engine_dtypes": "trainer.run._servers",
    "kl_estimate": "trainer.algorithm._losses",
    "logprob_temperature": "trainer.config._algorithm",
    "pack_by_tokens": "trainer.algorithm._batching",
    "place_run": "trainer.run._setup",
    "policy_loss": "trainer.algorithm._losses",
    "rollout_engine": "trainer.run._servers",
    "run_grpo": "trainer.run._loop",
    "tempered_logits": "trainer.algorithm._losses",
    "token_weights": "trainer.algorithm._losses",
    "train": "trainer.run._train",
}


__getattr__, __dir__ = _lazy.lazy_names(__name__, _MODULES)
