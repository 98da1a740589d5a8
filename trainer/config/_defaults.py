"""The trainer's settings whose default depends on the device, each rule once and free of
torch: the backends resolve them, and ``agentenv train --dry-run`` reports what a run would
use without importing torch."""

from __future__ import annotations

from typing import Any

__all__ = [
    "MICRO_BATCH_TOKENS",
    "default_checkpointing",
    "default_compile",
    "default_micro_batch_tokens",
    "default_precision",
    "device_kind",
]

#: The micro-batch token budget when none is given (``--max-tokens-per-gpu``): a GPU's,
#: and on CPU a quarter of it -- a step's peak memory follows the micro-batch while its
#: time does not (135M parameters, 64 samples: 3.9 GB at 1,024 tokens against 6.7 GB at
#: 4,096, 60 s a step either way; docs/benchmarks.md).
MICRO_BATCH_TOKENS = {"cuda": 4096, "cpu": 1024}


def device_kind(device: Any) -> str:
    """``"cpu"`` or ``"cuda"`` for a device name (``cuda:1``) or a ``torch.device``."""
    return "cpu" if str(device).split(":")[0] == "cpu" else "cuda"


def default_micro_batch_tokens(tokens: int | None, device: Any) -> int:
    """``tokens``, or the default budget of ``device``'s kind (:data:`MICRO_BATCH_TOKENS`)."""
    return MICRO_BATCH_TOKENS[device_kind(device)] if tokens is None else tokens


def default_precision(name: str | None, device: Any) -> str:
    """``name``, by default ``bf16-autocast`` on CUDA and ``fp32`` elsewhere."""
    if name is not None:
        return name
    return "bf16-autocast" if device_kind(device) == "cuda" else "fp32"


def default_checkpointing(gradient_checkpointing: bool | None) -> bool:
    """Whether the torch backend recomputes activations in the backward: by default on
    every device (the step's memory follows one layer's activations)."""
    return True if gradient_checkpointing is None else gradient_checkpointing


def default_compile(compile: bool | None, device: Any) -> bool:
    """Whether the torch backend compiles its decoder layers: by default on CUDA."""
    return device_kind(device) == "cuda" if compile is None else compile
