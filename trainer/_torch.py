"""The torch backend: any Hugging Face causal LM trained with the GRPO loss on one device.

Samples arrive as token ids (never re-tokenized). A step computes the old policy's
log-probs (unless given), packs samples into micro-batches by a token budget, and for each
micro-batch runs the decoder, then the output layer *in chunks of tokens* under activation
checkpointing: the full-vocabulary fp32 logits of one chunk exist at a time, in the forward
and again in the backward, never for the whole batch. Loss weights are computed for the
whole step (:func:`trainer.token_weights`), so packing does not change the gradients.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.utils.checkpoint

from agentenv import ConfigError, Sample
from trainer._batching import pack_by_tokens
from trainer._losses import LossConfig, policy_loss, token_weights

__all__ = ["LR_DECAY_STYLES", "OPTIMIZERS", "OptimConfig", "TorchBackend"]


OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
LR_DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class OptimConfig:
    """Optimizer and learning-rate schedule (slime's names in brackets).

    Args:
        optimizer: ``adam`` (AdamW: decoupled weight decay) or ``sgd`` [--optimizer].
        lr: peak learning rate [--lr].
        betas: Adam's betas [--adam-beta1, --adam-beta2].
        weight_decay: decoupled weight decay [--weight-decay].
        grad_clip: clip the global gradient norm to this (0: off) [--clip-grad].
        eps: Adam's epsilon [--adam-eps].
        lr_decay_style: ``constant``, ``linear`` or ``cosine`` decay from ``lr`` to
            ``min_lr`` over ``lr_decay_iters`` optimizer steps [--lr-decay-style].
        lr_warmup_iters: linear warm-up from 0 over this many steps [--lr-warmup-iters].
        lr_decay_iters: steps of the decay (default: constant lr) [--lr-decay-iters].
        min_lr: the floor of the decay [--min-lr].
    """

    optimizer: str = "adam"
    lr: float = 1e-6
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    eps: float = 1e-8
    lr_decay_style: str = "constant"
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"unknown optimizer {self.optimizer!r}; valid: {', '.join(OPTIMIZERS)}"
            )
        if self.lr_decay_style not in LR_DECAY_STYLES:
            raise ConfigError(
                f"unknown lr_decay_style {self.lr_decay_style!r}; "
                f"valid: {', '.join(LR_DECAY_STYLES)}"
            )
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ConfigError(f"lr must be a positive number, got {self.lr}")
        if not 0 <= self.min_lr <= self.lr:
            raise ConfigError(f"min_lr must be in [0, lr ({self.lr})], got {self.min_lr}")
        if not all(0 <= b < 1 for b in self.betas):
            raise ConfigError(f"adam betas must be in [0, 1), got {self.betas}")
        if self.weight_decay < 0 or self.grad_clip < 0:
            raise ConfigError("weight_decay and grad_clip must be >= 0")
        decay = self.lr_decay_iters
        if self.lr_warmup_iters < 0 or (decay is not None and decay < 1):
            raise ConfigError("lr_warmup_iters must be >= 0 and lr_decay_iters >= 1")

    def lr_at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if step < self.lr_warmup_iters:
            return self.lr * (step + 1) / self.lr_warmup_iters
        if self.lr_decay_style == "constant" or self.lr_decay_iters is None:
            return self.lr
        span = max(self.lr_decay_iters - self.lr_warmup_iters, 1)
        done = min(max(step - self.lr_warmup_iters, 0) / span, 1.0)
        if self.lr_decay_style == "linear":
            factor = 1.0 - done
        else:
            factor = 0.5 * (1.0 + math.cos(math.pi * done))
        return self.min_lr + (self.lr - self.min_lr) * factor


@dataclasses.dataclass(slots=True)
class _Item:
    ids: torch.Tensor  # prompt + completion
    start: int  # index in ids of the first completion token
    mask: torch.Tensor  # loss mask over the completion, float64


def _items(samples: Sequence[Sample]) -> list[_Item]:
    out = []
    for i, s in enumerate(samples):
        n = len(s.completion_ids)
        if not s.prompt_ids or n == 0:
            raise ConfigError(f"sample {i} has no prompt or no completion: nothing to train on")
        ids = torch.tensor([*s.prompt_ids, *s.completion_ids], dtype=torch.long)
        mask = torch.tensor(list(s.loss_mask or [1] * n), dtype=torch.float64)
        out.append(_Item(ids, len(s.prompt_ids), mask))
    return out


class TorchBackend:
    """Trains an HF causal LM with the GRPO loss.

    Args:
        model: a model name (``smollm2-135m``) or an HF directory.
        device: ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: default float32 on CPU, bfloat16 on CUDA.
        optim: AdamW settings.
        loss: loss settings.
        max_tokens_per_micro_batch: the packing budget (prompt and completion tokens).
        logit_chunk: tokens whose full-vocabulary logits exist at once.
        entropy_metric: report the policy's per-token entropy (one more pass over each
            chunk's logits); always computed when the loss has an entropy bonus.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] = "smollm2-135m",
        *,
        device: str = "cpu",
        dtype: torch.dtype | None = None,
        optim: OptimConfig | None = None,
        loss: LossConfig | None = None,
        max_tokens_per_micro_batch: int = 4096,
        logit_chunk: int = 1024,
        entropy_metric: bool = True,
    ) -> None:
        from transformers import AutoModelForCausalLM

        from agentenv.engine import resolve_model

        self.device = torch.device(device)
        self.dtype = dtype or (torch.bfloat16 if self.device.type == "cuda" else torch.float32)
        self.path = resolve_model(model)
        loaded: Any = AutoModelForCausalLM.from_pretrained(
            self.path, dtype=self.dtype, attn_implementation="sdpa"
        )
        self.model: Any = loaded.to(self.device)
        self.model.train()
        self.reference: Any = None
        if loss is not None and loss.kl_coef > 0:
            # A frozen copy of the starting weights for the KL penalty.
            ref: Any = AutoModelForCausalLM.from_pretrained(
                self.path, dtype=self.dtype, attn_implementation="sdpa"
            )
            self.reference = ref.to(self.device).eval().requires_grad_(False)
        self.optim_config = optim or OptimConfig()
        self.loss_config = loss or LossConfig()
        self.max_tokens = max_tokens_per_micro_batch
        self.logit_chunk = logit_chunk
        self.entropy_metric = entropy_metric
        o = self.optim_config
        self.optimizer: torch.optim.Optimizer
        if o.optimizer == "sgd":
            self.optimizer = torch.optim.SGD(
                self.model.parameters(), lr=o.lr, weight_decay=o.weight_decay
            )
        else:
            # CUDA: one fused kernel for the whole update instead of a few per tensor.
            self.optimizer = torch.optim.AdamW(
                self.model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps,
                weight_decay=o.weight_decay, fused=self.device.type == "cuda",
            )  # fmt: skip
        self.steps = 0

    # -- forward -------------------------------------------------------------------------
    def _forward(
        self, batch: Sequence[_Item], *, with_entropy: bool, model: Any = None
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None]:
        """Per item: log-probs of its completion tokens (and their entropies)."""
        model = model if model is not None else self.model
        width = max(len(it.ids) for it in batch)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        attention = torch.zeros(len(batch), width, dtype=torch.long)
        for row, it in enumerate(batch):
            ids[row, : len(it.ids)] = it.ids
            attention[row, : len(it.ids)] = 1
        hidden = model.get_decoder()(
            input_ids=ids.to(self.device), attention_mask=attention.to(self.device)
        ).last_hidden_state
        # The hidden state at position t predicts token t + 1.
        rows, cols, targets = [], [], []
        for row, it in enumerate(batch):
            n = len(it.ids) - it.start
            rows.append(torch.full((n,), row, dtype=torch.long))
            cols.append(torch.arange(it.start - 1, len(it.ids) - 1))
            targets.append(it.ids[it.start :])
        h = hidden[torch.cat(rows).to(self.device), torch.cat(cols).to(self.device)]
        target = torch.cat(targets).to(self.device)
        head = model.get_output_embeddings()
        logps, ents = [], []
        differentiable_entropy = with_entropy and self.loss_config.entropy_coef > 0
        if torch.is_grad_enabled() and self.dtype != torch.float32 and not differentiable_entropy:
            # bf16/fp16: keep the response tokens' logits in the model's dtype (half the
            # bytes of fp32) and do the fp32 math a chunk at a time, in the forward and in
            # the backward, without running the output layer twice.
            logits = head(h)
            logps.append(_TokenLogprob.apply(logits, target, self.logit_chunk))  # type: ignore[no-untyped-call]
            if with_entropy:
                with torch.no_grad():
                    for lo in range(0, h.shape[0], self.logit_chunk):
                        chunk = logits[lo : lo + self.logit_chunk].float()
                        ents.append(_entropy(chunk, torch.logsumexp(chunk, dim=-1)))
        else:
            for lo in range(0, h.shape[0], self.logit_chunk):
                hs, ts = h[lo : lo + self.logit_chunk], target[lo : lo + self.logit_chunk]
                if torch.is_grad_enabled():
                    # fp32 (or an entropy bonus): recompute each chunk in the backward.
                    lp, ent = torch.utils.checkpoint.checkpoint(
                        _token_logprobs, head, hs, ts, with_entropy, use_reentrant=False
                    )
                else:
                    lp, ent = _token_logprobs(head, hs, ts, with_entropy)
                logps.append(lp)
                ents.append(ent)
        logp = torch.cat(logps)
        sizes = [len(it.ids) - it.start for it in batch]
        entropy = list(torch.split(torch.cat(ents), sizes)) if with_entropy else None
        return list(torch.split(logp, sizes)), entropy

    @torch.no_grad()
    def logprobs(self, samples: Sequence[Sample], *, reference: bool = False) -> list[torch.Tensor]:
        """The current policy's (or, with ``reference``, the frozen reference model's)
        log-probs, float32 on CPU, of each sample's completion tokens."""
        if reference and self.reference is None:
            raise ConfigError("no reference model: it is loaded when loss.kl_coef > 0")
        model = self.reference if reference else self.model
        items = _items(samples)
        out: list[torch.Tensor | None] = [None] * len(items)
        for group in pack_by_tokens([len(it.ids) for it in items], self.max_tokens):
            lps, _ = self._forward([items[i] for i in group], with_entropy=False, model=model)
            for i, lp in zip(group, lps, strict=True):
                out[i] = lp.float().cpu()
        return [t for t in out if t is not None]

    # -- training -------------------------------------------------------------------------
    def train_step(
        self,
        samples: Sequence[Sample],
        advantages: torch.Tensor | Sequence[float],
        *,
        old_logprobs: Sequence[torch.Tensor] | None = None,
        ref_logprobs: Sequence[torch.Tensor] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on ``samples`` (one per advantage); returns its metrics."""
        cfg = self.loss_config
        items = _items(samples)
        adv = torch.as_tensor(advantages, dtype=torch.float64).flatten()
        if adv.numel() != len(items):
            raise ConfigError(f"{len(items)} samples but {adv.numel()} advantages")
        if cfg.kl_coef > 0 and ref_logprobs is None:
            raise ConfigError("kl_coef > 0 needs ref_logprobs")
        groups = pack_by_tokens([len(it.ids) for it in items], self.max_tokens)
        t0 = time.perf_counter()
        if old_logprobs is None:
            # With the same micro-batches as the update: at the first step on fresh data
            # the ratio is then exactly 1.
            old: list[torch.Tensor | None] = [None] * len(items)
            with torch.no_grad():
                for group in groups:
                    lps, _ = self._forward([items[i] for i in group], with_entropy=False)
                    for i, lp in zip(group, lps, strict=True):
                        old[i] = lp.detach()
            old_logprobs = [t for t in old if t is not None]
        t1 = time.perf_counter()
        weights = token_weights(
            [len(it.mask) for it in items],
            [it.mask for it in items],
            cfg,
            total_samples=len(items),
            total_tokens=int(sum(float(it.mask.sum()) for it in items)),
        )
        sums: dict[str, float] = {}
        ratio_max, ratio_min = -math.inf, math.inf
        want_entropy = self.entropy_metric or cfg.entropy_coef > 0
        for group in groups:
            lps, ents = self._forward([items[i] for i in group], with_entropy=want_entropy)
            dev = lps[0].device

            def cat(parts: Sequence[torch.Tensor], dev: torch.device = dev) -> torch.Tensor:
                return torch.cat([p.to(dev, torch.float32) for p in parts])

            rollout = [samples[i].rollout_logprobs for i in group]
            has_rollout = all(r is not None for r in rollout)
            loss, part = policy_loss(
                cat(lps),
                cat([old_logprobs[i] for i in group]),
                cat([adv[i].expand(len(items[i].mask)) for i in group]),
                cat([weights[i] for i in group]),
                cfg,
                ref_logp=cat([ref_logprobs[i] for i in group]) if ref_logprobs else None,
                rollout_logp=cat([torch.tensor(list(r or ())) for r in rollout])
                if has_rollout
                else None,
                entropy=cat(ents) if ents is not None else None,
            )
            loss.backward()  # type: ignore[no-untyped-call]
            for k, v in part.items():
                if k == "ratio_max":
                    ratio_max = max(ratio_max, float(v))
                elif k == "ratio_min":
                    ratio_min = min(ratio_min, float(v))
                else:
                    sums[k] = sums.get(k, 0.0) + float(v)
        t2 = time.perf_counter()
        clip = self.optim_config.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), clip if clip > 0 else float("inf")
        )
        skipped = not math.isfinite(float(norm))
        lr = self.optim_config.lr_at(self.steps)
        if not skipped:  # a NaN or infinite gradient would ruin the weights: skip the update
            for param_group in self.optimizer.param_groups:
                param_group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        t3 = time.perf_counter()
        # Metric sums are weighted like the loss; divided by the total weight they are means
        # (the loss itself is already the step's).
        weight = sums.pop("weight", 0.0) or 1.0
        metrics = {k: v if k in ("loss", "pg_loss") else v / weight for k, v in sums.items()}
        metrics.update(
            skipped_nonfinite=float(skipped),
            ratio_max=ratio_max,
            ratio_min=ratio_min,
            grad_norm=float(norm),
            lr=lr,
            micro_batches=float(len(groups)),
            time_old_logprobs_s=t1 - t0,
            time_forward_backward_s=t2 - t1,
            time_optimizer_s=t3 - t2,
        )
        if "rollout_train_logprob_abs_diff" in metrics:
            metrics["train/rollout_train_logprob_abs_diff"] = metrics.pop(
                "rollout_train_logprob_abs_diff"
            )
        return metrics

    def state_dict(self) -> dict[str, torch.Tensor]:
        """HF-named weights (for the engine's in-process update or a safetensors save)."""
        return {k: v.detach() for k, v in self.model.state_dict().items()}

    def save_hf(self, directory: str | os.PathLike[str]) -> None:
        """The current weights as an HF model directory (config + safetensors), e.g. for a
        server's ``/update_weights_from_disk``."""
        self.model.save_pretrained(directory, safe_serialization=True)

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
        import json

        from trainer._files import replace_dir

        with replace_dir(directory) as tmp:
            self.model.save_pretrained(tmp / "model", safe_serialization=True)
            torch.save(
                {
                    "optimizer": self.optimizer.state_dict(),
                    "torch_rng": torch.get_rng_state(),
                    "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
                    "steps": self.steps,
                },
                tmp / "trainer_state.pt",
            )
            (tmp / "checkpoint.json").write_text(
                json.dumps({"model": self._identity(), "extra": extra}, indent=1)
            )

    def load_checkpoint(self, directory: str | os.PathLike[str]) -> dict[str, Any]:
        """Restore :meth:`save_checkpoint`'s state; returns its ``extra``. A checkpoint of
        another model is refused with what differs."""
        import json

        from safetensors.torch import load_file

        root = Path(directory)
        try:
            meta = json.loads((root / "checkpoint.json").read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{str(root)!r} is not a trainer checkpoint: {e}") from None
        mine = self._identity()
        if meta.get("model") != mine:
            diff = {
                k: (meta.get("model", {}).get(k), v)
                for k, v in mine.items()
                if meta.get("model", {}).get(k) != v
            }
            raise ConfigError(
                f"checkpoint {str(root)!r} is from another model (checkpoint vs this: {diff})"
            )
        weights: dict[str, torch.Tensor] = {}
        for f in sorted((root / "model").glob("*.safetensors")):
            weights.update(load_file(str(f)))
        missing, unexpected = self.model.load_state_dict(weights, strict=False)
        tied = getattr(self.model.config, "tie_word_embeddings", False)
        if unexpected or [m for m in missing if not (tied and m == "lm_head.weight")]:
            raise ConfigError(f"checkpoint weights do not fit the model: {missing or unexpected}")
        state = torch.load(root / "trainer_state.pt", weights_only=False)
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["torch_rng"])
        if state["cuda_rng"]:
            torch.cuda.set_rng_state_all(state["cuda_rng"])
        self.steps = int(state["steps"])
        extra: dict[str, Any] = meta.get("extra", {})
        return extra


def _token_logprobs(
    head: torch.nn.Module, hidden: torch.Tensor, target: torch.Tensor, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs of ``target`` (and entropies) from one chunk of hidden states, in fp32."""
    logits = head(hidden).float()
    logz = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, target[:, None])[:, 0] - logz
    entropy = _entropy(logits, logz) if with_entropy else logp.new_zeros(0)
    return logp, entropy


def _entropy(logits: torch.Tensor, logz: torch.Tensor) -> torch.Tensor:
    """Per-row entropy of ``softmax(logits)`` (fp32 logits, their log-normaliser)."""
    return logz - (torch.softmax(logits, dim=-1) * logits).sum(-1)


class _TokenLogprob(torch.autograd.Function):
    """``log softmax(logits)[target]`` with fp32 math one chunk of rows at a time.

    Saves the logits as they are (bf16 on GPU) and each row's log-normaliser; the backward
    rebuilds the fp32 softmax chunk by chunk (d logp / d logits = one-hot - softmax).
    """

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, chunk: int) -> torch.Tensor:
        n = logits.shape[0]
        logz = torch.empty(n, dtype=torch.float32, device=logits.device)
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        for lo in range(0, n, chunk):
            rows = logits[lo : lo + chunk].float()
            z = torch.logsumexp(rows, dim=-1)
            logz[lo : lo + chunk] = z
            logp[lo : lo + chunk] = rows.gather(-1, target[lo : lo + chunk, None])[:, 0] - z
        ctx.save_for_backward(logits, target, logz)
        ctx.chunk = chunk
        return logp

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        logits, target, logz = ctx.saved_tensors
        out = torch.empty_like(logits)
        for lo in range(0, logits.shape[0], ctx.chunk):
            hi = lo + ctx.chunk
            g = grad[lo:hi, None].float()
            d = torch.exp(logits[lo:hi].float() - logz[lo:hi, None]) * -g
            d.scatter_add_(1, target[lo:hi, None], g)
            out[lo:hi] = d.to(logits.dtype)
        return out, None, None
