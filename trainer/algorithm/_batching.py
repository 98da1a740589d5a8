"""Micro-batches packed by a token budget (slime's ``--use-dynamic-batch-size`` with
``--max-tokens-per-gpu``).

Packing only decides which samples share a forward pass. The loss does not depend on it:
each token's weight (:func:`trainer.token_weights`) is computed for the whole step, so the
micro-batches' weighted sums add up to the same loss and gradients in any packing.
"""

from __future__ import annotations

from collections.abc import Sequence

from agentenv import ConfigError

__all__ = ["pack_by_tokens"]


def pack_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """Sample indices per micro-batch, each micro-batch at most ``max_tokens`` tokens.

    First-fit decreasing: the longest samples are placed first, each into the first
    micro-batch with room, which keeps the number of micro-batches near the minimum.
    Indices within a micro-batch are in ascending order; micro-batches are ordered by
    their first index. A sample longer than the budget is an error naming both.
    """
    if max_tokens < 1:
        raise ConfigError(f"max_tokens must be at least 1, got {max_tokens}")
    for i, n in enumerate(lengths):
        if n > max_tokens:
            raise ConfigError(
                f"sample {i} has {n} tokens, more than max_tokens_per_gpu={max_tokens}; "
                "raise the budget or shorten rollouts"
            )
        if n < 0:
            raise ConfigError(f"sample {i} has a negative length {n}")
    bins: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda k: (-lengths[k], k)):
        for b, free in enumerate(room):
            if lengths[i] <= free:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return sorted((sorted(b) for b in bins), key=lambda b: b[0])
