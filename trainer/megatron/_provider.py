"""megatron-core's ``TransformerConfig``, layer spec and ``GPTModel`` from a
:class:`MegatronModelConfig`. megatron is imported here, lazily, and only here.

Building a model needs megatron's parallel state (``initialize_model_parallel``) and its
CUDA RNG tracker (``model_parallel_cuda_manual_seed``) set up first; megatron-core does
not run on CPU.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from trainer.megatron._config import MegatronModelConfig, TransformerImpl
from trainer.megatron._errors import MegatronNotInstalledError, WeightShapeError

__all__ = [
    "default_transformer_impl",
    "layer_spec",
    "load_weights",
    "model_provider",
    "require_megatron",
    "transformer_config",
]


def require_megatron(module: str = "megatron.core") -> Any:
    """A megatron module (``megatron.core`` by default), imported now, or
    :class:`MegatronNotInstalledError` naming the extra to install.

    Imported by name so that type checking does not need megatron (it has no type hints).
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MegatronNotInstalledError(e) from e


def default_transformer_impl() -> TransformerImpl:
    """``transformer_engine`` where Transformer Engine imports, else ``local``."""
    try:
        importlib.import_module("transformer_engine.pytorch")
    except Exception:  # TE fails in many ways besides ImportError (CUDA, ABI)
        return "local"
    return "transformer_engine"


def transformer_config(cfg: MegatronModelConfig, **overrides: Any) -> Any:
    """megatron's ``TransformerConfig`` for ``cfg``; ``overrides`` as in
    :meth:`MegatronModelConfig.transformer_config_kwargs`."""
    transformer = require_megatron("megatron.core.transformer")
    return transformer.TransformerConfig(**cfg.transformer_config_kwargs(**overrides))


def layer_spec(cfg: MegatronModelConfig, *, attention: str = "local") -> Any:
    """The decoder layer's ``ModuleSpec``: megatron's own modules for ``local``
    (RMSNorm as a separate module), Transformer Engine's fused ones otherwise. With
    ``attention="sdpa"`` the local spec's core attention is :class:`SDPAttention` (torch's
    fused kernels) instead of megatron's unfused one."""
    gpt_layer_specs = require_megatron("megatron.core.models.gpt.gpt_layer_specs")
    if cfg.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec()
    spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization="RMSNorm")
    if attention == "sdpa":
        from trainer.megatron._attention import SDPAttention

        spec.submodules.self_attention.submodules.core_attention = SDPAttention
    elif attention != "local":
        raise ValueError(f"attention must be 'local' or 'sdpa', got {attention!r}")
    return spec


def model_provider(
    cfg: MegatronModelConfig, *, attention: str = "local", **overrides: Any
) -> Callable[..., Any]:
    """A model provider in megatron's convention: ``provider(pre_process=True,
    post_process=True, vp_stage=None)`` builds this rank's ``GPTModel`` (call it after
    ``parallel_state.initialize_model_parallel``: the model uses its process groups).

    ``overrides`` go to ``TransformerConfig`` (e.g. ``bf16=True``,
    ``params_dtype=torch.bfloat16``, ``sequence_parallel=True``). megatron-core is
    imported now, so a missing install fails here rather than inside a training job.
    """
    gpt = require_megatron("megatron.core.models.gpt")
    config = transformer_config(cfg, **overrides)
    spec = layer_spec(cfg, attention=attention)

    groups = require_megatron("megatron.core.process_groups_config")

    def provide(
        pre_process: bool = True, post_process: bool = True, vp_stage: int | None = None
    ) -> Any:
        return gpt.GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vp_stage=vp_stage,
            # Explicit process groups (those of megatron's parallel state): megatron
            # deprecates falling back to the global ones inside each layer.
            pg_collection=groups.ProcessGroupCollection.use_mpu_process_groups(),
            **cfg.gpt_model_kwargs(pre_process=pre_process, post_process=post_process),
        )

    return provide


def load_weights(model: Any, state: Mapping[str, torch.Tensor]) -> None:
    """Load a converted state dict (:func:`trainer.megatron.hf_to_megatron`) into this
    rank's ``GPTModel``: every name and shape must match exactly.

    megatron's linear layers also carry ``_extra_state`` entries (None, or TE's fp8
    metadata); those are the only keys the converted weights may lack.
    """
    from agentenv import ConfigError

    own = model.state_dict()
    for name, tensor in state.items():
        mine = own.get(name)
        if isinstance(mine, torch.Tensor) and tuple(mine.shape) != tuple(tensor.shape):
            raise WeightShapeError(name, tensor.shape, mine.shape, "this rank's GPTModel")
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ConfigError(
            f"the weights do not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}; was the MegatronModelConfig built for this layout?"
        )
