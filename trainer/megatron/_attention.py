"""Causal attention through torch's ``scaled_dot_product_attention`` as megatron's core
attention: plugged into the local layer spec in place of megatron's ``DotProductAttention``
(which materialises the ``[b, heads, s, s]`` scores in the model's dtype), through the
spec system -- no change to megatron.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SDPAttention"]


class SDPAttention(torch.nn.Module):
    """Megatron's core-attention interface: query ``[sq, b, heads, d]``, key and value
    ``[sk, b, groups, d]`` (this rank's heads) in, context ``[sq, b, heads * d]`` out.

    Causal only (the GPT spec's mask type); the attention mask argument is ignored, as
    megatron's local attention ignores it for causal masks. Grouped-query attention is
    handled by the kernel (``enable_gqa``).
    """

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        if getattr(attn_mask_type, "name", "causal") != "causal":
            raise ValueError(f"SDPAttention is causal only, got mask type {attn_mask_type}")
        if getattr(config, "context_parallel_size", 1) != 1:
            raise ValueError("SDPAttention has no context parallelism")
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
        **_: Any,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("SDPAttention takes no attention bias or packed sequences")
        sq, b, heads, d = query.shape
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale, enable_gqa=k.shape[1] != heads,
        )  # fmt: skip
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)
