"""HF config -> megatron-core arguments: the mapping, vocabulary padding, and the errors
for what megatron cannot express."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from agentenv import ConfigError
from tests.trainer.megatron.tiny import TINY, tiny_model
from trainer.megatron import SUPPORTED_ARCHITECTURES, MegatronModelConfig, padded_vocab_size


def _hf(arch: str = "LlamaForCausalLM", **kw: Any) -> dict[str, Any]:
    model_type = SUPPORTED_ARCHITECTURES.get(arch, "other")
    return {**TINY, "architectures": [arch], "model_type": model_type, **kw}


def test_llama_maps_onto_transformer_config_and_gpt_model_arguments() -> None:
    cfg = MegatronModelConfig.from_hf(
        _hf(rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, rms_norm_eps=1e-5),
        tensor_model_parallel_size=2,
    )
    tc = cfg.transformer_config_kwargs(bf16=True, params_dtype=torch.bfloat16)
    assert tc["num_layers"] == 2 and tc["hidden_size"] == 32 and tc["ffn_hidden_size"] == 48
    assert tc["num_attention_heads"] == 8 and tc["num_query_groups"] == 4
    assert tc["kv_channels"] == 8 and tc["layernorm_epsilon"] == 1e-5
    assert tc["normalization"] == "RMSNorm" and tc["gated_linear_unit"] is True
    assert tc["activation_func"] is torch.nn.functional.silu
    assert tc["add_bias_linear"] is False and tc["add_qkv_bias"] is False
    assert tc["rotary_interleaved"] is False and tc["transformer_impl"] == "local"
    assert tc["tensor_model_parallel_size"] == 2 and tc["bf16"] is True
    gm = cfg.gpt_model_kwargs()
    assert gm["vocab_size"] == 256  # 100 padded to a multiple of 128 x 2
    assert gm["position_embedding_type"] == "rope" and gm["rotary_base"] == 500000
    assert gm["share_embeddings_and_output_weights"] is False and gm["rope_scaling"] is False
    assert gm["max_sequence_length"] == 64 and gm["parallel_output"] is True


def test_qwen2_has_qkv_bias_and_tied_embeddings_carry_over() -> None:
    cfg = MegatronModelConfig.from_hf(_hf("Qwen2ForCausalLM", tie_word_embeddings=True))
    assert cfg.qkv_bias and cfg.transformer_config_kwargs()["add_qkv_bias"] is True
    assert cfg.gpt_model_kwargs()["share_embeddings_and_output_weights"] is True


def test_old_style_rope_fields_and_llama3_scaling() -> None:
    cfg = MegatronModelConfig.from_hf(
        _hf(
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        )
    )
    gm = cfg.gpt_model_kwargs()
    assert gm["rotary_base"] == 500000 and gm["rope_scaling"] is True
    assert gm["rope_scaling_factor"] == 32.0


def test_accepts_a_transformers_config_a_directory_and_a_config_json(tmp_path: Path) -> None:
    model = tiny_model("qwen2", tied=True)
    from_object = MegatronModelConfig.from_hf(model.config)
    (tmp_path / "config.json").write_text(json.dumps(model.config.to_dict()))
    assert MegatronModelConfig.from_hf(tmp_path) == from_object
    assert MegatronModelConfig.from_hf(tmp_path / "config.json") == from_object
    assert from_object.architecture == "Qwen2ForCausalLM" and from_object.tie_word_embeddings


def test_architecture_is_found_from_model_type_when_architectures_is_missing() -> None:
    cfg = MegatronModelConfig.from_hf({**_hf(), "architectures": None, "model_type": "qwen2"})
    assert cfg.architecture == "Qwen2ForCausalLM"


@pytest.mark.parametrize(
    ("vocab", "divisible", "tp", "padded"),
    [(100, 128, 1, 128), (128, 128, 1, 128), (49152, 128, 4, 49152), (151936, 128, 8, 152576)],
)
def test_padded_vocab_size(vocab: int, divisible: int, tp: int, padded: int) -> None:
    assert padded_vocab_size(vocab, divisible, tp) == padded


# -- bad input -----------------------------------------------------------------------------
def test_an_unsupported_architecture_is_named_with_the_supported_ones() -> None:
    with pytest.raises(ConfigError) as info:
        MegatronModelConfig.from_hf(_hf("MistralForCausalLM"))
    message = str(info.value)
    assert "'MistralForCausalLM'" in message
    assert "LlamaForCausalLM" in message and "Qwen2ForCausalLM" in message
    with pytest.raises(ConfigError, match="model_type='gpt2'"):
        MegatronModelConfig.from_hf({**_hf(), "architectures": None, "model_type": "gpt2"})


def test_tp_must_divide_heads_and_kv_heads() -> None:
    with pytest.raises(
        ConfigError, match=r"tensor_model_parallel_size=8 .* 4 KV heads.*\[1, 2, 4\]"
    ):
        MegatronModelConfig.from_hf(_hf(), tensor_model_parallel_size=8)
    with pytest.raises(
        ConfigError, match=r"tensor_model_parallel_size=3 must divide the 8 attention"
    ):
        MegatronModelConfig.from_hf(_hf(), tensor_model_parallel_size=3)


def test_other_layouts_megatron_cannot_shard() -> None:
    with pytest.raises(ConfigError, match="num_key_value_heads=3 does not divide"):
        MegatronModelConfig.from_hf(_hf(num_key_value_heads=3))
    with pytest.raises(ConfigError, match="does not divide intermediate_size=50"):
        MegatronModelConfig.from_hf(_hf(intermediate_size=50), tensor_model_parallel_size=4)
    with pytest.raises(ConfigError, match="pipeline_model_parallel_size=3 does not divide"):
        MegatronModelConfig.from_hf(_hf(), pipeline_model_parallel_size=3)
    with pytest.raises(ConfigError, match="tensor_model_parallel_size must be an integer >= 1"):
        MegatronModelConfig.from_hf(_hf(), tensor_model_parallel_size=0)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"hidden_act": "gelu"}, "hidden_act='gelu' is not supported"),
        ({"attention_bias": True}, "attention_bias=True is not supported"),
        ({"mlp_bias": True}, "mlp_bias=True is not supported"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "rope scaling type 'yarn'"),
        (
            {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 2.0}},
            "megatron-core fixes",
        ),
    ],
)
def test_llama_features_megatron_lacks_are_refused(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MegatronModelConfig.from_hf(_hf(**fields))


def test_qwen2_sliding_window_and_missing_fields_are_refused() -> None:
    with pytest.raises(ConfigError, match="use_sliding_window=True"):
        MegatronModelConfig.from_hf(_hf("Qwen2ForCausalLM", use_sliding_window=True))
    hf = _hf()
    del hf["hidden_size"]
    with pytest.raises(ConfigError, match="LlamaForCausalLM has no 'hidden_size'"):
        MegatronModelConfig.from_hf(hf)
    with pytest.raises(ConfigError, match="cannot read an HF config"):
        MegatronModelConfig.from_hf("/nonexistent/model")


def test_overrides_may_not_contradict_the_model() -> None:
    cfg = MegatronModelConfig.from_hf(_hf(), tensor_model_parallel_size=2)
    assert cfg.transformer_config_kwargs(sequence_parallel=True)["sequence_parallel"] is True
    with pytest.raises(ConfigError, match="tensor_model_parallel_size=4 vs 2"):
        cfg.transformer_config_kwargs(tensor_model_parallel_size=4)
