"""The torch backend: any Hugging Face causal LM trained with the GRPO loss on one device
(docs/trainer.md, "Torch backend"), in one of :data:`~trainer.PRECISIONS`.

:class:`~trainer.backends._backend.MicroBatchBackend` runs the step; for each micro-batch
this backend runs the decoder, then the output layer on the response tokens *in chunks*,
chosen by the dtype the output layer computes in: fp32 under activation checkpointing, or
bf16 through a custom autograd function that keeps the logits in bf16 and does the fp32
log-softmax and its gradient a chunk at a time. Log-probs and entropies are of
``softmax(logits / temperature)``, the rollout's sampling distribution."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint

from agentenv import ConfigError
from trainer.algorithm import tempered_logits
from trainer.backends._backend import (
    Item,
    MicroBatchBackend,
    pad,
    response_positions,
)
from trainer.backends._precision import Precision, resolve_precision
from trainer.config import (
    LossConfig,
    OptimConfig,
    default_checkpointing,
    default_compile,
    default_micro_batch_tokens,
)

__all__ = ["TorchBackend"]


class TorchBackend(MicroBatchBackend):
    """Trains an HF causal LM with the GRPO loss.

    Args:
        model: a model name (``smollm2-135m``) or an HF directory.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        precision: ``fp32``, ``bf16-autocast`` (fp32 weights, bf16 matrix multiplications
            under ``torch.autocast``) or ``bf16`` (bf16 weights with fp32 master copies);
            default ``bf16-autocast`` on CUDA, ``fp32`` on CPU (see ``docs/trainer.md``).
        optim: AdamW settings.
        loss: loss settings.
        max_tokens_per_micro_batch: the packing budget (prompt and completion tokens);
            default 4096 on CUDA, 1024 on CPU
            (:data:`~trainer.config._defaults.MICRO_BATCH_TOKENS`).
        logit_chunk: tokens whose full-vocabulary logits exist at once; default 1024 on
            CUDA, 256 on CPU (a chunk of SmolLM2's logits is then 50 MB, and the chunks
            cost no measurable time there).
        entropy_metric: report the policy's per-token entropy (one more pass over each
            chunk's logits); always computed when the loss has an entropy bonus.
        master_weights: with ``bf16``, keep fp32 copies of the weights for the optimizer
            (default: yes). Without them, bf16 weights lose every update smaller than half
            their spacing -- most updates at RL learning rates.
        background_checkpoints: snapshot a checkpoint's state to host memory and write it
            while training goes on (default: on CUDA; on CPU the snapshot would be a second
            copy of the model and optimizer in the memory the step uses, with no device
            work to overlap).
        gradient_checkpointing: recompute each decoder layer in the backward (Hugging
            Face's non-reentrant checkpointing): activation memory falls to one layer's.
            Default: on (docs/trainer.md has its cost on CPU and CUDA).
        compile: compile each decoder layer with ``torch.compile`` (dynamic shapes;
            micro-batches are padded to a multiple of 8 tokens, so new lengths do not
            recompile), fusing the norms, rotary embedding and SwiGLU; the first steps pay
            the compilation. Default: on CUDA, off on CPU.
    """

    precision: Precision

    def __init__(
        self,
        model: str | os.PathLike[str] = "smollm2-135m",
        *,
        device: str = "cpu",
        precision: str | None = None,
        optim: OptimConfig | None = None,
        loss: LossConfig | None = None,
        max_tokens_per_micro_batch: int | None = None,
        logit_chunk: int | None = None,
        entropy_metric: bool = True,
        master_weights: bool | None = None,
        gradient_checkpointing: bool | None = None,
        background_checkpoints: bool | None = None,
        compile: bool | None = None,
    ) -> None:
        from transformers import AutoModelForCausalLM

        from agentenv.engine import resolve_model

        self.device = torch.device(device)
        self.precision = resolve_precision(precision, self.device)
        self.dtype = self.precision.weights
        self.compute_dtype = self.precision.compute
        if master_weights and not self.precision.master:
            raise ConfigError(
                f"master_weights is for bf16 weights; precision {self.precision.name!r} "
                "trains fp32 weights already (use precision='bf16')"
            )
        self.path = resolve_model(model)
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=self.dtype, attn_implementation="sdpa"
        )
        self.model: Any = loaded.to(self.device)
        self.model.train()
        on_gpu = self.device.type == "cuda"
        gradient_checkpointing = default_checkpointing(gradient_checkpointing)
        self.gradient_checkpointing = gradient_checkpointing
        self.compile = default_compile(compile, self.device)
        self.background_checkpoints = (
            self.device.type == "cuda" if background_checkpoints is None else background_checkpoints
        )
        if gradient_checkpointing:
            self.model.activation_checkpointing_enable(
                activation_checkpointing_kwargs={"use_reentrant": False}
            )
        if self.compile:
            if not on_gpu:
                raise ConfigError(f"compile needs a CUDA device, not {device!r}")
            for layer in self.model.get_decoder().layers:
                layer.compile(dynamic=True)
            # Tracing a checkpointed layer, dynamo reads .grad of non-leaf tensors and torch
            # warns about it: nothing of the user's is wrong, and under -W error (pytest's
            # filterwarnings) the warning would fail the trace itself.
            warnings.filterwarnings(
                "ignore",
                message=r"The \.grad attribute of a Tensor that is not a leaf Tensor",
                category=UserWarning,
            )
        self.reference: Any = None
        if loss is not None and loss.kl_coef > 0:
            # A frozen copy of the starting weights for the KL penalty.
            ref: Any = AutoModelForCausalLM.from_pretrained(
                self.path, dtype=self.dtype, attn_implementation="sdpa"
            )
            self.reference = ref.to(self.device).eval().requires_grad_(False)
        tokens = default_micro_batch_tokens(max_tokens_per_micro_batch, self.device)
        self._configure(optim, loss, tokens, entropy_metric)
        self.logit_chunk = logit_chunk or (1024 if on_gpu else 256)
        if master_weights is None:
            master_weights = self.precision.master
        self._make_optimizer(master_weights=master_weights)

    # -- forward -------------------------------------------------------------------------
    def _forward(
        self,
        batch: Sequence[Item],
        *,
        with_entropy: bool,
        model: Any = None,
        temperature: float = 1.0,
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per item: log-probs of its completion tokens (and their entropies); under bf16
        autocast for ``bf16-autocast`` (the forward only: the backward replays the dtypes
        autograd recorded)."""
        if self.precision.autocast:
            with torch.autocast(self.device.type, dtype=self.compute_dtype):
                return self._forward_in(batch, with_entropy, model, temperature)
        return self._forward_in(batch, with_entropy, model, temperature)

    def _forward_in(
        self, batch: Sequence[Item], with_entropy: bool, model: Any, temperature: float
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        model = model if model is not None else self.model
        ids, attention = pad(batch, multiple=8 if self.compile else 1)
        hidden = model.get_decoder()(  # no KV cache: nothing is generated here
            input_ids=ids.to(self.device), attention_mask=attention.to(self.device), use_cache=False
        ).last_hidden_state
        rows, cols, target, sizes = response_positions(batch)
        h = hidden[rows.to(self.device), cols.to(self.device)]
        target = target.to(self.device)
        head = model.get_output_embeddings()
        logps, ents = [], []
        differentiable_entropy = with_entropy and self.loss_config.entropy_coef > 0
        if self.compute_dtype != torch.float32 and not differentiable_entropy:
            # bf16 compute (bf16 weights, or fp32 ones under autocast): keep the response
            # tokens' logits in bf16 (half the bytes of fp32) and do the fp32 math a chunk
            # at a time, in the forward and in the backward, without running the output
            # layer twice. Without grad too: the old log-probs are then bitwise the
            # training forward's (the ratio is exactly 1 on fresh data).
            logits = head(h)
            logps.append(_TokenLogprob.apply(logits, target, self.logit_chunk, temperature))  # type: ignore[no-untyped-call]
            if with_entropy:
                with torch.no_grad():
                    for lo in range(0, h.shape[0], self.logit_chunk):
                        chunk = tempered_logits(logits[lo : lo + self.logit_chunk], temperature)
                        ents.append(_entropy(chunk, torch.logsumexp(chunk, dim=-1)))
        else:
            for lo in range(0, h.shape[0], self.logit_chunk):
                hs, ts = h[lo : lo + self.logit_chunk], target[lo : lo + self.logit_chunk]
                if torch.is_grad_enabled():
                    # fp32 (or an entropy bonus): recompute each chunk in the backward.
                    lp, ent = torch.utils.checkpoint.checkpoint(
                        _token_logprobs, head, hs, ts, with_entropy, temperature,
                        use_reentrant=False,
                    )  # fmt: skip
                else:
                    lp, ent = _token_logprobs(head, hs, ts, with_entropy, temperature)
                logps.append(lp)
                ents.append(ent)
        logp = torch.cat(logps)
        entropy = list(torch.split(torch.cat(ents), sizes)) if with_entropy else None
        return list(torch.split(logp, sizes)), entropy

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named weights (for the engine's in-process update or a safetensors save)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save_hf(
        self, directory: str | os.PathLike[str], weights: dict[str, torch.Tensor] | None = None
    ) -> None:
        """The current weights (or ``weights``, a copy of the model's state dict) as a
        complete HF model directory (config, safetensors and the source model's
        tokenizer, chat template and generation config), e.g. for a server's
        ``/update_weights_from_disk`` or ``--save``."""
        from transformers.utils import logging as hf_logging

        from trainer._resources import copy_model_files

        # No "Writing model shards" bar: a sync writes the weights every step.
        shown = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
        try:
            self.model.save_pretrained(directory, state_dict=weights, safe_serialization=True)
        finally:
            if shown:
                hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]
        copy_model_files(self.path, directory)

    # -- checkpoints ----------------------------------------------------------------------
    def _identity(self) -> dict[str, Any]:
        c = self.model.config
        return {
            "architecture": type(self.model).__name__,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "num_hidden_layers": c.num_hidden_layers,
            "parameters": sum(p.numel() for p in self.model.parameters()),
        }

    def save_checkpoint(self, directory: str | os.PathLike[str], extra: dict[str, Any]) -> None:
        """Model (HF safetensors), optimizer, RNG states and ``extra`` (the loop's position)
        into ``directory``, replacing it atomically (a crash mid-save keeps the old one)."""
        self._checkpoint_writer(self.state_dict(), self._trainer_state(), extra)(directory)

    def checkpoint_snapshot(
        self, extra: dict[str, Any]
    ) -> Callable[[str | os.PathLike[str]], None] | None:
        """:meth:`save_checkpoint`'s state copied to CPU memory now; the function it
        returns writes it (on any thread, while training goes on). ``None`` without
        ``background_checkpoints``: the loop then saves in the foreground."""
        if not self.background_checkpoints:
            return None
        from trainer.backends._checkpoints import cpu_copy

        weights = cpu_copy(self.state_dict())
        return self._checkpoint_writer(weights, cpu_copy(self._trainer_state()), extra)

    def _checkpoint_writer(
        self, weights: dict[str, torch.Tensor], state: Any, extra: dict[str, Any]
    ) -> Callable[[str | os.PathLike[str]], None]:
        import json

        from trainer._resources import replace_dir

        meta = json.dumps({"model": self._identity(), "extra": extra}, indent=1)

        def write(directory: str | os.PathLike[str]) -> None:
            with replace_dir(directory) as tmp:
                self.save_hf(tmp / "model", dict(weights))  # (saving drops tied keys)
                torch.save(state, tmp / "trainer_state.pt")
                (tmp / "checkpoint.json").write_text(meta)

        return write

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore :meth:`save_checkpoint`'s state; returns its ``extra``. A checkpoint of
        another model is refused with what differs."""
        from safetensors.torch import load_file

        from trainer.backends._checkpoints import checkpoint_meta

        root = Path(directory)
        meta = checkpoint_meta(root, self._identity())
        weights: dict[str, torch.Tensor] = {}
        for f in sorted((root / "model").glob("*.safetensors")):
            weights.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        if unexpected or [m for m in missing if not (tied and m == "lm_head.weight")]:
            raise ConfigError(f"checkpoint weights do not fit the model: {missing or unexpected}")
        state = torch.load(root / "trainer_state.pt", weights_only=False)
        self._load_trainer_state(state)
        extra: dict[str, Any] = meta.get("extra", {})
        return extra


def _token_logprobs(
    head: torch.nn.Module,
    hidden: torch.Tensor,
    target: torch.Tensor,
    with_entropy: bool,
    temperature: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``target`` (and entropies) under ``softmax(logits / temperature)``
    from one chunk of hidden states, in fp32."""
    logits = tempered_logits(head(hidden), temperature)
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, target[:, None])[:, 0] - logz
    entropy = _entropy(logits, logz) if with_entropy else logp.new_zeros(0)
    return logp, entropy


def _entropy(logits: torch.Tensor, logz: torch.Tensor) -> torch.Tensor:
    """Per-row entropy of ``softmax(logits)`` (fp32 logits already divided by the
    temperature, their log-normaliser)."""
    return logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)


class _TokenLogprob(torch.autograd.Function):
    """``log softmax(logits / T)[target]`` with fp32 math one chunk of rows at a time.

    Saves the logits as they are (bf16 on GPU) and each row's log-normaliser; the backward
    rebuilds the fp32 softmax chunk by chunk (d logp / d logits = (one-hot - softmax) / T).
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, target: torch.Tensor, chunk: int, temperature: float
    ) -> torch.Tensor:
        n = logits.shape[0]
        logz = torch.empty(n, dtype=torch.float32, device=logits.device)
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        for lo in range(0, n, chunk):
            rows = tempered_logits(logits[lo : lo + chunk], temperature)
            z = torch.logsumexp(rows, dim=-1)
            logz[lo : lo + chunk] = z
            logp[lo : lo + chunk] = rows.gather(-1, target[lo : lo + chunk, None])[:, 0] - z
        ctx.save_for_backward(logits, target, logz)
        ctx.chunk = chunk
        ctx.temperature = temperature
        return logp

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, target, logz = ctx.saved_tensors
        t = ctx.temperature
        out = torch.empty_like(logits)
        for lo in range(0, logits.shape[0], ctx.chunk):
            hi = lo + ctx.chunk
            g = grad[lo:hi, None].float() / t  # the chain rule through logits / T
            d = torch.exp(tempered_logits(logits[lo:hi], t) - logz[lo:hi, None]) * -g
            d.scatter_add_(1, target[lo:hi, None], g)
            out[lo:hi] = d.to(logits.dtype)
        return out, None, None, None
