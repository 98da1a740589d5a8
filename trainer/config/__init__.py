"""The settings each component of a training run takes, light (no torch): the loss's
(:class:`LossConfig`), the optimizer's (:class:`OptimConfig`), the rollout's and the
schedule's (:class:`GRPOConfig`), the environment a run plays (:class:`EnvSpec`), the
defaults that depend on the device, and how each setting declares its flag
(:func:`setting`). :class:`~trainer.TrainConfig`, the tree of a whole run, holds these
groups; it lives in :mod:`trainer.run`, above the backends it checks the layout of.
"""

from trainer.config._algorithm import AGGREGATIONS, KL_TYPES, LossConfig, logprob_temperature
from trainer.config._defaults import (
    default_checkpointing,
    default_compile,
    default_micro_batch_tokens,
    default_precision,
)
from trainer.config._envs import EnvSpec, build_env
from trainer.config._optimizer import OptimConfig
from trainer.config._rollout import SCHEDULES, GRPOConfig
from trainer.config._settings import Flag, Group, flags, merge, nest, setting

__all__ = [
    "AGGREGATIONS",
    "KL_TYPES",
    "SCHEDULES",
    "EnvSpec",
    "Flag",
    "GRPOConfig",
    "Group",
    "LossConfig",
    "OptimConfig",
    "build_env",
    "default_checkpointing",
    "default_compile",
    "default_micro_batch_tokens",
    "default_precision",
    "flags",
    "logprob_temperature",
    "merge",
    "nest",
    "setting",
]
