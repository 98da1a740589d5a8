"""Advantage estimators: per-sample advantages from rewards and GRPO groups.

Every estimator works on groups of any size (a group shrinks when failed samples are
dropped), computing each group's statistics over the samples it actually has. Names follow
slime's ``--advantage-estimator``:

* ``grpo``: ``(r - mean(group)) / (std(group) + eps)``; ``normalize_std=False`` keeps only
  the mean baseline (what Dr. GRPO recommends, with ``dr_grpo``'s loss aggregation).
* ``dr_grpo``: ``r - mean(group)``, never divided by the std (Dr. GRPO, Liu et al. 2025).
* ``rloo``: ``r - mean(others in the group)`` (REINFORCE leave-one-out); a group of one
  gets 0.
* ``reinforce_plus_plus_baseline``: ``r - mean(group)``, then normalised by the std over the
  whole batch (REINFORCE++ with a baseline).

The std is the population std (``unbiased=False``), as in slime and verl.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from agentenv import ConfigError

__all__ = ["ESTIMATORS", "compute_advantages"]

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "reinforce_plus_plus_baseline")


def compute_advantages(
    rewards: torch.Tensor | Sequence[float],
    groups: Sequence[Hashable],
    estimator: str = "grpo",
    *,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """One advantage per sample (float64 arithmetic, returned as float32).

    Args:
        rewards: one reward per sample.
        groups: one group key per sample (e.g. ``sample.group_id``); samples of one key form
            a GRPO group, in any order.
        estimator: one of :data:`ESTIMATORS`.
        normalize_std: ``grpo`` only: divide by the group's std.
        eps: added to every std before dividing.
    """
    if estimator not in ESTIMATORS:
        raise ConfigError(
            f"unknown advantage estimator {estimator!r}; valid: {', '.join(ESTIMATORS)}"
        )
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if len(groups) != r.numel():
        raise ConfigError(f"{r.numel()} rewards but {len(groups)} group keys")
    if r.numel() == 0:
        return torch.zeros(0)
    if not torch.isfinite(r).all():
        raise ConfigError("rewards must be finite")
    index: dict[Hashable, int] = {}
    gid = torch.tensor([index.setdefault(g, len(index)) for g in groups], dtype=torch.long)
    n_groups = int(gid.max()) + 1
    count = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, torch.ones_like(r))
    total = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, r)
    mean = (total / count)[gid]
    # A group whose rewards are all equal has advantage exactly 0 under every estimator:
    # its mean, a rounded sum divided by the count, may differ from the rewards in the
    # last bit, and divided by a std of that rounding the advantage would not be 0.
    lo = torch.full((n_groups,), torch.inf, dtype=torch.float64).scatter_reduce(0, gid, r, "amin")
    hi = torch.full((n_groups,), -torch.inf, dtype=torch.float64).scatter_reduce(0, gid, r, "amax")
    flat = (lo == hi)[gid]
    if estimator == "rloo":
        n = count[gid]
        others = (total[gid] - r) / (n - 1).clamp(min=1)
        return torch.where((n > 1) & ~flat, r - others, torch.zeros_like(r)).float()
    centred = torch.where(flat, torch.zeros_like(r), r - mean)
    if estimator == "dr_grpo" or (estimator == "grpo" and not normalize_std):
        return centred.float()
    if estimator == "grpo":
        var = torch.zeros(n_groups, dtype=torch.float64).index_add_(0, gid, centred**2) / count
        return (centred / (var.sqrt()[gid] + eps)).float()
    # reinforce_plus_plus_baseline: the group baseline, then the whole batch's std.
    return (centred / (centred.std(unbiased=False) + eps)).float()
