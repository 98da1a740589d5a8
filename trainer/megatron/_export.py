"""HF safetensors directories: read an HF checkpoint's weights, and write megatron's back
as one (``config.json`` + ``model.safetensors``, and the source model's tokenizer, chat
template and generation config) that SGLang's ``/update_weights_from_disk`` and
``transformers`` load."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch

from agentenv import ConfigError
from trainer._resources import copy_model_files, replace_dir
from trainer.megatron._config import MegatronModelConfig
from trainer.megatron._convert import hf_weight_shapes, megatron_to_hf

__all__ = ["export_hf", "load_hf_weights", "save_hf_weights"]


def load_hf_weights(directory: str | os.PathLike[str]) -> dict[str, torch.Tensor]:
    """Every tensor of the ``*.safetensors`` files in an HF model directory (on CPU)."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {str(directory)!r}")
    out: dict[str, torch.Tensor] = {}
    for f in files:
        out.update(load_file(str(f)))
    return out


def save_hf_weights(
    directory: str | os.PathLike[str],
    weights: Mapping[str, torch.Tensor],
    cfg: MegatronModelConfig,
    *,
    dtype: torch.dtype | None = None,
    source: str | os.PathLike[str] | None = None,
) -> Path:
    """Write ``weights`` (HF names, as :func:`trainer.megatron.megatron_to_hf` gives them)
    and ``cfg``'s HF config into ``directory``, replacing it atomically: a crash
    mid-write leaves the previous export whole. Returns the directory.

    ``dtype`` converts the floating-point tensors (default: keep theirs). Tied
    embeddings are written once (no ``lm_head.weight``), as HF saves them. ``source``:
    the HF directory the model came from, whose tokenizer, chat template and generation
    config are copied along (:func:`trainer._resources.copy_model_files`).
    """
    from safetensors.torch import save_file

    expected = hf_weight_shapes(cfg)
    missing = [k for k in expected if k not in weights]
    if missing:
        raise ConfigError(f"cannot export: weights lack {missing[:5]}")
    tensors: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name in expected:  # HF order; drops lm_head when tied
        t = weights[name].detach().to("cpu")
        if dtype is not None and t.is_floating_point():
            t = t.to(dtype)
        t = t.contiguous()
        if t.data_ptr() in seen:  # safetensors refuses tensors that share memory
            t = t.clone()
        seen.add(t.data_ptr())
        tensors[name] = t
    hf = dict(cfg.hf_config)
    hf["architectures"] = [cfg.architecture]
    if dtype is not None:
        hf["dtype"] = str(dtype).removeprefix("torch.")
        if "torch_dtype" in hf:
            hf["torch_dtype"] = hf["dtype"]
    with replace_dir(directory) as tmp:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
        if source is not None:
            copy_model_files(source, tmp)
    return Path(directory)


def export_hf(
    directory: str | os.PathLike[str],
    shards: Sequence[Sequence[Mapping[str, torch.Tensor]]],
    cfg: MegatronModelConfig,
    *,
    dtype: torch.dtype | None = None,
    source: str | os.PathLike[str] | None = None,
) -> Path:
    """Merge every rank's GPTModel state dict (``[pp_rank][tp_rank]``) into HF weights,
    vocabulary padding stripped, and write them as an HF directory
    (:func:`save_hf_weights`, ``source``'s tokenizer files along). Returns the
    directory."""
    return save_hf_weights(directory, megatron_to_hf(shards, cfg), cfg, dtype=dtype, source=source)
