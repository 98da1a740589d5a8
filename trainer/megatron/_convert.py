"""HF (Llama / Qwen2) weights to megatron-core's GPTModel and back, sharded for tensor and
pipeline parallelism. Pure tensor code: megatron is not imported.

Layout, per tensor-parallel rank ``r`` of ``tp`` (``H`` heads, ``G`` KV heads, ``d`` head
dim, ``D`` hidden, ``F`` intermediate, ``V`` vocabulary, ``Vp`` padded vocabulary);
megatron's layer tensors are under ``decoder.layers.{i}.``, HF's under ``model.layers.{i}.``:

=================================  =================================  ======================
megatron (one rank)                HF                                 the rank's part
=================================  =================================  ======================
embedding.word_embeddings.weight   model.embed_tokens.weight [V, D]   rows r of [Vp, D]
output_layer.weight                lm_head.weight [V, D]              rows r of [Vp, D]
decoder.final_layernorm.weight     model.norm.weight [D]              all
self_attention.linear_qkv.weight   self_attn.{q,k,v}_proj.weight      query groups r, each
                                   [H·d, D], [G·d, D], [G·d, D]       [q (H/G)·d; k d; v d]
self_attention.linear_qkv.bias     self_attn.{q,k,v}_proj.bias        as the weight (Qwen2)
self_attention.linear_proj.weight  self_attn.o_proj.weight [D, H·d]   columns r
mlp.linear_fc1.weight              mlp.{gate,up}_proj.weight [F, D]   [gate rows r; up rows r]
mlp.linear_fc2.weight              mlp.down_proj.weight [D, F]        columns r
input_layernorm.weight             input_layernorm.weight [D]         all
pre_mlp_layernorm.weight           post_attention_layernorm.weight    all
=================================  =================================  ======================

With Transformer Engine the two norms are fused into the next linear layer and named
``…self_attention.linear_qkv.layer_norm_weight`` and ``…mlp.linear_fc1.layer_norm_weight``.
Layers are numbered from 0 on each pipeline stage; the first stage holds the embedding,
the last the final norm and output layer (with tied embeddings and several stages the
last stage holds its own copy of the embedding as ``output_layer.weight``). Padding rows
of the vocabulary are zero and are stripped on the way back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from agentenv import ConfigError
from trainer.megatron._config import MegatronModelConfig
from trainer.megatron._errors import WeightShapeError

__all__ = [
    "hf_to_megatron",
    "hf_to_megatron_shards",
    "hf_weight_shapes",
    "megatron_to_hf",
    "megatron_weight_shapes",
]

StateDict = dict[str, torch.Tensor]
Shape = tuple[int, ...]

_EMBED, _NORM, _HEAD = "model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"
_M_EMBED, _M_NORM, _M_HEAD = (
    "embedding.word_embeddings.weight",
    "decoder.final_layernorm.weight",
    "output_layer.weight",
)
# HF buffers that are not weights (older transformers saved the rotary frequencies).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _norm_names(cfg: MegatronModelConfig) -> tuple[str, str]:
    """Megatron's names (within a layer) for the attention and MLP input norms."""
    if cfg.transformer_impl == "transformer_engine":
        return "self_attention.linear_qkv.layer_norm_weight", "mlp.linear_fc1.layer_norm_weight"
    return "input_layernorm.weight", "pre_mlp_layernorm.weight"


# -- expected shapes -----------------------------------------------------------------------
def hf_weight_shapes(cfg: MegatronModelConfig) -> dict[str, Shape]:
    """Every HF tensor of the model and its shape (``lm_head.weight`` only when untied)."""
    h, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    dm, f, v = cfg.hidden_size, cfg.ffn_hidden_size, cfg.vocab_size
    out: dict[str, Shape] = {_EMBED: (v, dm)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (dm,)
        out[p + "self_attn.q_proj.weight"] = (h * d, dm)
        out[p + "self_attn.k_proj.weight"] = (g * d, dm)
        out[p + "self_attn.v_proj.weight"] = (g * d, dm)
        if cfg.qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (h * d,)
            out[p + "self_attn.k_proj.bias"] = (g * d,)
            out[p + "self_attn.v_proj.bias"] = (g * d,)
        out[p + "self_attn.o_proj.weight"] = (dm, h * d)
        out[p + "post_attention_layernorm.weight"] = (dm,)
        out[p + "mlp.gate_proj.weight"] = (f, dm)
        out[p + "mlp.up_proj.weight"] = (f, dm)
        out[p + "mlp.down_proj.weight"] = (dm, f)
    out[_NORM] = (dm,)
    if not cfg.tie_word_embeddings:
        out[_HEAD] = (v, dm)
    return out


def megatron_weight_shapes(cfg: MegatronModelConfig, *, pp_rank: int = 0) -> dict[str, Shape]:
    """Every tensor of one tensor-parallel rank's GPTModel state dict on stage ``pp_rank``,
    and its shape (the same on every tensor-parallel rank)."""
    _check_rank("pp_rank", pp_rank, cfg.pipeline_model_parallel_size)
    tp = cfg.tensor_model_parallel_size
    h, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    dm, f = cfg.hidden_size, cfg.ffn_hidden_size
    first, last = pp_rank == 0, pp_rank == cfg.pipeline_model_parallel_size - 1
    attn_norm, mlp_norm = _norm_names(cfg)
    out: dict[str, Shape] = {}
    if first:
        out[_M_EMBED] = (cfg.padded_vocab_size // tp, dm)
    for j in range(cfg.layers_per_stage):
        p = f"decoder.layers.{j}."
        out[p + attn_norm] = (dm,)
        out[p + "self_attention.linear_qkv.weight"] = ((h + 2 * g) * d // tp, dm)
        if cfg.qkv_bias:
            out[p + "self_attention.linear_qkv.bias"] = ((h + 2 * g) * d // tp,)
        out[p + "self_attention.linear_proj.weight"] = (dm, h * d // tp)
        out[p + mlp_norm] = (dm,)
        out[p + "mlp.linear_fc1.weight"] = (2 * f // tp, dm)
        out[p + "mlp.linear_fc2.weight"] = (dm, f // tp)
    if last:
        out[_M_NORM] = (dm,)
        if not (cfg.tie_word_embeddings and first):
            out[_M_HEAD] = (cfg.padded_vocab_size // tp, dm)
    return out


def _check_rank(name: str, rank: int, size: int) -> None:
    if not 0 <= rank < size:
        raise ConfigError(f"{name}={rank} is out of range for a size of {size}")


def _check(state: Mapping[str, torch.Tensor], expected: Mapping[str, Shape], where: str) -> None:
    """Missing tensors, and shapes that differ from ``expected``, are errors."""
    missing = [k for k in expected if k not in state]
    if missing:
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ConfigError(f"{where} lacks {missing[:5]}{more}: not a checkpoint of this model")
    for name, shape in expected.items():
        got = tuple(state[name].shape)
        if got != shape:
            raise WeightShapeError(name, got, shape, where)


# -- HF -> megatron ------------------------------------------------------------------------
def _validate_hf(hf: Mapping[str, torch.Tensor], cfg: MegatronModelConfig) -> None:
    expected = hf_weight_shapes(cfg)
    where = f"{cfg.architecture} config ({cfg.num_layers} layers, vocab {cfg.vocab_size})"
    _check(hf, expected, where)
    extra = [
        k
        for k in hf
        if k not in expected
        and not k.endswith(_IGNORED_SUFFIXES)
        and not (k == _HEAD and cfg.tie_word_embeddings)
    ]
    if extra:
        raise ConfigError(
            f"unexpected tensors {extra[:5]} for the {where}: not a checkpoint of this model"
        )


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` [V, D] with zero rows appended up to [rows, D]."""
    if t.shape[0] == rows:
        return t
    return torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def _qkv(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: MegatronModelConfig, tp_rank: int
) -> torch.Tensor:
    """Rank ``tp_rank``'s rows of megatron's fused qkv: its G/tp query groups, each
    ``[q (H/G)·d; k d; v d]``. Works for weights [·, D] and biases [·]."""
    g = cfg.num_query_groups
    per = g // cfg.tensor_model_parallel_size
    lo, hi = tp_rank * per, (tp_rank + 1) * per
    rest = q.shape[1:]
    grouped = torch.cat(
        [
            q.reshape(g, -1, *rest)[lo:hi],
            k.reshape(g, -1, *rest)[lo:hi],
            v.reshape(g, -1, *rest)[lo:hi],
        ],
        dim=1,
    )
    return grouped.reshape(-1, *rest)


def _chunk(t: torch.Tensor, tp: int, rank: int, dim: int) -> torch.Tensor:
    return torch.chunk(t, tp, dim=dim)[rank].contiguous()


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor],
    cfg: MegatronModelConfig,
    *,
    tp_rank: int = 0,
    pp_rank: int = 0,
    validate: bool = True,
) -> StateDict:
    """The GPTModel state dict of tensor-parallel rank ``tp_rank`` on pipeline stage
    ``pp_rank``, from an HF state dict (shapes in :func:`hf_weight_shapes`).

    The result may share memory with ``hf``; ``load_state_dict`` copies it. A missing
    tensor, an unexpected one, or a shape that does not fit ``cfg`` is an error naming it.
    """
    tp = cfg.tensor_model_parallel_size
    _check_rank("tp_rank", tp_rank, tp)
    _check_rank("pp_rank", pp_rank, cfg.pipeline_model_parallel_size)
    if validate:
        _validate_hf(hf, cfg)
    first, last = pp_rank == 0, pp_rank == cfg.pipeline_model_parallel_size - 1
    attn_norm, mlp_norm = _norm_names(cfg)
    vp = cfg.padded_vocab_size
    out: StateDict = {}
    if first:
        out[_M_EMBED] = _chunk(_pad_rows(hf[_EMBED], vp), tp, tp_rank, 0)
    offset = pp_rank * cfg.layers_per_stage
    for j in range(cfg.layers_per_stage):
        p, m = f"model.layers.{offset + j}.", f"decoder.layers.{j}."
        a = p + "self_attn."
        out[m + attn_norm] = hf[p + "input_layernorm.weight"]
        out[m + "self_attention.linear_qkv.weight"] = _qkv(
            hf[a + "q_proj.weight"], hf[a + "k_proj.weight"], hf[a + "v_proj.weight"], cfg, tp_rank
        )
        if cfg.qkv_bias:
            out[m + "self_attention.linear_qkv.bias"] = _qkv(
                hf[a + "q_proj.bias"], hf[a + "k_proj.bias"], hf[a + "v_proj.bias"], cfg, tp_rank
            )
        out[m + "self_attention.linear_proj.weight"] = _chunk(
            hf[a + "o_proj.weight"], tp, tp_rank, 1
        )
        out[m + mlp_norm] = hf[p + "post_attention_layernorm.weight"]
        out[m + "mlp.linear_fc1.weight"] = torch.cat(
            [
                _chunk(hf[p + "mlp.gate_proj.weight"], tp, tp_rank, 0),
                _chunk(hf[p + "mlp.up_proj.weight"], tp, tp_rank, 0),
            ]
        )
        out[m + "mlp.linear_fc2.weight"] = _chunk(hf[p + "mlp.down_proj.weight"], tp, tp_rank, 1)
    if last:
        out[_M_NORM] = hf[_NORM]
        if not cfg.tie_word_embeddings:
            out[_M_HEAD] = _chunk(_pad_rows(hf[_HEAD], vp), tp, tp_rank, 0)
        elif not first:
            # Tied, several stages: the last stage keeps its own copy of the embedding.
            out[_M_HEAD] = _chunk(_pad_rows(hf[_EMBED], vp), tp, tp_rank, 0)
    return out


def hf_to_megatron_shards(
    hf: Mapping[str, torch.Tensor], cfg: MegatronModelConfig
) -> list[list[StateDict]]:
    """Every rank's state dict, indexed ``[pp_rank][tp_rank]``."""
    _validate_hf(hf, cfg)
    return [
        [
            hf_to_megatron(hf, cfg, tp_rank=t, pp_rank=s, validate=False)
            for t in range(cfg.tensor_model_parallel_size)
        ]
        for s in range(cfg.pipeline_model_parallel_size)
    ]


# -- megatron -> HF ------------------------------------------------------------------------
def megatron_to_hf(
    shards: Sequence[Sequence[Mapping[str, torch.Tensor]]], cfg: MegatronModelConfig
) -> StateDict:
    """The HF state dict merged from every rank's GPTModel state dict, indexed
    ``[pp_rank][tp_rank]`` (a single rank: ``[[state]]``); vocabulary padding is stripped.

    TE's ``_extra_state`` entries are ignored; any other unexpected tensor, a missing one
    or a shape that does not fit ``cfg`` is an error naming the rank and the tensor.
    """
    tp, pp = cfg.tensor_model_parallel_size, cfg.pipeline_model_parallel_size
    if len(shards) != pp or any(len(stage) != tp for stage in shards):
        raise ConfigError(
            f"expected shards for {pp} pipeline stage(s) x {tp} tensor rank(s), got "
            f"{[len(stage) for stage in shards]}"
        )
    for s, stage in enumerate(shards):
        expected = megatron_weight_shapes(cfg, pp_rank=s)
        for t, state in enumerate(stage):
            where = f"pipeline stage {s}, tensor rank {t}"
            _check(state, expected, where)
            extra = [
                k
                for k in state
                if k not in expected
                and not k.endswith("_extra_state")
                and not (k == _M_HEAD and cfg.tie_word_embeddings)
            ]
            if extra:
                raise ConfigError(f"unexpected tensors {extra[:5]} on {where}")
    h, g, d = cfg.num_attention_heads, cfg.num_query_groups, cfg.kv_channels
    attn_norm, mlp_norm = _norm_names(cfg)
    v = cfg.vocab_size
    out: StateDict = {_EMBED: torch.cat([r[_M_EMBED] for r in shards[0]])[:v]}
    for s, stage in enumerate(shards):
        for j in range(cfg.layers_per_stage):
            p, m = f"model.layers.{s * cfg.layers_per_stage + j}.", f"decoder.layers.{j}."

            def cat(
                name: str, dim: int, stage: Sequence[Mapping[str, torch.Tensor]] = stage
            ) -> torch.Tensor:
                return torch.cat([r[name] for r in stage], dim=dim)

            out[p + "input_layernorm.weight"] = stage[0][m + attn_norm]
            kinds = ("weight", "bias") if cfg.qkv_bias else ("weight",)
            for kind in kinds:
                qkv = cat(m + f"self_attention.linear_qkv.{kind}", 0)
                rest = qkv.shape[1:]
                q, k, val = torch.split(qkv.reshape(g, -1, *rest), [h // g * d, d, d], dim=1)
                out[p + f"self_attn.q_proj.{kind}"] = q.reshape(h * d, *rest)
                out[p + f"self_attn.k_proj.{kind}"] = k.reshape(g * d, *rest)
                out[p + f"self_attn.v_proj.{kind}"] = val.reshape(g * d, *rest)
            out[p + "self_attn.o_proj.weight"] = cat(m + "self_attention.linear_proj.weight", 1)
            out[p + "post_attention_layernorm.weight"] = stage[0][m + mlp_norm]
            halves = [r[m + "mlp.linear_fc1.weight"].chunk(2) for r in stage]
            out[p + "mlp.gate_proj.weight"] = torch.cat([gate for gate, _ in halves])
            out[p + "mlp.up_proj.weight"] = torch.cat([up for _, up in halves])
            out[p + "mlp.down_proj.weight"] = cat(m + "mlp.linear_fc2.weight", 1)
    out[_NORM] = shards[-1][0][_M_NORM]
    if not cfg.tie_word_embeddings:
        out[_HEAD] = torch.cat([r[_M_HEAD] for r in shards[-1]])[:v]
    return out
