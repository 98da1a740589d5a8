"""The megatron-core training backend: an HF Llama/Qwen2 model converted into megatron's
``GPTModel`` and trained with the shared GRPO step (:class:`trainer.Backend`).

    backend = MegatronBackend("path/to/hf", optim=OptimConfig(lr=1e-6))
    metrics = backend.train_step(samples, advantages)

Per micro-batch (packed by the token budget), the padded batch runs through the model
(causal attention, right padding), the response positions' vocab-parallel logits give the
log-probs (padding columns masked, fp32), and the shared loss and backward follow. The
trainer's new weights leave as HF tensors (:meth:`state_dict`, for the embedded engine) or
an HF safetensors directory (:meth:`save_hf`, for ``/update_weights_from_disk``).

Layout: one process, tensor and pipeline parallel size 1 (megatron's parallel state is
set up here when the caller has not). The parallelism flags parse and the weights convert
for larger layouts (:func:`parse_megatron_flags`, :func:`hf_to_megatron`); the training
step for them (gradient reduction across ranks, pipeline schedules) is not built yet and
is refused with an error that says so.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from agentenv import ConfigError
from trainer._backend import Backend, Item, OptimConfig, pad, response_positions
from trainer._files import free_port
from trainer._losses import LossConfig
from trainer.megatron._config import MegatronModelConfig
from trainer.megatron._convert import hf_to_megatron, megatron_to_hf
from trainer.megatron._export import export_hf, load_hf_weights
from trainer.megatron._flags import ParallelConfig
from trainer.megatron._logprobs import vocab_parallel_logprobs
from trainer.megatron._provider import load_weights, model_provider, require_megatron

__all__ = ["MegatronBackend"]


def _init_distributed(core: Any, parallel: ParallelConfig, seed: int) -> None:
    """torch.distributed and megatron's parallel state for this layout, unless set up."""
    import torch.distributed as dist

    if not dist.is_initialized():
        if "MASTER_PORT" not in os.environ:  # a single process started without torchrun
            os.environ["MASTER_PORT"] = str(free_port())
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        dist.init_process_group(
            "nccl",
            rank=int(os.environ.get("RANK", "0")),
            world_size=int(os.environ.get("WORLD_SIZE", "1")),
            device_id=torch.device("cuda", torch.cuda.current_device()),
        )
    if not core.parallel_state.model_parallel_is_initialized():
        core.parallel_state.initialize_model_parallel(
            parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        )
    core.tensor_parallel.model_parallel_cuda_manual_seed(seed)


class MegatronBackend(Backend):
    """Trains a Llama- or Qwen2-architecture HF model on megatron-core (CUDA only).

    Args:
        model: a model name (``smollm2-135m``) or an HF directory.
        device: ``cuda`` or ``cuda:N``.
        dtype: parameter dtype, bfloat16 (default) or float32.
        optim: optimizer settings.
        loss: loss settings; ``kl_coef > 0`` loads a frozen reference copy.
        max_tokens_per_micro_batch: the packing budget (prompt and completion tokens).
        parallel: megatron's parallelism flags (:func:`parse_megatron_flags`).
        entropy_metric: report the per-token entropy.
        seed: megatron's model-parallel RNG seed.
        attention: ``sdpa`` (torch's fused kernels in megatron's layer spec) or ``local``
            (megatron's own unfused attention).
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = "smollm2-135m",
        *,
        device: str = "cuda",
        dtype: torch.dtype = torch.bfloat16,
        optim: OptimConfig | None = None,
        loss: LossConfig | None = None,
        max_tokens_per_micro_batch: int = 4096,
        parallel: ParallelConfig | None = None,
        entropy_metric: bool = True,
        seed: int = 0,
        attention: str = "sdpa",
    ) -> None:
        from agentenv.engine import resolve_model

        core = require_megatron()
        if not device.startswith("cuda") or not torch.cuda.is_available():
            raise ConfigError(
                f"the megatron backend needs a CUDA device (megatron-core does not run on "
                f"CPU), got device {device!r}; use the torch backend there"
            )
        if dtype not in (torch.bfloat16, torch.float32):
            raise ConfigError(f"dtype must be torch.bfloat16 or torch.float32, got {dtype}")
        parallel = parallel or ParallelConfig()
        self.attention = attention
        if parallel.model_parallel_size > 1:
            raise ConfigError(
                f"the megatron training step runs tensor and pipeline parallel size 1 for "
                f"now (got TP {parallel.tensor_model_parallel_size}, PP "
                f"{parallel.pipeline_model_parallel_size}); larger layouts convert and "
                "parse, but their gradient reduction is not built yet"
            )
        self.device = torch.device(device)
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(self.device)
        self.dtype = dtype
        self.path = resolve_model(model)
        self.parallel = parallel
        _init_distributed(core, parallel, seed)
        self.tp_rank = int(core.parallel_state.get_tensor_model_parallel_rank())
        self.cfg: MegatronModelConfig = parallel.model_config(self.path)
        self.model = self._build(train=True)
        self.reference: Any = None
        if loss is not None and loss.kl_coef > 0:
            self.reference = self._build(train=False)
        self._configure(optim, loss, max_tokens_per_micro_batch, entropy_metric)
        self._make_optimizer()

    def _build(self, *, train: bool) -> Any:
        overrides = dict(
            bf16=self.dtype == torch.bfloat16,
            params_dtype=self.dtype,
            **self.parallel.transformer_config_overrides(),
        )
        with warnings.catch_warnings():  # megatron's notices about optional packages
            warnings.simplefilter("ignore")
            model = model_provider(self.cfg, attention=self.attention, **overrides)()
        model = model.to(self.device)
        hf = load_hf_weights(self.path)
        load_weights(model, hf_to_megatron(hf, self.cfg, tp_rank=self.tp_rank))
        if not train:
            return model.eval().requires_grad_(False)
        return model.train()

    # -- forward -------------------------------------------------------------------------
    def _forward(
        self, batch: Sequence[Item], *, with_entropy: bool, model: Any = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        model = model if model is not None else self.model
        ids, _ = pad(batch)  # right padding: causal attention ignores it
        ids = ids.to(self.device)
        positions = torch.arange(ids.shape[1], device=self.device).expand(len(batch), -1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            logits = model(ids, positions, attention_mask=None)  # [b, s, Vp / tp]
        rows, cols, target, sizes = response_positions(batch)
        picked = logits[rows.to(self.device), cols.to(self.device)]
        target = target.to(self.device)
        logp = vocab_parallel_logprobs(
            picked, target, vocab_size=self.cfg.vocab_size, tp_rank=self.tp_rank
        )
        entropy = None
        if with_entropy:
            # TP 1: this rank holds the whole vocabulary; the padding columns are the last.
            grad = self.loss_config.entropy_coef > 0 and torch.is_grad_enabled()
            with torch.set_grad_enabled(grad):
                real = picked[:, : self.cfg.vocab_size].float()
                logz = torch.logsumexp(real, dim=-1)
                ent = logz - (torch.softmax(real, dim=-1) * real).sum(-1)
            entropy = list(torch.split(ent, sizes))
        return list(torch.split(logp, sizes)), entropy

    # -- weights out ------------------------------------------------------------------------
    def _megatron_state(self) -> dict[str, torch.Tensor]:
        return {
            k: v.detach()
            for k, v in self.model.state_dict().items()
            if isinstance(v, torch.Tensor) and not k.endswith("_extra_state")
        }

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named weights, merged from megatron's layout (vocabulary padding stripped)."""
        return megatron_to_hf([[self._megatron_state()]], self.cfg)

    def save_hf(self, directory: str | os.PathLike[str]) -> None:
        export_hf(directory, [[self._megatron_state()]], self.cfg, dtype=self.dtype)

    # -- checkpoints ----------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        return {
            "backend": "megatron",
            "architecture": self.cfg.architecture,
            "vocab_size": self.cfg.vocab_size,
            "hidden_size": self.cfg.hidden_size,
            "num_layers": self.cfg.num_layers,
            "tensor_model_parallel_size": self.cfg.tensor_model_parallel_size,
        }

    def save_checkpoint(self, directory: str | os.PathLike[str], extra: dict[str, Any]) -> None:
        """The model in megatron's layout, the optimizer, RNG states and ``extra``."""
        from trainer._files import replace_dir

        with replace_dir(directory) as tmp:
            torch.save(self._megatron_state(), tmp / "model.pt")
            torch.save(self._trainer_state(), tmp / "trainer_state.pt")
            (tmp / "checkpoint.json").write_text(
                json.dumps({"model": self._identity(), "extra": extra}, indent=1)
            )

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        root = Path(directory)
        try:
            meta = json.loads((root / "checkpoint.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{str(root)!r} is not a trainer checkpoint: {e}") from None
        if meta.get("model") != self._identity():
            raise ConfigError(
                f"checkpoint {str(root)!r} is from another model or layout "
                f"(checkpoint: {meta.get('model')}, this: {self._identity()})"
            )
        load_weights(self.model, torch.load(root / "model.pt", map_location=self.device))
        self._load_trainer_state(torch.load(root / "trainer_state.pt", weights_only=False))
        extra: dict[str, Any] = meta.get("extra", {})
        return extra
