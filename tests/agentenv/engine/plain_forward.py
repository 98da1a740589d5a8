"""A reference forward of the embedded engine's model, for the tests that check its numbers."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from agentenv.engine._model import LlamaModel


@torch.inference_mode()
def plain_logits(model: LlamaModel, ids: list[int]) -> torch.Tensor:
    """One causal forward over ``ids`` with ``model``'s weights and pieces (no pool, no
    cache): the logits [T, V] in fp32."""
    c = model.config
    n = len(ids)
    model._rope_table(n)
    h = model.embed[torch.tensor(ids, device=model.device)].unsqueeze(0)
    cos = model._cos[:n].view(1, n, 1, -1)
    sin = model._sin[:n].view(1, n, 1, -1)
    gqa = c.num_heads != c.num_kv_heads
    for layer in model.layers:
        q, k, v = model._qkv(layer, h, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        h = h + F.linear(out.transpose(1, 2).reshape(1, n, c.num_heads * c.head_dim), layer.o)
        h = h + model._mlp(layer, h)
    return model._linear(model._rms(h[0], model.norm), model.lm_head).float()


def plain_logprobs(model: LlamaModel, ids: list[int]) -> list[float]:
    """``log p(ids[i] | ids[:i])`` for i >= 1, from :func:`plain_logits`."""
    lp = torch.log_softmax(plain_logits(model, ids)[:-1], dim=-1)
    target = torch.tensor(ids[1:], device=model.device)
    return lp.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
