"""The policy loss: clipped ratio (asymmetric, dual clip), KL to a reference, entropy bonus,
truncated importance sampling against the rollout's log-probs.

Every log-prob here -- old, new, reference -- and the entropy are of
``softmax(logits / temperature)`` (:func:`tempered_logits`), the distribution the rollout
engine sampled from and whose log-probs it reports (as SGLang does): at the rollout's
temperature, or 1 for greedy rollouts (:func:`~trainer.logprob_temperature`).

Tensors are flat over the response tokens of a micro-batch (samples packed back to back).
Each token carries a weight (:func:`token_weights`) that encodes the loss aggregation for
the *whole step*, so that summing ``weight * per-token loss`` over micro-batches gives the
same loss -- and the same gradients -- however the samples were packed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from agentenv import ConfigError
from trainer.config import KL_TYPES, LossConfig

__all__ = [
    "gradient_without_advantage",
    "kl_estimate",
    "policy_loss",
    "tempered_logits",
    "token_weights",
]


def tempered_logits(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """``logits / temperature`` in fp32, [..., V] -> [..., V], differentiable: the logits
    whose softmax the rollout engine sampled from, divided as its sampler divides them (an
    fp32 division by a tensor on the logits' device, skipped at 1; CUDA would multiply by
    a rounded reciprocal for a Python number)."""
    scaled = logits.float()
    if temperature == 1.0:
        return scaled
    return scaled / torch.full((), temperature, dtype=torch.float32, device=scaled.device)


def token_weights(
    lengths: Sequence[int],
    masks: Sequence[torch.Tensor],
    config: LossConfig,
    *,
    total_samples: int,
    total_tokens: int,
) -> list[torch.Tensor]:
    """Per-token weights of some samples, for a step of ``total_samples`` samples with
    ``total_tokens`` loss-mask tokens in all: the aggregation, as weights."""
    out = []
    for n, mask in zip(lengths, masks, strict=True):
        m = mask.to(torch.float64)
        if config.aggregation == "per_token":
            w = m / max(total_tokens, 1)
        elif config.aggregation == "per_sample":
            w = m / (max(float(m.sum()), 1.0) * max(total_samples, 1))
        else:
            assert config.max_response_len
            w = m / (max(total_samples, 1) * config.max_response_len)
        if w.numel() != n:
            raise ConfigError(f"a mask of {w.numel()} tokens for a response of {n}")
        out.append(w)
    return out


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) from sampled tokens' log-probs."""
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp) ** 2
    if kind in ("k3", "low_var_kl"):
        log_ratio = ref_logp - logp
        kl = torch.exp(log_ratio) - log_ratio - 1
        return kl.clamp(-10, 10) if kind == "low_var_kl" else kl
    raise ConfigError(f"unknown KL type {kind!r}; valid: {', '.join(KL_TYPES)}")


def gradient_without_advantage(config: LossConfig) -> bool:
    """Whether :func:`policy_loss` has a gradient on a token whose advantage is 0: only
    through a term besides the policy gradient -- the KL to the reference
    (``kl_coef > 0``) or the entropy bonus (``entropy_coef > 0``). Without one, a step whose
    advantages are all 0 changes nothing: the loop does not run it."""
    return config.kl_coef > 0 or config.entropy_coef > 0


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    weights: torch.Tensor,
    config: LossConfig,
    *,
    ref_logp: torch.Tensor | None = None,
    rollout_logp: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted loss of a micro-batch, and its metrics' weighted sums.

    Args:
        logp: the policy's log-probs of the sampled tokens (with grad).
        old_logp: the log-probs of the policy that sampled, as the trainer computes them
            (at the first step on fresh data they equal ``logp``: ratio 1).
        advantages: per token (each sample's advantage repeated over its tokens).
        weights: :func:`token_weights` (0 where the loss mask is 0).
        ref_logp: the reference model's log-probs (needed when ``kl_coef > 0``).
        rollout_logp: the rollout engine's log-probs (for TIS and the logprob-diff metric).
        entropy: per-token entropy of the policy (for the entropy bonus).

    Returns ``(loss, sums)``: summing both over a step's micro-batches gives the step's
    loss and its metrics' weighted sums; divide those by the summed ``weight`` for means
    (``ratio_max``/``ratio_min`` combine by max/min instead).
    """
    w = weights.to(logp.dtype)
    on = w > 0
    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio)
    pg1 = -advantages * ratio
    pg2 = -advantages * ratio.clamp(1 - config.eps_clip, 1 + config.clip_high)
    clipped = torch.maximum(pg1, pg2)
    if config.dual_clip is not None:
        capped = torch.minimum(clipped, -advantages * config.dual_clip)
        pg = torch.where(advantages < 0, capped, clipped)
    else:
        pg = clipped
    sums: dict[str, torch.Tensor] = {}
    if config.use_tis:
        if rollout_logp is None:
            raise ConfigError("use_tis needs the rollout's log-probs")
        tis = torch.exp(old_logp - rollout_logp).clamp(config.tis_clip_low, config.tis_clip_high)
        pg = pg * tis.detach()
        sums["tis_weight"] = (w * tis).sum().detach()
    loss = (w * pg).sum()
    sums["pg_loss"] = loss.detach()
    if config.kl_coef > 0:
        if ref_logp is None:
            raise ConfigError("kl_coef > 0 needs the reference model's log-probs")
        kl = (w * kl_estimate(logp, ref_logp, config.kl_type)).sum()
        loss = loss + config.kl_coef * kl
        sums["kl"] = kl.detach()
    if entropy is not None:
        ent = (w * entropy).sum()
        if config.entropy_coef > 0:
            loss = loss - config.entropy_coef * ent
        sums["entropy"] = ent.detach()
    with torch.no_grad():
        sums["clipfrac"] = (w * (pg2 > pg1).to(w.dtype)).sum()
        sums["ratio_mean"] = (w * ratio).sum()
        live = ratio[on] if on.any() else ratio.new_ones(1)
        sums["ratio_max"], sums["ratio_min"] = live.max(), live.min()
        if rollout_logp is not None:
            sums["rollout_train_logprob_abs_diff"] = (w * (old_logp - rollout_logp).abs()).sum()
    sums["loss"] = loss.detach()
    sums["weight"] = w.sum().detach()  # 1 over a step, except for "constant" aggregation
    return loss, sums
