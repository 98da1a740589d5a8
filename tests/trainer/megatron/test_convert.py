"""HF <-> megatron weight conversion on tiny random Llama and Qwen2 models: exact round
trips for every tensor/pipeline layout, the layout of each sharded tensor, and errors
that name the tensor whose shape does not fit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from agentenv import ConfigError
from tests.trainer.megatron.tiny import TINY, tiny_model
from trainer.megatron import (
    MegatronModelConfig,
    WeightShapeError,
    export_hf,
    hf_to_megatron,
    hf_to_megatron_shards,
    hf_weight_shapes,
    load_hf_weights,
    megatron_to_hf,
    megatron_weight_shapes,
)

LAYOUTS = [(1, 1), (2, 1), (4, 1), (1, 2), (2, 2), (4, 2)]


def _hf(model: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _config(model: Any, tp: int = 1, pp: int = 1, **kw: Any) -> MegatronModelConfig:
    return MegatronModelConfig.from_hf(
        model.config,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        make_vocab_size_divisible_by=8,
        **kw,
    )


@pytest.mark.parametrize(("tp", "pp"), LAYOUTS, ids=[f"tp{t}-pp{p}" for t, p in LAYOUTS])
@pytest.mark.parametrize("impl", ["local", "transformer_engine"])
def test_round_trip_is_exact(hf_model: Any, tp: int, pp: int, impl: str) -> None:
    hf = _hf(hf_model)
    cfg = _config(hf_model, tp, pp, transformer_impl=impl)
    shards = hf_to_megatron_shards(hf, cfg)
    for s, stage in enumerate(shards):
        expected = megatron_weight_shapes(cfg, pp_rank=s)
        for state in stage:
            assert {k: tuple(v.shape) for k, v in state.items()} == expected
    back = megatron_to_hf(shards, cfg)
    want = {k: v for k, v in hf.items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")}
    assert back.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(back[name], tensor), name


def test_qkv_is_grouped_per_kv_head_and_shards_whole_groups() -> None:
    model = tiny_model("qwen2", tied=False)
    hf, cfg = _hf(model), _config(model)
    q, k, v = (hf[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    qkv = hf_to_megatron(hf, cfg)["decoder.layers.0.self_attention.linear_qkv.weight"]
    d, per = cfg.kv_channels, cfg.num_attention_heads // cfg.num_query_groups  # 8, 2
    block = (per + 2) * d
    for group in range(cfg.num_query_groups):
        rows = qkv[group * block : (group + 1) * block]
        assert torch.equal(rows[: per * d], q[group * per * d : (group + 1) * per * d])
        assert torch.equal(rows[per * d : per * d + d], k[group * d : (group + 1) * d])
        assert torch.equal(rows[per * d + d :], v[group * d : (group + 1) * d])
    # Tensor parallelism splits the fused rows by whole query groups, biases alike.
    tp2 = _config(model, tp=2)
    for kind in ("weight", "bias"):
        name = f"decoder.layers.0.self_attention.linear_qkv.{kind}"
        full = hf_to_megatron(hf, cfg)[name]
        ranks = [hf_to_megatron(hf, tp2, tp_rank=r)[name] for r in range(2)]
        assert torch.equal(torch.cat(ranks), full)


def test_fc1_rank_holds_its_gate_rows_then_its_up_rows() -> None:
    model = tiny_model("llama", tied=False)
    hf, cfg = _hf(model), _config(model, tp=2)
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    f = cfg.ffn_hidden_size // 2
    for r in range(2):
        fc1 = hf_to_megatron(hf, cfg, tp_rank=r)["decoder.layers.1.mlp.linear_fc1.weight"]
        assert torch.equal(fc1, torch.cat([gate[r * f : (r + 1) * f], up[r * f : (r + 1) * f]]))
        fc2 = hf_to_megatron(hf, cfg, tp_rank=r)["decoder.layers.1.mlp.linear_fc2.weight"]
        assert torch.equal(fc2, hf["model.layers.1.mlp.down_proj.weight"][:, r * f : (r + 1) * f])


def test_vocabulary_is_padded_with_zero_rows_on_the_last_rank() -> None:
    model = tiny_model("llama", tied=False)
    hf, cfg = _hf(model), _config(model, tp=4)
    assert cfg.padded_vocab_size == 128  # 100 -> a multiple of 8 x 4
    shards = [hf_to_megatron(hf, cfg, tp_rank=r) for r in range(4)]
    for name, hf_name in [
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("output_layer.weight", "lm_head.weight"),
    ]:
        full = torch.cat([s[name] for s in shards])
        assert full.shape == (128, TINY["hidden_size"])
        assert torch.equal(full[:100], hf[hf_name])
        assert not full[100:].any()


def test_pipeline_stages_number_their_layers_from_zero() -> None:
    model = tiny_model("llama", tied=True)
    hf, cfg = _hf(model), _config(model, pp=2)
    first, last = (hf_to_megatron(hf, cfg, pp_rank=s) for s in range(2))
    assert "embedding.word_embeddings.weight" in first and "output_layer.weight" not in first
    assert "decoder.final_layernorm.weight" in last
    assert torch.equal(
        last["decoder.layers.0.mlp.linear_fc2.weight"], hf["model.layers.1.mlp.down_proj.weight"]
    )
    # Tied, two stages: the last stage holds its own copy of the (padded) embedding.
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])


def test_export_loads_in_transformers_with_the_same_logits(hf_model: Any, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    hf, cfg = _hf(hf_model), _config(hf_model, tp=2, pp=2)
    out = export_hf(tmp_path / "export", hf_to_megatron_shards(hf, cfg), cfg)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    weights = load_hf_weights(out)
    assert ("lm_head.weight" in weights) is not cfg.tie_word_embeddings
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded) is type(hf_model)
    ids = torch.tensor([[1, 5, 99, 42, 7, 0]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, hf_model(ids).logits)


def test_export_carries_the_source_models_tokenizer_and_generation_config(
    tmp_path: Path,
) -> None:
    """With ``source``, the export is a complete model directory: the source's tokenizer
    files and generation config are copied in, and transformers loads the tokenizer."""
    from transformers import AutoTokenizer

    from agentenv.engine import resolve_model
    from trainer._resources import MODEL_FILES

    source = resolve_model("smollm2-135m")
    model = tiny_model("llama", tied=True)
    hf, cfg = _hf(model), _config(model)
    out = export_hf(tmp_path / "export", hf_to_megatron_shards(hf, cfg), cfg, source=source)
    carried = [n for n in MODEL_FILES if (source / n).is_file()]
    assert "tokenizer.json" in carried and "generation_config.json" in carried
    for name in carried:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert AutoTokenizer.from_pretrained(out).chat_template is not None


def test_export_converts_dtype_and_replaces_the_directory(tmp_path: Path) -> None:
    model = tiny_model("qwen2", tied=False)
    hf, cfg = _hf(model), _config(model)
    shards = hf_to_megatron_shards(hf, cfg)
    export_hf(tmp_path / "w", shards, cfg)
    export_hf(tmp_path / "w", shards, cfg, dtype=torch.bfloat16)
    weights = load_hf_weights(tmp_path / "w")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    assert torch.equal(weights["model.norm.weight"], hf["model.norm.weight"].bfloat16())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w"]


# -- bad input -----------------------------------------------------------------------------
def test_a_checkpoint_of_another_shape_names_the_tensor_and_both_shapes() -> None:
    model = tiny_model("llama", tied=False)
    hf = _hf(model)
    wider = _config(tiny_model("llama", tied=False, intermediate_size=64))
    with pytest.raises(WeightShapeError) as info:
        hf_to_megatron(hf, wider)
    err = info.value
    assert err.name == "model.layers.0.mlp.gate_proj.weight"
    assert err.shape == (48, 32) and err.expected == (64, 32)
    assert "model.layers.0.mlp.gate_proj.weight" in str(err)
    assert "(48, 32)" in str(err) and "(64, 32)" in str(err)
    assert isinstance(err, ConfigError)


def test_a_shard_of_another_shape_names_the_rank_and_the_tensor() -> None:
    model = tiny_model("llama", tied=False)
    cfg = _config(model, tp=2)
    shards = hf_to_megatron_shards(_hf(model), cfg)
    name = "decoder.layers.1.self_attention.linear_proj.weight"
    shards[0][1][name] = shards[0][1][name][:, :-1]
    with pytest.raises(
        WeightShapeError, match=r"linear_proj.*\(32, 31\).*\(32, 32\).*tensor rank 1"
    ):
        megatron_to_hf(shards, cfg)


def test_missing_and_unexpected_tensors_are_named() -> None:
    model = tiny_model("qwen2", tied=False)
    hf, cfg = _hf(model), _config(model)
    del hf["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(ConfigError, match=r"lacks \['model.layers.1.self_attn.k_proj.bias'\]"):
        hf_to_megatron(hf, cfg)
    hf = {**_hf(model), "model.layers.2.mlp.up_proj.weight": torch.zeros(1)}
    with pytest.raises(ConfigError, match=r"unexpected tensors \['model.layers.2"):
        hf_to_megatron(hf, cfg)


def test_shard_lists_must_match_the_layout() -> None:
    model = tiny_model("llama", tied=True)
    cfg = _config(model, tp=2)
    shards = hf_to_megatron_shards(_hf(model), cfg)
    with pytest.raises(ConfigError, match=r"1 pipeline stage\(s\) x 2 tensor rank\(s\), got \[1\]"):
        megatron_to_hf([shards[0][:1]], cfg)
    with pytest.raises(ConfigError, match="tp_rank=2 is out of range"):
        hf_to_megatron(_hf(model), cfg, tp_rank=2)


def test_hf_shapes_match_transformers() -> None:
    for arch in ("llama", "qwen2"):
        for tied in (False, True):
            model = tiny_model(arch, tied)
            shapes = {
                k: tuple(v.shape)
                for k, v in model.state_dict().items()
                if not (tied and k == "lm_head.weight")
            }
            assert hf_weight_shapes(_config(model)) == shapes
