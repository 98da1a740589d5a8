"""The SDPA core attention plugged into megatron's layer spec equals plain causal
attention with grouped-query heads (pure torch: runs on CPU, megatron not needed)."""

from __future__ import annotations

import math
import types

import pytest
import torch

from trainer.megatron._attention import SDPAttention


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    s, b, heads, d = q.shape
    rep = heads // k.shape[2]
    k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
    scores = torch.einsum("sbnd,tbnd->bnst", q, k) / math.sqrt(d)
    scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
    out = torch.einsum("bnst,tbnd->sbnd", scores.softmax(-1), v)
    return out.reshape(s, b, heads * d)


@pytest.mark.parametrize(("heads", "groups"), [(4, 4), (6, 2), (9, 3)])
def test_sdpa_core_attention_equals_causal_attention(heads: int, groups: int) -> None:
    config = types.SimpleNamespace(attention_dropout=0.0, context_parallel_size=1)
    causal = types.SimpleNamespace(name="causal")
    attn = SDPAttention(config, 1, causal, "self").eval()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 2, heads, 8, generator=g, dtype=torch.float64)
    k = torch.randn(7, 2, groups, 8, generator=g, dtype=torch.float64)
    v = torch.randn(7, 2, groups, 8, generator=g, dtype=torch.float64)
    out = attn(q, k, v, None)
    assert out.shape == (7, 2, heads * 8)
    torch.testing.assert_close(out, _reference(q, k, v))


def test_other_mask_types_are_refused() -> None:
    config = types.SimpleNamespace(attention_dropout=0.0, context_parallel_size=1)
    with pytest.raises(ValueError, match="causal only"):
        SDPAttention(config, 1, types.SimpleNamespace(name="padding"), "self")
