"""Per-token log-probs from a GPTModel's vocab-parallel logits (megatron's
``vocab_parallel_cross_entropy``: no rank ever holds the full vocabulary).

The output layer has ``Vp`` rows, ``Vp - V`` of them padding. Their logits are set to
``-inf`` before the softmax: otherwise each padding row (zero, or trained towards
anything) adds to the normaliser and the log-probs differ from the HF model's and the
rollout engine's. Both log-probs and entropies are of ``softmax(logits / temperature)``
(:func:`trainer.algorithm._losses.tempered_logits`), the rollout's sampling distribution, as the
torch backend's are.
"""

from __future__ import annotations

import torch

from trainer.algorithm import tempered_logits

__all__ = ["mask_vocab_padding", "vocab_parallel_entropy", "vocab_parallel_logprobs"]


def mask_vocab_padding(logits: torch.Tensor, vocab_size: int, tp_rank: int) -> torch.Tensor:
    """``logits`` [..., Vp/tp] of rank ``tp_rank`` with the columns whose global token id
    is ``>= vocab_size`` set to ``-inf`` (a new tensor; no-op copy where none are)."""
    width = logits.shape[-1]
    first = tp_rank * width
    if first + width <= vocab_size:
        return logits.clone()
    ids = torch.arange(first, first + width, device=logits.device)
    return logits.masked_fill(ids >= vocab_size, float("-inf"))


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    tp_rank: int | None = None,
) -> torch.Tensor:
    """``log softmax(logits / temperature)[target]`` in fp32, differentiable.

    Args:
        logits: this rank's vocabulary slice, [..., Vp/tp] (GPTModel's output with
            ``parallel_output=True`` and no labels).
        target: the global token ids whose log-probs are wanted, [...].
        vocab_size: ``V``, the unpadded vocabulary.
        temperature: the sampling temperature of the rollout.
        tp_rank: this rank's tensor-parallel rank (default: megatron's parallel state).

    Returns log-probs [...], float32, identical on every tensor-parallel rank.
    """
    from trainer.megatron._provider import require_megatron

    core = require_megatron()
    if tp_rank is None:
        tp_rank = int(core.parallel_state.get_tensor_model_parallel_rank())
    # A fresh fp32 tensor: vocab_parallel_cross_entropy modifies its input in place.
    scaled = mask_vocab_padding(tempered_logits(logits, temperature), vocab_size, tp_rank)
    logp: torch.Tensor = -core.tensor_parallel.vocab_parallel_cross_entropy(scaled, target)
    return logp


def vocab_parallel_entropy(
    logits: torch.Tensor,
    *,
    vocab_size: int,
    temperature: float = 1.0,
    tp_rank: int | None = None,
) -> torch.Tensor:
    """The entropy of ``softmax(logits / temperature)`` over the real vocabulary, fp32,
    [...]: each tensor-parallel rank holds a slice [..., Vp/tp]; the sums are all-reduced
    across the tensor-parallel group (differentiably), so the result is the same on every
    rank."""
    from trainer.megatron._provider import require_megatron

    core = require_megatron()
    if tp_rank is None:
        tp_rank = int(core.parallel_state.get_tensor_model_parallel_rank())
    real = mask_vocab_padding(tempered_logits(logits, temperature), vocab_size, tp_rank)
    top = real.detach().max(dim=-1, keepdim=True).values
    group = core.parallel_state.get_tensor_model_parallel_group()
    if group.size() > 1:
        torch.distributed.all_reduce(top, op=torch.distributed.ReduceOp.MAX, group=group)
    e = torch.exp(real - top)  # 0 on the padding columns
    weighted = torch.where(e > 0, e * real, torch.zeros_like(e))
    reduce = core.tensor_parallel.reduce_from_tensor_model_parallel_region
    z = reduce(e.sum(-1))
    s = reduce(weighted.sum(-1))
    entropy: torch.Tensor = torch.log(z) + top.squeeze(-1) - s / z
    return entropy
