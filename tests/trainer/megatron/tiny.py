"""Tiny random Llama and Qwen2 models (transformers, random weights everywhere)."""

from __future__ import annotations

from typing import Any

import torch

# 8 query heads in 4 KV groups: TP 1, 2 and 4 all divide them. A vocabulary of 100 is no
# multiple of anything, so every layout pads it.
TINY = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 8,
    "vocab_size": 100,
    "max_position_embeddings": 64,
}


def tiny_model(arch: str, tied: bool, seed: int = 0, **extra: Any) -> Any:
    """A ``LlamaForCausalLM`` or ``Qwen2ForCausalLM`` with every parameter random
    (norms and biases too, so that a mix-up of any two tensors shows)."""
    import transformers

    config_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}
    config = config_cls(**{**TINY, **extra}, tie_word_embeddings=tied)
    config.architectures = [model_cls[arch].__name__]
    torch.manual_seed(seed)
    model = model_cls[arch](config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model
