"""Causal attention through torch's ``scaled_dot_product_attention`` as megatron's core
attention: plugged into the local layer spec in place of megatron's ``DotProductAttention``
(which materialises the ``[b, heads, s, s]`` scores in the model's dtype), through the
spec system -- no change to megatron.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["SDPAttention", "packed_sequences", "varlen_causal_attention"]

#: The bounds of the sequences packed into the row being run (see packed_sequences).
_PACKING: contextvars.ContextVar[tuple[torch.Tensor, int] | None] = contextvars.ContextVar(
    "agentenv_packing", default=None
)


@contextlib.contextmanager
def packed_sequences(bounds: torch.Tensor, max_len: int) -> Iterator[None]:
    """While the model runs a single row of sequences packed one after another, tell
    :class:`SDPAttention` where they start (``bounds``: int32 offsets ``[n + 1]`` on the
    GPU; ``max_len``: the longest): attention then stays within each sequence.

    The rotary embedding keeps counting positions across the row; attention scores
    depend only on position differences inside a sequence, so the result is the same
    as with each sequence from 0 (up to rounding). This avoids megatron's ``thd`` path,
    whose rotary embedding loops over the sequences in Python for every layer."""
    token = _PACKING.set((bounds, max_len))
    try:
        yield
    finally:
        _PACKING.reset(token)


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
        if attention_bias is not None:
            raise ValueError("SDPAttention takes no attention bias")
        if packed_seq_params is not None:
            raise ValueError(
                "SDPAttention packs sequences through packed_sequences(), not megatron's "
                "'thd' path (its rotary embedding loops over the sequences in Python)"
            )
        packing = _PACKING.get()
        if packing is not None:  # one row [t, 1, ...] of packed sequences
            if self.training and self.dropout > 0:
                raise ValueError("packed sequences with attention dropout are not supported")
            t, _one, heads, d = query.shape
            bounds, max_len = packing
            out = varlen_causal_attention(
                query[:, 0], key[:, 0], value[:, 0], bounds, max_len, scale=self.scale
            )
            return out.reshape(t, 1, heads * d)
        sq, b, heads, d = query.shape
        # [s, b, n, d] -> [b, n, s, d]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0,
            scale=self.scale, enable_gqa=k.shape[1] != heads,
        )  # fmt: skip
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)


def varlen_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bounds: torch.Tensor,
    max_len: int,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention within each of the sequences packed one after another along the
    first dimension (``bounds``: int32 ``[n + 1]`` offsets on the tensors' device); GQA
    when key/value have fewer heads. ``[t, heads, d]`` out."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_parameters()
    heads, groups = query.shape[1], key.shape[1]
    kwargs: dict[str, Any] = {"scale": scale}
    if "is_causal" in params:  # the first releases with the function
        kwargs["is_causal"] = True
    else:
        kwargs["window_size"] = (-1, 0)
    if groups != heads:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            key = key.repeat_interleave(heads // groups, dim=1)
            value = value.repeat_interleave(heads // groups, dim=1)
    out = varlen_attn(query, key, value, bounds, bounds, max_len, max_len, **kwargs)
    assert isinstance(out, torch.Tensor)  # no auxiliary outputs were asked for
    return out


@functools.cache
def _varlen_parameters() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)
