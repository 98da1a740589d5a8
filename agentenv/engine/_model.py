"""A Llama-family decoder in plain torch, shaped for continuous batching.

Covers the Hugging Face ``LlamaForCausalLM``, ``MistralForCausalLM`` and
``Qwen2ForCausalLM`` layouts (grouped-query attention, RoPE, RMSNorm, SiLU-gated MLP,
optional q/k/v biases, tied or separate output embeddings), loaded from a model directory
(``config.json`` + ``*.safetensors``). It computes exactly what the HF implementation
computes (``tests/engine`` checks logits against ``transformers``), but its forward takes a
*batch of sequences at different positions* against one shared key/value cache:

* :class:`KVCache` holds ``[layers, slots, kv_heads, capacity, head_dim]`` keys and
  values. Running sequences occupy slots ``0 .. n-1`` (kept compact), so a decode step
  attends to a plain slice of the cache -- no gather, no copy.
* :meth:`LlamaModel.prefill` runs one prompt (or the new part of a prompt whose start is
  cached) into a slot; :meth:`LlamaModel.decode` runs one new token for each of the first
  ``n`` slots.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from agentenv._errors import ConfigError

__all__ = ["KVCache", "LlamaModel", "ModelConfig"]

_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


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


class KVCache:
    """Keys and values of up to ``slots`` sequences, ``capacity`` tokens each (grows)."""

    def __init__(
        self, config: ModelConfig, slots: int, capacity: int, dtype: torch.dtype, device: Any
    ) -> None:
        self.config = config
        self.dtype = dtype
        self.device = device
        shape = (config.num_layers, slots, config.num_kv_heads, capacity, config.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)

    @property
    def slots(self) -> int:
        return int(self.k.shape[1])

    @property
    def capacity(self) -> int:
        return int(self.k.shape[3])

    @torch.inference_mode()
    def reserve(self, length: int) -> None:
        """Make room for sequences of ``length`` tokens (doubling, so growth is rare)."""
        if length <= self.capacity:
            return
        new = max(length, 2 * self.capacity)
        pad = new - self.capacity
        self.k = F.pad(self.k, (0, 0, 0, pad))
        self.v = F.pad(self.v, (0, 0, 0, pad))

    @torch.inference_mode()
    def move(self, src: int, dst: int, length: int) -> None:
        """Copy a sequence's first ``length`` positions from slot ``src`` to ``dst``."""
        self.k[:, dst, :, :length] = self.k[:, src, :, :length]
        self.v[:, dst, :, :length] = self.v[:, src, :, :length]


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

    def __init__(self, config: ModelConfig, dtype: torch.dtype, device: Any) -> None:
        self.config = config
        self.dtype = dtype
        self.device = torch.device(device)
        self.layers = [_Layer() for _ in range(config.num_layers)]
        self.embed: torch.Tensor
        self.norm: torch.Tensor
        self.lm_head: torch.Tensor
        half = config.head_dim // 2
        exponents = torch.arange(0, half, dtype=torch.float64, device=self.device) * 2
        self._inv_freq = 1.0 / (config.rope_theta ** (exponents / config.head_dim))
        self._cos = torch.empty(0)
        self._sin = torch.empty(0)
        self._rope_table(1024)

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def load(
        cls, directory: str | Path, *, dtype: torch.dtype = torch.float32, device: Any = "cpu"
    ) -> LlamaModel:
        directory = Path(directory)
        model = cls(ModelConfig.load(directory), dtype, device)
        model.load_weights(directory)
        return model

    def load_weights(self, directory: str | Path) -> None:
        """(Re)load every weight from ``directory``'s safetensors files, in place."""
        from safetensors import safe_open

        directory = Path(directory)
        files = sorted(directory.glob("*.safetensors"))
        if not files:
            raise ConfigError(f"{str(directory)!r} has no *.safetensors weights")
        tensors: dict[str, torch.Tensor] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    tensors[name] = f.get_tensor(name)
        self.set_weights(tensors)

    def set_weights(self, tensors: dict[str, torch.Tensor]) -> None:
        """Install HF-named weights (``model.layers.0.self_attn.q_proj.weight``, ...)."""
        c = self.config

        def take(name: str) -> torch.Tensor:
            try:
                t = tensors[name]
            except KeyError:
                raise ConfigError(f"the weights have no tensor {name!r}") from None
            return t.to(device=self.device, dtype=self.dtype)

        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            layer.qkv = torch.cat(
                [take(p + f"self_attn.{n}_proj.weight") for n in ("q", "k", "v")]
            ).contiguous()
            if c.attention_bias:
                layer.qkv_bias = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
            layer.o = take(p + "self_attn.o_proj.weight").contiguous()
            layer.gate_up = torch.cat(
                [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
            ).contiguous()
            layer.down = take(p + "mlp.down_proj.weight").contiguous()
            layer.ln1 = take(p + "input_layernorm.weight")
            layer.ln2 = take(p + "post_attention_layernorm.weight")
        self.embed = take("model.embed_tokens.weight")
        self.norm = take("model.norm.weight")
        if c.tie_word_embeddings or "lm_head.weight" not in tensors:
            self.lm_head = self.embed
        else:
            self.lm_head = take("lm_head.weight")

    # -- pieces ----------------------------------------------------------------------------
    def _rope_table(self, length: int) -> None:
        if self._cos.shape[0] >= length:
            return
        length = max(length, 2 * self._cos.shape[0])
        t = torch.arange(length, dtype=torch.float64, device=self.device)
        freqs = torch.outer(t, self._inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self._cos = emb.cos().to(self.dtype)
        self._sin = emb.sin().to(self.dtype)

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        # In float32, as HF does, then back to the model's dtype.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)
        return w * x32.to(x.dtype)

    @staticmethod
    def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    def _qkv(
        self, layer: _Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``h`` [B, T, hidden] -> q [B, H, T, D], k and v [B, KV, T, D] (RoPE applied)."""
        c = self.config
        b, t, _ = h.shape
        qkv = F.linear(self._rms(h, layer.ln1), layer.qkv, layer.qkv_bias)
        nq, nkv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
        q = qkv[..., :nq].view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = qkv[..., nq : nq + nkv].view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = qkv[..., nq + nkv :].view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    def _mlp(self, layer: _Layer, h: torch.Tensor) -> torch.Tensor:
        gate_up = F.linear(self._rms(h, layer.ln2), layer.gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, layer.down)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any) -> torch.Tensor:
        # enable_gqa: each group of query heads reads its key/value head in place, instead
        # of copying the cache once per query head.
        gqa = self.config.num_heads != self.config.num_kv_heads
        if isinstance(mask, bool):
            return F.scaled_dot_product_attention(q, k, v, is_causal=mask, enable_gqa=gqa)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    # -- forward passes --------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: list[int], start: int, slot: int, cache: KVCache) -> torch.Tensor:
        """Run ``ids`` (positions ``start ..``) into ``slot``; return the last logits [V]
        in float32. Positions before ``start`` must be in the slot already."""
        c = self.config
        n = len(ids)
        end = start + n
        cache.reserve(end)
        self._rope_table(end)
        cos = self._cos[start:end]
        sin = self._sin[start:end]
        h = self.embed[torch.tensor(ids, device=self.device)].unsqueeze(0)
        if start:
            # Each new token sees the cached prefix and the new tokens before it.
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            cache.k[li, slot, :, start:end] = k[0]
            cache.v[li, slot, :, start:end] = v[0]
            if start:
                keys = cache.k[li, slot : slot + 1, :, :end]
                values = cache.v[li, slot : slot + 1, :, :end]
                out = self._attend(q, keys, values, mask)
            else:
                out = self._attend(q, k, v, True)
            h = h + F.linear(out.transpose(1, 2).reshape(1, n, c.num_heads * c.head_dim), layer.o)
            h = h + self._mlp(layer, h)
        last = self._rms(h[:, -1], self.norm)
        return F.linear(last, self.lm_head)[0].float()

    @torch.inference_mode()
    def decode(self, ids: list[int], positions: list[int], cache: KVCache) -> torch.Tensor:
        """One token per sequence in slots ``0 .. len(ids)-1``, at ``positions``; returns
        logits [B, V] in float32."""
        c = self.config
        b = len(ids)
        longest = max(positions) + 1
        cache.reserve(longest)
        self._rope_table(longest)
        pos = torch.tensor(positions, device=self.device)
        cos = self._cos[pos].unsqueeze(1).unsqueeze(1)  # [B, 1, 1, D]
        sin = self._sin[pos].unsqueeze(1).unsqueeze(1)
        h = self.embed[torch.tensor(ids, device=self.device)].unsqueeze(1)  # [B, 1, hidden]
        # Sequence i sees its own positions 0 .. positions[i].
        mask = (torch.arange(longest, device=self.device).unsqueeze(0) <= pos.unsqueeze(1)).view(
            b, 1, 1, longest
        )
        rows = torch.arange(b, device=self.device)
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, h, cos, sin)
            cache.k[li, rows, :, pos] = k[:, :, 0]
            cache.v[li, rows, :, pos] = v[:, :, 0]
            out = self._attend(q, cache.k[li, :b, :, :longest], cache.v[li, :b, :, :longest], mask)
            h = h + F.linear(out.transpose(1, 2).reshape(b, 1, c.num_heads * c.head_dim), layer.o)
            h = h + self._mlp(layer, h)
        return F.linear(self._rms(h[:, 0], self.norm), self.lm_head).float()

    @torch.inference_mode()
    def logprobs_of(self, ids: list[int]) -> list[float]:
        """Plain forward over ``ids``: ``log p(ids[i] | ids[:i])`` for i >= 1 (a check)."""
        c = self.config
        n = len(ids)
        self._rope_table(n)
        h = self.embed[torch.tensor(ids, device=self.device)].unsqueeze(0)
        for layer in self.layers:
            q, k, v = self._qkv(layer, h, self._cos[:n], self._sin[:n])
            out = self._attend(q, k, v, True)
            h = h + F.linear(out.transpose(1, 2).reshape(1, n, c.num_heads * c.head_dim), layer.o)
            h = h + self._mlp(layer, h)
        logits = F.linear(self._rms(h[0], self.norm), self.lm_head).float()
        lp = torch.log_softmax(logits[:-1], dim=-1)
        target = torch.tensor(ids[1:], device=self.device)
        return lp.gather(1, target.unsqueeze(1)).squeeze(1).tolist()
