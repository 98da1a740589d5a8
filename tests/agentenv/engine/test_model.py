"""The engine's model in mixed precision: with bf16 matrices and an fp32 residual stream
it computes what an fp32 HF model computes under bf16 autocast, and an update with fp32
weights keeps the norms and embeddings in fp32 (a tied output layer follows them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agentenv.engine._model import LlamaModel
from tests.agentenv.engine.plain_forward import plain_logits

pytestmark = pytest.mark.timeout(300)

IDS = [1 + (7 * i) % 500 for i in range(40)]


def _tiny(path: Path, *, tied: bool) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # peaked distributions, large logits: bf16 rounding shows
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(str(path))
    return path


def _hf_logits(path: Path, dtype: torch.dtype, *, autocast: bool) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        out: torch.Tensor = hf(torch.tensor([IDS])).logits[0].float()
    return out


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_matrices_with_an_fp32_residual_compute_what_autocast_computes(
    tmp_path: Path, tied: bool
) -> None:
    path = _tiny(tmp_path / "m", tied=tied)
    autocast = _hf_logits(path, torch.float32, autocast=True)
    mixed = LlamaModel.load(path, dtype=torch.bfloat16, residual_dtype=torch.float32)
    assert mixed.embed.dtype == mixed.norm.dtype == mixed.layers[0].ln1.dtype == torch.float32
    assert mixed.layers[0].qkv.dtype == mixed.lm_head.dtype == torch.bfloat16
    gap = float((plain_logits(mixed, IDS) - autocast).abs().max())
    # All in bf16 (today's bf16 engine) is another computation, far off.
    plain = LlamaModel.load(path, dtype=torch.bfloat16)
    far = float((plain_logits(plain, IDS) - autocast).abs().max())
    assert gap <= 1e-3 < 0.05 < far, (gap, far)
    # And the logits of the bf16 engine are those of an HF model in bf16.
    bf16 = _hf_logits(path, torch.bfloat16, autocast=False)
    assert float((plain_logits(plain, IDS) - bf16).abs().max()) <= 1e-3


@pytest.mark.parametrize("tied", [False, True])
def test_an_fp32_update_keeps_norms_and_embeddings_in_fp32(tmp_path: Path, tied: bool) -> None:
    from safetensors.torch import load_file

    path = _tiny(tmp_path / "m", tied=tied)
    weights = load_file(str(path / "model.safetensors"))
    # Updates far below the bf16 spacing of the norms (1.0) and embeddings (~0.15).
    moved = {k: v + 1e-5 for k, v in weights.items()}
    model = LlamaModel.load(path, dtype=torch.bfloat16, residual_dtype=torch.float32)
    head_before = model.lm_head.clone()
    for partial in (False, True):
        if partial:
            moved = {k: v + 2e-5 for k, v in weights.items()}
            model.update_weights(moved)
        else:
            model.set_weights(moved)
        assert torch.equal(model.norm, moved["model.norm.weight"])
        assert torch.equal(model.embed, moved["model.embed_tokens.weight"])
        assert torch.equal(
            model.layers[1].ln2, moved["model.layers.1.post_attention_layernorm.weight"]
        )
        head = moved["model.embed_tokens.weight" if tied else "lm_head.weight"]
        assert torch.equal(model.lm_head, head.to(torch.bfloat16))  # rounded, as autocast does
    assert (model.lm_head == head_before).float().mean() > 0.9  # the matrices: mostly unmoved


@pytest.mark.slow
@pytest.mark.parametrize(
    ("dtype", "residual", "hf_dtype", "autocast"),
    [
        (torch.float32, None, torch.float32, False),
        (torch.bfloat16, torch.float32, torch.float32, True),
        (torch.bfloat16, None, torch.bfloat16, False),
    ],
)
def test_smollm2_logits_are_transformers_in_each_precision(
    dtype: torch.dtype, residual: torch.dtype | None, hf_dtype: torch.dtype, autocast: bool
) -> None:
    """30 layers amplify any difference through the bf16 roundings: the RoPE table must be
    computed as transformers computes it (a float64 one was 0.4 off with autocast)."""
    from agentenv.engine import resolve_model

    path = resolve_model("smollm2-135m")
    ours = plain_logits(LlamaModel.load(path, dtype=dtype, residual_dtype=residual), IDS)
    gap = float((ours - _hf_logits(path, hf_dtype, autocast=autocast)).abs().max())
    assert gap <= 1e-3, gap
