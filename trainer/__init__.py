"""The GRPO trainer, grouped by job: ``config`` (the settings each component takes, no
torch), ``algorithm`` (advantages, the loss, packing), ``backends`` (torch; checkpoints),
``engines`` (the engines' seam and weight sync), ``distributed`` (Ray), ``megatron`` and
``run`` (``TrainConfig``, set-up, the loop, ``agentenv train``). Every public name is
``trainer.X``, defined in one module of those.

It trains on the Data Buffer's batches; every backend (torch, megatron-core) shares the algorithm.

``train(TrainConfig(...))`` runs what ``agentenv train`` runs (``config_from_flags(FLAGS)``
makes that command's config); the config tree's groups are the objects the components
take, and docs/trainer.md's table names which; :func:`place_run`, :func:`build_backend`,
:func:`rollout_engine` (with :func:`engine_dtypes`) and :func:`run_grpo` are a run's pieces.

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

# Each name from the first of these subpackages that exports it (the light ones first).
__getattr__, __dir__ = _lazy.lazy_names(
    __name__,
    __all__,
    ("trainer.config", "trainer.run", "trainer.algorithm", "trainer.backends", "trainer.engines"),
)
