"""The math every backend shares: advantages from rewards and groups, the policy loss
and its token weights, and micro-batches packed by a token budget.
"""

from trainer.algorithm._advantages import ESTIMATORS, compute_advantages
from trainer.algorithm._batching import pack_by_tokens
from trainer.algorithm._losses import (
    gradient_without_advantage,
    kl_estimate,
    policy_loss,
    tempered_logits,
    token_weights,
)

__all__ = [
    "ESTIMATORS",
    "compute_advantages",
    "gradient_without_advantage",
    "kl_estimate",
    "pack_by_tokens",
    "policy_loss",
    "tempered_logits",
    "token_weights",
]
