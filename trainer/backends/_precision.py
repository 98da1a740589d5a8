"""The torch backend's numerics (``TorchBackend(precision=...)``, ``agentenv train
--precision``; docs/trainer.md, "Precision"): the trained weights' dtype, the matrix
multiplications', and what the rollout engine runs to sample from the same. ``fp32`` (the
CPU default); ``bf16-autocast``, fp32 weights under ``torch.autocast`` with no master
copies, as Hugging Face's Trainer and TRL do (the CUDA default); ``bf16``, bf16 weights
with fp32 master copies for the optimizer.
"""

from __future__ import annotations

import dataclasses

import torch

from agentenv import ConfigError
from trainer.config import default_precision

__all__ = ["PRECISIONS", "Precision", "resolve_precision"]

PRECISIONS: tuple[str, ...] = ("fp32", "bf16-autocast", "bf16")


@dataclasses.dataclass(frozen=True, slots=True)
class Precision:
    """One of :data:`PRECISIONS`, as dtypes.

    Attributes:
        name: ``fp32``, ``bf16-autocast`` or ``bf16``.
        weights: the trained parameters' dtype.
        compute: the matrix multiplications' dtype (the output layer's logits too).
        master: fp32 master copies of the weights for the optimizer.
    """

    name: str
    weights: torch.dtype
    compute: torch.dtype
    master: bool

    @property
    def autocast(self) -> bool:
        """Whether the forward runs under ``torch.autocast`` (fp32 weights, bf16 compute)."""
        return self.weights != self.compute

    def engine_dtypes(self) -> tuple[torch.dtype, torch.dtype]:
        """``(dtype, residual_dtype)`` for :class:`agentenv.engine.Engine`: the engine's
        matrix multiplications and KV cache, and its embeddings, norms and residual stream
        -- the numerics the trainer computes its log-probs with."""
        residual = torch.float32 if self.autocast else self.weights
        return self.compute, residual


def resolve_precision(name: str | None, device: torch.device) -> Precision:
    """``name`` (default: ``bf16-autocast`` on CUDA, ``fp32`` elsewhere) as a
    :class:`Precision`."""
    name = default_precision(name, device)
    if name == "fp32":
        return Precision(name, torch.float32, torch.float32, master=False)
    if name == "bf16-autocast":
        return Precision(name, torch.float32, torch.bfloat16, master=False)
    if name == "bf16":
        return Precision(name, torch.bfloat16, torch.bfloat16, master=True)
    raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {name!r}")
