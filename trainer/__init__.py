"""The GRPO trainer: advantages, losses, batching (backends, weight sync, the loop and
checkpoints build on these).

It consumes :class:`agentenv.Sample` batches from the Data Buffer. The algorithm functions
here are shared by every backend (plain torch on one machine, megatron-core on GPU nodes).
"""

from trainer._advantages import ESTIMATORS, compute_advantages
from trainer._backend import Backend, OptimConfig
from trainer._batching import pack_by_tokens
from trainer._data import load_prompt_data
from trainer._loop import SCHEDULES, GRPOConfig, run_grpo
from trainer._losses import (
    AGGREGATIONS,
    KL_TYPES,
    LossConfig,
    kl_estimate,
    logprob_temperature,
    policy_loss,
    tempered_logits,
    token_weights,
)
from trainer._sync import DiskSync, DistributedSync, InProcessSync, WeightSync
from trainer._torch import TorchBackend

__all__ = [
    "AGGREGATIONS",
    "ESTIMATORS",
    "KL_TYPES",
    "SCHEDULES",
    "Backend",
    "DiskSync",
    "DistributedSync",
    "GRPOConfig",
    "InProcessSync",
    "LossConfig",
    "OptimConfig",
    "TorchBackend",
    "WeightSync",
    "compute_advantages",
    "kl_estimate",
    "load_prompt_data",
    "logprob_temperature",
    "pack_by_tokens",
    "policy_loss",
    "run_grpo",
    "tempered_logits",
    "token_weights",
]
