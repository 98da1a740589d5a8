"""An HF model config (Llama or Qwen2 architecture) mapped onto megatron-core's.

:class:`MegatronModelConfig` is plain data (no megatron import): the model's shape, its
parallel layout (tensor and pipeline sizes) and the padded vocabulary. The weight
conversion reads its shapes from it; :func:`trainer.megatron.model_provider` turns it into
megatron's ``TransformerConfig`` and ``GPTModel`` arguments.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from agentenv import ConfigError

__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "MegatronModelConfig",
    "padded_vocab_size",
]

#: HF ``architectures`` names (and their ``model_type``) that the backend maps.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}

TransformerImpl = Literal["local", "transformer_engine"]

# Megatron's RotaryEmbedding applies Llama-3.1 frequency scaling with these constants fixed.
_LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192.0,
}


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel: int) -> int:
    """``vocab_size`` rounded up to a multiple of ``divisible_by × tensor_parallel``
    (megatron's ``--make-vocab-size-divisible-by`` rule), so every rank holds an equal,
    aligned slice of the embedding and output layer."""
    if vocab_size < 1 or divisible_by < 1 or tensor_parallel < 1:
        raise ConfigError(
            f"vocab_size, divisible_by and tensor_parallel must be >= 1, got "
            f"{vocab_size}, {divisible_by}, {tensor_parallel}"
        )
    multiple = divisible_by * tensor_parallel
    return math.ceil(vocab_size / multiple) * multiple


def _load_hf_config(config: Any) -> dict[str, Any]:
    """A plain dict from a ``config.json`` mapping, a transformers config or a path."""
    if isinstance(config, Mapping):
        return dict(config)
    if isinstance(config, str | os.PathLike):
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        try:
            loaded = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot read an HF config from {str(path)!r}: {e}") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{str(path)!r} does not hold a JSON object")
        return loaded
    to_dict = getattr(config, "to_dict", None)
    if callable(to_dict):
        out = to_dict()
        if isinstance(out, dict):
            return out
    raise ConfigError(
        f"an HF config must be a mapping, a transformers config or a path, "
        f"got {type(config).__name__}"
    )


def _architecture(hf: Mapping[str, Any]) -> str:
    names = hf.get("architectures") or []
    if names:
        arch = str(names[0])
    else:
        by_type = {t: a for a, t in SUPPORTED_ARCHITECTURES.items()}
        arch = by_type.get(str(hf.get("model_type")), f"model_type={hf.get('model_type')!r}")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ConfigError(
            f"unsupported architecture {arch!r} for the megatron backend; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    return arch


def _rope(hf: Mapping[str, Any]) -> tuple[float, float | None]:
    """``(rotary_base, llama3 scaling factor or None)`` from old- or new-style HF fields."""
    params = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", hf.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind in (None, "default"):
        return theta, None
    if kind == "llama3":
        given = {k: float(params.get(k, v)) for k, v in _LLAMA3_ROPE.items()}
        if given != _LLAMA3_ROPE:
            raise ConfigError(
                f"llama3 rope scaling with {given} is not supported: megatron-core fixes "
                f"{_LLAMA3_ROPE}"
            )
        return theta, float(params.get("factor", 8.0))
    raise ConfigError(
        f"unsupported rope scaling type {kind!r}; supported: default, llama3 "
        "(megatron-core's GPTModel implements no other)"
    )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class MegatronModelConfig:
    """A Llama- or Qwen2-architecture model laid out for megatron-core.

    Build it with :meth:`from_hf`. Shapes use ``H`` attention heads, ``G`` KV heads
    (megatron's query groups), ``d`` the head dim, ``D`` the hidden size, ``F`` the MLP's
    intermediate size, ``V`` the vocabulary and ``Vp`` the padded vocabulary.

    Args:
        architecture: the HF architecture name (a key of ``SUPPORTED_ARCHITECTURES``).
        num_layers: decoder layers.
        hidden_size: ``D``.
        ffn_hidden_size: ``F``.
        num_attention_heads: ``H``.
        num_query_groups: ``G`` (``H`` for plain multi-head attention).
        kv_channels: ``d``.
        vocab_size: ``V``, the tokenizer's vocabulary as the HF checkpoint has it.
        max_position_embeddings: the longest sequence the model was trained for.
        norm_epsilon: the RMSNorm epsilon.
        rotary_base: RoPE's theta.
        rope_scaling_factor: Llama-3.1 RoPE scaling factor (None: no scaling).
        tie_word_embeddings: the output layer is the embedding (no ``lm_head.weight``).
        qkv_bias: q, k and v projections have biases (Qwen2).
        tensor_model_parallel_size: TP ranks; must divide ``H``, ``G`` and ``F``.
        pipeline_model_parallel_size: PP stages; must divide ``num_layers``.
        make_vocab_size_divisible_by: ``Vp`` is a multiple of this times TP.
        transformer_impl: ``local`` (megatron's own layers; norms are separate modules) or
            ``transformer_engine`` (norms fused into the following linear layer).
        hf_config: the HF config as a dict, written back on export.
    """

    architecture: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    max_position_embeddings: int
    norm_epsilon: float
    rotary_base: float
    rope_scaling_factor: float | None = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    make_vocab_size_divisible_by: int = 128
    transformer_impl: TransformerImpl = "local"
    hf_config: dict[str, Any] = dataclasses.field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ConfigError(
                f"unsupported architecture {self.architecture!r} for the megatron backend; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        for name in (
            "num_layers",
            "hidden_size",
            "ffn_hidden_size",
            "num_attention_heads",
            "num_query_groups",
            "kv_channels",
            "vocab_size",
            "max_position_embeddings",
            "tensor_model_parallel_size",
            "pipeline_model_parallel_size",
            "make_vocab_size_divisible_by",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
        if self.transformer_impl not in ("local", "transformer_engine"):
            raise ConfigError(
                f"transformer_impl must be 'local' or 'transformer_engine', "
                f"got {self.transformer_impl!r}"
            )
        h, g, tp = self.num_attention_heads, self.num_query_groups, self.tensor_model_parallel_size
        if h % g:
            raise ConfigError(
                f"num_key_value_heads={g} does not divide num_attention_heads={h}: "
                "not a grouped-query attention layout"
            )
        if h % tp or g % tp:
            fits = [n for n in range(1, g + 1) if g % n == 0 and h % n == 0]
            raise ConfigError(
                f"tensor_model_parallel_size={tp} must divide the {h} attention heads and "
                f"the {g} KV heads (megatron shards whole query groups); "
                f"use one of {fits}"
            )
        if self.ffn_hidden_size % tp:
            raise ConfigError(
                f"tensor_model_parallel_size={tp} does not divide "
                f"intermediate_size={self.ffn_hidden_size}"
            )
        pp = self.pipeline_model_parallel_size
        if self.num_layers % pp:
            raise ConfigError(
                f"pipeline_model_parallel_size={pp} does not divide the model's "
                f"{self.num_layers} layers (stages must hold equal numbers of layers)"
            )

    # -- from HF --------------------------------------------------------------------------
    @classmethod
    def from_hf(
        cls,
        config: Any,
        *,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        make_vocab_size_divisible_by: int = 128,
        transformer_impl: TransformerImpl = "local",
    ) -> MegatronModelConfig:
        """Map an HF config: a ``config.json`` dict, a ``transformers`` config, or a path to
        a model directory or its ``config.json``."""
        hf = _load_hf_config(config)
        arch = _architecture(hf)
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act={act!r} is not supported; Llama and Qwen2 use 'silu'")
        if arch == "LlamaForCausalLM":
            for flag in ("attention_bias", "mlp_bias"):
                if hf.get(flag):
                    raise ConfigError(
                        f"{flag}=True is not supported: megatron-core's GPTModel has biases "
                        "on q/k/v only (add_qkv_bias) or on every linear layer"
                    )
        if arch == "Qwen2ForCausalLM" and hf.get("use_sliding_window"):
            raise ConfigError(
                "use_sliding_window=True is not supported: megatron-core's local attention "
                "is full causal attention"
            )
        try:
            heads = int(hf["num_attention_heads"])
            hidden = int(hf["hidden_size"])
            theta, factor = _rope(hf)
            return cls(
                architecture=arch,
                num_layers=int(hf["num_hidden_layers"]),
                hidden_size=hidden,
                ffn_hidden_size=int(hf["intermediate_size"]),
                num_attention_heads=heads,
                num_query_groups=int(hf.get("num_key_value_heads") or heads),
                kv_channels=int(hf.get("head_dim") or hidden // heads),
                vocab_size=int(hf["vocab_size"]),
                max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
                norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)),
                rotary_base=theta,
                rope_scaling_factor=factor,
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                qkv_bias=arch == "Qwen2ForCausalLM",
                tensor_model_parallel_size=tensor_model_parallel_size,
                pipeline_model_parallel_size=pipeline_model_parallel_size,
                make_vocab_size_divisible_by=make_vocab_size_divisible_by,
                transformer_impl=transformer_impl,
                hf_config={**hf, "architectures": [arch]},
            )
        except KeyError as e:
            raise ConfigError(f"the HF config of a {arch} has no {e.args[0]!r}") from None

    # -- derived shapes -------------------------------------------------------------------
    @property
    def padded_vocab_size(self) -> int:
        """``Vp``: the vocabulary rows of megatron's embedding and output layer."""
        return padded_vocab_size(
            self.vocab_size, self.make_vocab_size_divisible_by, self.tensor_model_parallel_size
        )

    @property
    def layers_per_stage(self) -> int:
        """Decoder layers on each pipeline stage."""
        return self.num_layers // self.pipeline_model_parallel_size

    # -- megatron-core arguments ----------------------------------------------------------
    def transformer_config_kwargs(self, **overrides: Any) -> dict[str, Any]:
        """Keyword arguments for ``megatron.core.transformer.TransformerConfig``.

        Architecture fields come from the HF config; ``overrides`` (e.g. ``bf16=True``,
        ``params_dtype=torch.bfloat16``, ``sequence_parallel=True``,
        ``recompute_granularity="full"``) are added or win, except that they may not
        contradict the architecture or the parallel layout this config was built for.
        """
        import torch.nn.functional as F

        # What the architecture and the layout fix: overrides may not contradict these.
        fixed: dict[str, Any] = {
            "num_layers": self.num_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.ffn_hidden_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "kv_channels": self.kv_channels,
            "normalization": "RMSNorm",
            "gated_linear_unit": True,  # SwiGLU: fc1 holds [gate; up]
            "add_bias_linear": False,
            "add_qkv_bias": self.qkv_bias,
            "rotary_interleaved": False,  # HF's rotate_half layout
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "transformer_impl": self.transformer_impl,
        }
        kwargs: dict[str, Any] = {
            **fixed,
            "layernorm_epsilon": self.norm_epsilon,
            "activation_func": F.silu,
            "hidden_dropout": 0.0,
            "attention_dropout": 0.0,
            "bias_activation_fusion": False,
            "masked_softmax_fusion": False,
            "bias_dropout_fusion": False,
            "apply_rope_fusion": False,
            "persist_layer_norm": False,
            "gradient_accumulation_fusion": False,
        }
        clash = {k: (v, fixed[k]) for k, v in overrides.items() if k in fixed and v != fixed[k]}
        if clash:
            raise ConfigError(
                "overrides contradict the model config (given, expected): "
                + ", ".join(f"{k}={g!r} vs {e!r}" for k, (g, e) in clash.items())
                + "; build the config with MegatronModelConfig.from_hf(...) for that layout"
            )
        kwargs.update(overrides)
        return kwargs

    def gpt_model_kwargs(
        self, *, pre_process: bool = True, post_process: bool = True
    ) -> dict[str, Any]:
        """Keyword arguments for ``GPTModel`` besides ``config`` and ``transformer_layer_spec``.

        ``pre_process``/``post_process``: this pipeline stage holds the embedding / the
        final norm and output layer (both on a single stage).
        """
        return {
            "vocab_size": self.padded_vocab_size,
            "max_sequence_length": self.max_position_embeddings,
            "pre_process": pre_process,
            "post_process": post_process,
            "parallel_output": True,  # logits stay vocab-parallel for the cross-entropy
            "share_embeddings_and_output_weights": self.tie_word_embeddings,
            "position_embedding_type": "rope",
            "rotary_percent": 1.0,
            # megatron's own flag is an int; an integral float gives the same frequencies
            "rotary_base": int(b) if (b := self.rotary_base).is_integer() else b,
            "rope_scaling": self.rope_scaling_factor is not None,
            "rope_scaling_factor": self.rope_scaling_factor or 8.0,
        }
