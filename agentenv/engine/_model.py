"""A Llama-family decoder in plain torch, shaped for continuous batching.

Covers the Hugging Face ``LlamaForCausalLM``, ``MistralForCausalLM`` and
``Qwen2ForCausalLM`` layouts (grouped-query attention, RoPE, RMSNorm, SiLU-gated MLP,
optional q/k/v biases, tied or separate output embeddings), loaded from a model directory
(``config.json`` + ``*.safetensors``). It computes exactly what the HF implementation
computes (``tests/agentenv/engine`` checks logits against ``transformers``), but its forward takes a
*batch of sequences at different positions* against one shared key/value pool:

* :class:`~agentenv.engine._pool.KVPool` holds every token's keys and values in slots;
  sequence ``i`` of the running batch has row ``i`` of the pool's table, the slot of each
  of its positions, and attention gathers keys and values by those indices.
* :meth:`LlamaModel.prefill` computes the new tokens of several sequences (each possibly
  on top of a cached prefix), packed in one forward; :meth:`LlamaModel.decode` runs one new
  token for each of the first ``n`` table rows.
* On CPU a token's keys, values and logits are a function of the tokens before it only,
  bit for bit, whatever else shares its forward and however its sequence was split
  between cache and computation (see :meth:`LlamaModel._attention`): the prefix cache
  changes no number.

Two dtypes: ``dtype`` for the matrix multiplications' weights, their outputs and the KV
cache, and ``residual_dtype`` (default: ``dtype``) for the embeddings, the norms' weights,
the residual stream and RoPE. ``dtype=bfloat16, residual_dtype=float32`` computes what an
fp32 HF model computes under ``torch.autocast(device, torch.bfloat16)``: autocast casts each
linear layer's input and weight to bf16 and leaves the embedding lookup, the RMSNorms and
the residual additions in fp32; here the bf16 weights are those casts, done once per weight
update instead of once per forward (so the CUDA graphs need no autocast).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from agentenv._errors import ConfigError
from agentenv.engine._pool import KVPool

__all__ = [
    "KEY_BLOCK",
    "DecodeReplay",
    "LlamaModel",
    "ModelConfig",
    "Prefill",
    "Visible",
    "round_up",
]

# Keys are attended in blocks of this many positions (a table's columns are a multiple).
KEY_BLOCK = 128
# On CPU every matrix product runs with at least this many rows (linear layers) or query
# rows (attention): fewer take other BLAS kernels, whose rounding differs (see _rows).
MIN_ROWS = 16
MIN_QUERY_ROWS = 8


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclasses.dataclass(frozen=True, slots=True)
class Prefill:
    """One sequence of a prefill: its table ``row``, how many of its first positions are
    cached already (``start``), and the tokens to compute after them."""

    row: int
    start: int
    tokens: list[int]


_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


class DecodeReplay(Protocol):
    """What replays the decode step instead of running it (``_graphs.DecodeGraphs``)."""

    def decode(
        self, ids: list[int], positions: list[int], slots: list[int], pool: KVPool
    ) -> torch.Tensor: ...


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """The shape of a Llama-family model, read from its ``config.json``."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    eos_token_ids: tuple[int, ...]

    @classmethod
    def load(cls, directory: Path) -> ModelConfig:
        try:
            raw: dict[str, Any] = json.loads((directory / "config.json").read_text())
        except FileNotFoundError:
            raise ConfigError(f"{str(directory)!r} has no config.json: not a HF model") from None
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in _ARCHITECTURES:
            raise ConfigError(
                f"the embedded engine runs {', '.join(_ARCHITECTURES)} models; "
                f"{str(directory)!r} is a {arch} (serve it with SGLang)"
            )
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise ConfigError(
                f"rope type {rope_type!r} is not supported by the embedded engine "
                f"(model {str(directory)!r}); serve it with SGLang"
            )
        theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        heads = int(raw["num_attention_heads"])
        hidden = int(raw["hidden_size"])
        eos = raw.get("eos_token_id")
        gen = directory / "generation_config.json"
        if gen.exists():
            eos = json.loads(gen.read_text()).get("eos_token_id", eos)
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(raw.get("head_dim") or hidden // heads),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            eos_token_ids=eos_ids,
        )


class Visible:
    """Which keys each query of a forward sees (its own position and those before),
    computed once per forward and shared by every layer: on CPU an additive bias (0 or
    -inf) per key block over the query rows as :meth:`LlamaModel._attention` orders them,
    kept when small; on CUDA one boolean mask."""

    def __init__(self, qpos: torch.Tensor, length: int, group: int, cpu: bool) -> None:
        s, t = qpos.shape
        self.qpos, self.length, self.cpu = qpos, length, cpu
        self._mask: torch.Tensor | None = None
        self._bias: dict[int, torch.Tensor] = {}
        rows = group * t
        pos = qpos.view(s, 1, 1, t).expand(s, 1, group, t).reshape(s, 1, rows, 1)
        if cpu and rows < MIN_QUERY_ROWS:
            pos = F.pad(pos, (0, 0, 0, MIN_QUERY_ROWS - rows))
        self._rows = pos.view(1, s, -1, 1)  # the CPU attention's [KV, S, rows, keys] order
        self._keep = pos.numel() * length <= 1 << 22

    def bias(self, start: int) -> torch.Tensor:
        """[1, S, rows, KEY_BLOCK] float32: 0 where the row sees the key, else -inf."""
        cached = self._bias.get(start)
        if cached is not None:
            return cached
        keys = torch.arange(start, start + KEY_BLOCK, device=self.qpos.device)
        hidden = keys.view(1, 1, 1, -1) > self._rows
        out = torch.zeros(hidden.shape, device=self.qpos.device).masked_fill_(hidden, float("-inf"))
        if self._keep:
            self._bias[start] = out
        return out

    def mask(self) -> torch.Tensor:
        """[S, 1, T, L] bool: True where the query sees the key (SDPA's mask)."""
        if self._mask is None:
            s, t = self.qpos.shape
            keys = torch.arange(self.length, device=self.qpos.device)
            self._mask = keys.view(1, 1, 1, -1) <= self.qpos.view(s, 1, t, 1)
        return self._mask


class _Layer:
    __slots__ = ("down", "gate_up", "ln1", "ln2", "o", "qkv", "qkv_bias")

    def __init__(self) -> None:
        self.qkv: torch.Tensor
        self.qkv_bias: torch.Tensor | None = None
        self.o: torch.Tensor
        self.gate_up: torch.Tensor
        self.down: torch.Tensor
        self.ln1: torch.Tensor
        self.ln2: torch.Tensor


class LlamaModel:
    """The weights and the batched forward passes (inference only)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: Any,
        residual_dtype: torch.dtype | None = None,
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.residual_dtype = residual_dtype or dtype
        self.device = torch.device(device)
        self.layers = [_Layer() for _ in range(config.num_layers)]
        self.embed: torch.Tensor
        self.norm: torch.Tensor
        self.lm_head: torch.Tensor
        # RoPE's frequencies and angles in fp32, as transformers computes them: a float64
        # table differs by ~1e-7 in the angles, which the bf16 roundings downstream
        # amplify (0.4 in SmolLM2's logits with an fp32 residual stream); the same table
        # makes the engine's prefill the trainer's, bit for bit on CPU.
        exponents = torch.arange(0, config.head_dim, 2, dtype=torch.int64, device=self.device)
        self._inv_freq = 1.0 / (config.rope_theta ** (exponents.float() / config.head_dim))
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._rope_table(1024)
        self.graphs: DecodeReplay | None = None
        self._tied: bool | None = None

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def load(
        cls,
        directory: str | Path,
        *,
        dtype: torch.dtype = torch.float32,
        device: Any = "cpu",
        residual_dtype: torch.dtype | None = None,
    ) -> LlamaModel:
        directory = Path(directory)
        model = cls(ModelConfig.load(directory), dtype, device, residual_dtype)
        model.set_weights(read_safetensors(directory))
        return model

    @property
    def has_weights(self) -> bool:
        """False between :meth:`drop_weights` and the next :meth:`set_weights`."""
        return hasattr(self, "embed")

    def drop_weights(self) -> None:
        """Free every weight (an engine's memory given to a trainer on the same CPU); the
        next :meth:`set_weights` loads them anew, and nothing may run before it."""
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down", "ln1", "ln2"):
                if hasattr(layer, name):
                    delattr(layer, name)
            layer.qkv_bias = None
        for name in ("embed", "norm", "lm_head"):
            if hasattr(self, name):
                delattr(self, name)

    @torch.inference_mode()
    def set_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Install HF-named weights (``model.layers.0.self_attn.q_proj.weight``, ...).

        Once loaded, weights are copied into the existing tensors (same shapes required),
        so captured CUDA graphs keep reading the current weights. Each is rounded to its
        dtype here (fp32 weights of a trainer under autocast become bf16 matrices and stay
        fp32 norms and embeddings)."""
        c = self.config

        def take(name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
            try:
                t = tensors[name]
            except KeyError:
                raise ConfigError(f"the weights have no tensor {name!r}") from None
            return t.to(device=self.device, dtype=dtype or self.dtype)

        def cat(*names: str) -> torch.Tensor:  # a fused weight: the HF ones' rows in order
            return torch.cat([take(name) for name in names])

        res = self.residual_dtype
        new: list[tuple[object, str, torch.Tensor]] = []
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            attn, mlp = p + "self_attn.", p + "mlp."
            new.append((layer, "qkv", cat(*(f"{attn}{n}_proj.weight" for n in "qkv"))))
            if c.attention_bias:
                new.append((layer, "qkv_bias", cat(*(f"{attn}{n}_proj.bias" for n in "qkv"))))
            new.append((layer, "o", take(attn + "o_proj.weight")))
            new.append((layer, "gate_up", cat(mlp + "gate_proj.weight", mlp + "up_proj.weight")))
            new.append((layer, "down", take(mlp + "down_proj.weight")))
            new.append((layer, "ln1", take(p + "input_layernorm.weight", res)))
            new.append((layer, "ln2", take(p + "post_attention_layernorm.weight", res)))
        new.append((self, "embed", take("model.embed_tokens.weight", res)))
        new.append((self, "norm", take("model.norm.weight", res)))
        # Tied or not is decided by the first load; an update keeps it (a tied model's
        # state dict may carry lm_head.weight, equal to the embeddings: it is ignored).
        if self._tied is None:
            self._tied = c.tie_word_embeddings or "lm_head.weight" not in tensors
        tied = self._tied
        if not tied:
            new.append((self, "lm_head", take("lm_head.weight")))
        elif res != self.dtype:  # the output layer's own copy, in the matmuls' dtype
            new.append((self, "lm_head", take("model.embed_tokens.weight")))
        # Check every shape before changing anything: a refused update leaves the model whole.
        for owner, name, value in new:
            old = getattr(owner, name, None)
            if isinstance(old, torch.Tensor) and old.shape != value.shape:
                raise ConfigError(
                    f"weight {name} has shape {tuple(value.shape)}, the model's is "
                    f"{tuple(old.shape)}: an update must keep the architecture"
                )
        # A first load owns its tensors: one still backed by the caller's storage (a
        # safetensors file's mapping, a trainer's parameter) is copied, so the mapping can
        # close and nothing outside the engine changes its weights.
        given = {t.untyped_storage().data_ptr() for t in tensors.values()}
        for owner, name, value in new:
            old = getattr(owner, name, None)
            if isinstance(old, torch.Tensor):
                old.copy_(value)
            elif value.untyped_storage().data_ptr() in given:
                setattr(owner, name, value.clone(memory_format=torch.contiguous_format))
            else:
                setattr(owner, name, value.contiguous())
        if tied and res == self.dtype:
            self.lm_head = self.embed

    def _weight_views(self) -> dict[str, torch.Tensor | None]:
        """Every HF weight name -> the tensor, or the rows of a fused one (q/k/v, gate/up),
        that holds it; ``None`` for a name taken and ignored (a tied model's
        ``lm_head.weight``, equal to the embeddings)."""
        c = self.config
        q, kv, inter = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size
        views: dict[str, torch.Tensor | None] = {}
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            fused = [(layer.qkv, "weight")]
            if layer.qkv_bias is not None:
                fused.append((layer.qkv_bias, "bias"))
            for tensor, kind in fused:
                views[p + f"self_attn.q_proj.{kind}"] = tensor[:q]
                views[p + f"self_attn.k_proj.{kind}"] = tensor[q : q + kv]
                views[p + f"self_attn.v_proj.{kind}"] = tensor[q + kv :]
            views[p + "self_attn.o_proj.weight"] = layer.o
            views[p + "mlp.gate_proj.weight"] = layer.gate_up[:inter]
            views[p + "mlp.up_proj.weight"] = layer.gate_up[inter:]
            views[p + "mlp.down_proj.weight"] = layer.down
            views[p + "input_layernorm.weight"] = layer.ln1
            views[p + "post_attention_layernorm.weight"] = layer.ln2
        views["model.embed_tokens.weight"] = self.embed
        views["model.norm.weight"] = self.norm
        views["lm_head.weight"] = None if self._tied else self.lm_head
        return views

    def weight_shapes(self) -> dict[str, tuple[int, ...]]:
        """The shape of every HF-named weight this model takes (``lm_head.weight`` too)."""
        return {
            name: tuple((self.embed if view is None else view).shape)
            for name, view in self._weight_views().items()
        }

    @torch.inference_mode()
    def update_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Copy some HF-named weights in place (one bucket of a distributed update); the
        others keep their values. Every name and shape is checked before anything changes."""
        if not self.has_weights:
            raise ConfigError(
                "the weights were freed (the engine's memory released on CPU): a partial "
                "update needs them in place; send every weight in one update"
            )
        views = self._weight_views()
        problem = weight_mismatch(
            {name: tuple(value.shape) for name, value in tensors.items()}, self.weight_shapes()
        )
        if problem is not None:
            raise ConfigError(f"{problem}: an update must keep the architecture")
        # Every value converted to its weight's device and dtype first: a value that cannot
        # be (a meta tensor, one on another machine's device) fails before any weight
        # changes, and the copies that follow cannot fail.
        staged: list[tuple[torch.Tensor, torch.Tensor]] = []
        for name, value in tensors.items():
            view = views[name]
            if view is None:
                continue
            if value.device.type == "meta" or value.layout != torch.strided:
                raise ConfigError(
                    f"weight {name} is a {value.device.type} {value.layout} tensor without "
                    "values; send dense tensors that hold memory"
                )
            staged.append((view, value.to(device=view.device, dtype=view.dtype)))
        for view, value in staged:
            view.copy_(value)
        embed = tensors.get("model.embed_tokens.weight")
        if self._tied and embed is not None and self.lm_head is not self.embed:  # two dtypes
            self.lm_head.copy_(embed)

    # -- pieces ----------------------------------------------------------------------------
    def _rope_table(self, length: int) -> None:
        if self._cos.shape[0] >= length:
            return
        length = max(length, 2 * self._cos.shape[0])
        t = torch.arange(length, dtype=torch.float32, device=self.device)
        freqs = torch.outer(t, self._inv_freq)  # one rounded product each, as HF's matmul
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = emb.cos().to(self.residual_dtype)
        self._sin = emb.sin().to(self.residual_dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # In float32, as HF does, then back to the residual stream's dtype.
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.config.rms_norm_eps)
        return w * x32.to(x.dtype)

    @staticmethod
    def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        # The input in the weight's dtype, as autocast casts it (a no-op in one dtype).
        return F.linear(x.to(w.dtype), w, b)

    def _qkv(
        self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h`` [B, T, hidden] -> q [B, H, T, D], k and v [B, KV, T, D] (RoPE applied).
        ``cos``/``sin`` broadcast against [B, T, 1, D]."""
        c = self.config
        b, t, _ = h.shape
        qkv = self._linear(self._rms(h, layer.ln1), layer.qkv, layer.qkv_bias)
        heads = c.num_heads + c.num_kv_heads
        qk = qkv[..., : heads * c.head_dim].view(b, t, heads, c.head_dim)
        half = c.head_dim // 2
        # RoPE on queries and keys at once: x * cos + rotate_half(x) * sin (in the
        # residual dtype, as HF's fp32 cos/sin under autocast), then in the cache's dtype.
        qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
        qk = qk.to(self.dtype)
        q = qk[:, :, : c.num_heads].transpose(1, 2)
        k = qk[:, :, c.num_heads :].transpose(1, 2)
        v = qkv[..., heads * c.head_dim :].view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return q, k, v

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate_up = self._linear(self._rms(h, layer.ln2), layer.gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)

    # -- forward passes --------------------------------------------------------------------
    def _rows(self, n: int) -> int:
        """Rows a matrix multiplication runs with for ``n`` real ones: on CPU at least
        :data:`MIN_ROWS` (below it the BLAS picks other kernels, whose rounding differs),
        so a token's numbers never depend on how many others share its forward."""
        return max(n, MIN_ROWS) if self.device.type == "cpu" else n

    def _attention(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: Visible
    ) -> torch.Tensor:
        """q [S, H, T, D] against keys/values [S, KV, L, D] (positions 0 .. L-1 of each
        sequence; ``L`` a multiple of :data:`KEY_BLOCK`); query ``t`` of sequence ``s``
        sees the keys at positions <= its own (``visible``). Returns [S, H, T, D].

        On CUDA: one masked SDPA. On CPU: an online softmax over key blocks of
        :data:`KEY_BLOCK` positions with at least :data:`MIN_QUERY_ROWS` query rows per
        matrix product, so a query's result is a function of the keys it sees only -- a
        block it cannot see changes nothing, bit for bit (its update multiplies by
        exp(0) = 1 and adds 0) -- whatever the number of queries or the padded length:
        a prompt prefilled whole, or its end on top of a cached prefix, or its tokens
        decoded one at a time give the same keys, values and logits."""
        c = self.config
        s, h, t, d = q.shape
        if self.device.type != "cpu":
            gqa = c.num_heads != c.num_kv_heads
            out: torch.Tensor = F.scaled_dot_product_attention(
                q,
                keys.transpose(0, 1),
                values.transpose(0, 1),
                attn_mask=visible.mask(),
                enable_gqa=gqa,
            )
            return out
        rows = h // c.num_kv_heads * t
        # [KV, S, rows, D], rows: (head, query) -- the keys' batch order.
        qr = (q.reshape(s, c.num_kv_heads, rows, d) * (d**-0.5)).transpose(0, 1).contiguous()
        if rows < MIN_QUERY_ROWS:
            qr = F.pad(qr, (0, 0, 0, MIN_QUERY_ROWS - rows))
        fp32 = torch.float32
        m = total = acc = qr  # bound in the first block
        for j, start in enumerate(range(0, keys.shape[2], KEY_BLOCK)):
            kb = keys[:, :, start : start + KEY_BLOCK]
            vb = values[:, :, start : start + KEY_BLOCK]
            scores = torch.matmul(qr, kb.transpose(-1, -2)).to(fp32) + visible.bias(start)
            if j == 0:
                m = scores.amax(-1, keepdim=True)
                p = torch.exp(scores - m)
                total = p.sum(-1, keepdim=True)
                acc = torch.matmul(p.to(vb.dtype), vb).to(fp32)
                continue
            m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
            alpha = torch.exp(m - m_new)
            p = torch.exp(scores - m_new)
            total = total * alpha + p.sum(-1, keepdim=True)
            acc = acc * alpha + torch.matmul(p.to(vb.dtype), vb).to(fp32)
            m = m_new
        out = (acc / total).to(q.dtype)[:, :, :rows].transpose(0, 1)
        result: torch.Tensor = out.reshape(s, h, t, d)
        return result

    @staticmethod
    def _write(pool: KVPool, li: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Layer ``li``'s keys and values ``kv`` [2 * KV, N, D] (the keys' heads, then the
        values') into pool ``slots`` [N]."""
        layer = pool.kv[li]
        layer.view(-1, layer.shape[2], layer.shape[3]).index_copy_(1, slots, kv)

    @staticmethod
    def _gather(pool: KVPool, li: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``li``'s keys and values at pool slots ``index`` [S, L]: [KV, S, L, D]
        each, contiguous (one gather for both; a key block of every sequence is then one
        strided batch of matrices, which the matrix products read in place)."""
        layer = pool.kv[li]  # [2, KV, slots, D]
        two, heads, size, d = layer.shape
        s, length = index.shape
        kv = layer.view(two * heads, size, d).index_select(1, index.reshape(-1))
        kv = kv.view(two, heads, s, length, d)
        return kv[0], kv[1]

    def _logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and output layer on rows [n, hidden] -> [n, V] float32."""
        n = h.shape[0]
        h = _pad_rows(h, self._rows(n))
        return self._linear(self._rms(h, self.norm), self.lm_head).float()[:n]

    @torch.inference_mode()
    def prefill(self, seqs: list[Prefill], pool: KVPool) -> torch.Tensor:
        """Compute the keys and values of each sequence's new tokens on top of its cached
        start (one forward for all, the tokens packed), writing them to the pool slots of
        its table row; return each sequence's last logits [len(seqs), V] in float32.

        Each sequence's table row must already hold the slots of its positions
        ``0 .. start + len(tokens) - 1`` (the cached ones and those for the new tokens)."""
        c = self.config
        dev = self.device
        n = sum(len(x.tokens) for x in seqs)
        rows = self._rows(n)
        ids_l: list[int] = []
        pos_l: list[int] = []
        for x in seqs:
            ids_l += x.tokens
            pos_l += range(x.start, x.start + len(x.tokens))
        pad = rows - n
        table_rows = torch.tensor([x.row for x in seqs], device=dev)
        counts = [len(x.tokens) for x in seqs]
        owner = torch.repeat_interleave(table_rows, torch.tensor(counts, device=dev))
        ids = torch.tensor(ids_l + [0] * pad, device=dev)
        pos = torch.tensor(pos_l + [0] * pad, device=dev)
        slots = _pad_rows(pool.table[owner, pos[:n]], rows)
        # Each sequence's queries, padded to the longest [S, T]: indices into the packed rows.
        t = max(counts)
        s = len(seqs)
        offsets = torch.tensor([0, *itertools.accumulate(counts)][:-1], device=dev)
        steps = torch.arange(t, device=dev)
        valid = steps.view(1, t) < torch.tensor(counts, device=dev).view(s, 1)
        packed = torch.where(valid, offsets.view(s, 1) + steps.view(1, t), n if pad else 0)
        qpos = pos[packed]
        # Back from [S, T] to the packed rows.
        back = torch.arange(s, device=dev).repeat_interleave(
            torch.tensor(counts, device=dev)
        ) * t + torch.cat([torch.arange(k, device=dev) for k in counts])
        ends = [x.start + len(x.tokens) for x in seqs]
        length = round_up(max(ends), KEY_BLOCK)
        index = pool.table[table_rows, :length]
        self._rope_table(max(ends))
        cos = self._cos[pos].view(1, rows, 1, -1)
        sin = self._sin[pos].view(1, rows, 1, -1)
        h = self.embed[ids].unsqueeze(0)  # [1, rows, hidden]
        visible = Visible(qpos, length, c.num_heads // c.num_kv_heads, self.device.type == "cpu")
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)  # q [1, H, rows, D], k/v [1, KV, rows, D]
            self._write(pool, li, slots, torch.cat([k[0], v[0]]))
            keys, values = self._gather(pool, li, index)
            qs = q[0].transpose(0, 1)[packed].permute(0, 2, 1, 3)  # [S, H, T, D]
            out = self._attention(qs, keys, values, visible)
            flat = out.permute(0, 2, 1, 3).reshape(s * t, c.num_heads * c.head_dim)[back]
            h = h + F.linear(_pad_rows(flat, rows), layer.o).unsqueeze(0)
            h = h + self._mlp(layer, h)
        last = torch.tensor(list(itertools.accumulate(counts)), device=dev) - 1
        return self._logits(h[0, last])

    def _decode(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        pool: KVPool,
        length: int,
        live: int | None = None,
    ) -> torch.Tensor:
        """The decode forward on tensors (also what a CUDA graph captures): one token per
        table row ``0 .. B-1`` at ``positions``, its keys and values written to ``slots``,
        attending to the first ``length`` table columns (a multiple of KEY_BLOCK). Rows
        from ``live`` on (default: none) are padding for the linear layers' row count
        (:meth:`_rows`): they attend to nothing (their attention output is zeros)."""
        b = ids.shape[0]
        n = b if live is None else live
        cos = self._cos[positions].view(b, 1, 1, -1)
        sin = self._sin[positions].view(b, 1, 1, -1)
        h = self.embed[ids].unsqueeze(1)  # [B, 1, hidden]
        index = pool.table[:n, :length]
        c = self.config
        group = c.num_heads // c.num_kv_heads
        visible = Visible(positions[:n].view(n, 1), length, group, self.device.type == "cpu")
        width = c.num_heads * c.head_dim
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            self._write(pool, li, slots, torch.cat([k, v], dim=1)[:, :, 0].transpose(0, 1))
            keys, values = self._gather(pool, li, index)
            out = self._attention(q[:n], keys, values, visible).reshape(n, width)
            h = h + F.linear(_pad_rows(out, b), layer.o).unsqueeze(1)
            h = h + self._mlp(layer, h)
        return self._linear(self._rms(h[:, 0], self.norm), self.lm_head).float()

    @torch.inference_mode()
    def decode(
        self, ids: list[int], positions: list[int], slots: list[int], pool: KVPool
    ) -> torch.Tensor:
        """One token for each table row ``0 .. len(ids)-1``, at ``positions``, its keys and
        values into pool ``slots``; returns logits [B, V] in float32 (through a captured
        CUDA graph when one is enabled)."""
        longest = max(positions) + 1
        self._rope_table(longest)
        if self.graphs is not None:
            return self.graphs.decode(ids, positions, slots, pool)
        n = len(ids)
        pad = self._rows(n) - n
        dev = self.device
        tokens = torch.tensor(ids + [0] * pad, device=dev)
        pos = torch.tensor(positions + [0] * pad, device=dev)
        where = torch.tensor(slots + [0] * pad, device=dev)
        length = round_up(longest, KEY_BLOCK)
        return self._decode(tokens, pos, where, pool, length, live=n)[:n]


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with rows of zeros appended up to ``rows`` rows (itself when it has them)."""
    if x.shape[0] >= rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0], *x.shape[1:]))])


#: safetensors' dtype names -> torch's.
_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip
MAX_SAFETENSORS_HEADER = 100 << 20  # bytes of JSON header (safetensors' own limit)


def read_safetensors(
    directory: str | Path, shapes: Mapping[str, tuple[int, ...]] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of ``directory``'s ``*.safetensors`` files, read into memory of this
    process: every file is opened only if it is a regular file (a FIFO or device is
    refused, never waited on), its header is checked whole (dtypes, shapes, offsets inside
    the file) before any data is read, and the data is read with ``pread``, never mapped
    (a file cut short meanwhile is refused, not a fault). With ``shapes`` (a loaded
    model's weights), only those names are read, and each must have its shape.
    Raises :class:`ConfigError` naming the file and the problem."""
    from agentenv.engine._ipc import open_regular, read_bytes

    directory = Path(directory)
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"{str(directory)!r} has no *.safetensors weights")
    plan: list[tuple[Path, list[tuple[str, torch.dtype, tuple[int, ...], int, int]]]] = []
    for file in files:  # every header first: nothing is read from a set that is refused
        fd = open_regular(str(file))
        try:
            plan.append((file, _safetensors_header(fd, file, shapes)))
        finally:
            os.close(fd)
    tensors: dict[str, torch.Tensor] = {}
    for file, entries in plan:
        fd = open_regular(str(file))
        try:
            for name, dtype, shape, start, nbytes in entries:
                data = read_bytes(fd, start, nbytes, f"{file}'s tensor {name!r}")
                tensors[name] = data.view(dtype).reshape(shape)
        finally:
            os.close(fd)
    return tensors


def _safetensors_header(
    fd: int, file: Path, shapes: Mapping[str, tuple[int, ...]] | None
) -> list[tuple[str, torch.dtype, tuple[int, ...], int, int]]:
    """``file``'s tensors to read: (name, dtype, shape, first byte, bytes), checked."""
    size = os.fstat(fd).st_size
    head = os.pread(fd, 8, 0)
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < n <= min(MAX_SAFETENSORS_HEADER, size - 8):
        raise ConfigError(f"{file} is not a safetensors file (header of {n} bytes, file {size})")
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw) if len(raw) == n else None
    except (ValueError, RecursionError):
        header = None
    if not isinstance(header, dict):
        raise ConfigError(f"{file} is not a safetensors file (its header is not a JSON object)")
    base = 8 + n
    out = []
    for name, entry in header.items():
        if name == "__metadata__" or (shapes is not None and name not in shapes):
            continue  # not a weight this model takes (e.g. a rotary table): not read
        what = f"{file}'s tensor {name!r}"
        ok = isinstance(entry, dict)
        dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype")) if ok else None
        shape, offsets = (entry.get("shape"), entry.get("data_offsets")) if ok else (None, None)
        if not (
            isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(type(o) is int and o >= 0 for o in offsets)
        ):
            raise ConfigError(f"{what} has a malformed entry: {str(entry)[:200]}")
        if dtype is None:
            raise ConfigError(
                f"{what} has dtype {entry['dtype']!r}; this engine reads "
                f"{', '.join(_SAFETENSORS_DTYPES)}"
            )
        begin, end = offsets
        nbytes = math.prod(shape) * dtype.itemsize
        if end - begin != nbytes or base + end > size:
            raise ConfigError(
                f"{what} ({entry['dtype']} {shape}) claims bytes {begin}..{end} of a data "
                f"section of {size - base}: the file is corrupt or cut short"
            )
        if shapes is not None and tuple(shape) != shapes[name]:
            raise ConfigError(
                f"{what} has shape {tuple(shape)}, the model's is {shapes[name]}: an update "
                "must keep the architecture"
            )
        out.append((name, dtype, tuple(shape), base + begin, nbytes))
    return out


def weight_mismatch(
    shapes: Mapping[str, tuple[int, ...]], model: Mapping[str, tuple[int, ...]]
) -> str | None:
    """Why HF-named weights of ``shapes`` do not fit a model whose weights have the shapes
    ``model`` (the first problem), or None."""
    for name, shape in shapes.items():
        if name not in model:
            return (
                f"the model has no weight {name!r} (expected HF names such as "
                "'model.layers.0.self_attn.q_proj.weight')"
            )
        if shape != model[name]:
            return f"weight {name} has shape {shape}, the model's is {model[name]}"
    return None
