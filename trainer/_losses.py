"""The policy loss: clipped ratio (asymmetric, dual clip), KL to a reference, entropy bonus,
truncated importance sampling against the rollout's log-probs.

Every log-prob here -- old, new, reference -- and the entropy are of
``softmax(logits / temperature)`` (:func:`tempered_logits`), the distribution the rollout
engine sampled from and whose log-probs it reports (as SGLang does): at the rollout's
temperature, or 1 for greedy rollouts (:func:`logprob_temperature`).

Tensors are flat over the response tokens of a micro-batch (samples packed back to back).
Each token carries a weight (:func:`token_weights`) that encodes the loss aggregation for
the *whole step*, so that summing ``weight * per-token loss`` over micro-batches gives the
same loss -- and the same gradients -- however the samples were packed.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from agentenv import ConfigError, SamplingParams

__all__ = [
    "AGGREGATIONS",
    "KL_TYPES",
    "LossConfig",
    "kl_estimate",
    "logprob_temperature",
    "policy_loss",
    "tempered_logits",
    "token_weights",
]

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
AGGREGATIONS = ("per_sample", "per_token", "constant")


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class LossConfig:
    """Loss settings (slime's flag names in brackets).

    Args:
        eps_clip: lower clip, ``ratio >= 1 - eps_clip`` [--eps-clip].
        eps_clip_high: upper clip, ``ratio <= 1 + eps_clip_high`` (default: ``eps_clip``)
            [--eps-clip-high]; DAPO's clip-higher uses e.g. 0.28 against 0.2.
        dual_clip: for negative advantages, cap the loss at ``-A * dual_clip`` (> 1;
            None: off) [--eps-clip-c].
        aggregation: ``per_sample`` (mean over each sample's tokens, then over samples),
            ``per_token`` (mean over all tokens of the step) [--calculate-per-token-loss],
            or ``constant`` (sum over tokens / (samples * ``max_response_len``): Dr. GRPO's
            length-unbiased form).
        max_response_len: the constant of ``constant`` aggregation.
        kl_coef: weight of the KL penalty (0: no reference model) [--kl-loss-coef].
        kl_type: ``k1``, ``k2``, ``k3`` or ``low_var_kl`` (k3 clamped to [-10, 10])
            [--kl-loss-type].
        entropy_coef: weight of the entropy bonus [--entropy-coef].
        use_tis: weight each token by ``clamp(exp(train_logp_old - rollout_logp))``,
            correcting for the rollout engine's numerics [--use-tis].
        tis_clip_low, tis_clip_high: the clamp's bounds [--tis-clip-low, --tis-clip].
        temperature: the rollout's sampling temperature (> 0): every log-prob and entropy
            the backend computes is of ``softmax(logits / temperature)``, as the engine's
            are; :func:`logprob_temperature` gives it for some sampling parameters (1 for
            greedy) [--rollout-temperature].
    """

    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip: float | None = None
    aggregation: str = "per_sample"
    max_response_len: int | None = None
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    use_tis: bool = False
    tis_clip_low: float = 0.0
    tis_clip_high: float = 2.0
    temperature: float = 1.0

    def __post_init__(self) -> None:
        for name in ("eps_clip", "kl_coef", "entropy_coef", "tis_clip_low", "tis_clip_high"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"{name} must be a finite number >= 0, got {value!r}")
        t = self.temperature
        if not isinstance(t, int | float) or not math.isfinite(t) or t <= 0:
            raise ConfigError(
                f"temperature must be a finite number > 0, got {t!r} (greedy rollouts: "
                "logprob_temperature(sampling) gives 1)"
            )
        if self.eps_clip_high is not None and self.eps_clip_high < self.eps_clip:
            raise ConfigError(
                f"eps_clip_high ({self.eps_clip_high}) must be >= eps_clip ({self.eps_clip})"
            )
        if self.dual_clip is not None and self.dual_clip <= 1:
            raise ConfigError(f"dual_clip must be > 1, got {self.dual_clip}")
        if self.kl_type not in KL_TYPES:
            raise ConfigError(f"unknown KL type {self.kl_type!r}; valid: {', '.join(KL_TYPES)}")
        if self.aggregation not in AGGREGATIONS:
            raise ConfigError(
                f"unknown loss aggregation {self.aggregation!r}; valid: {', '.join(AGGREGATIONS)}"
            )
        if self.aggregation == "constant" and not self.max_response_len:
            raise ConfigError("aggregation='constant' needs max_response_len")
        if self.tis_clip_high < self.tis_clip_low:
            raise ConfigError("tis_clip_high must be >= tis_clip_low")

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    def check_sampling(self, sampling: SamplingParams) -> None:
        """Refuse rollouts sampled at another temperature than this loss's log-probs are
        computed at: their ratio to the rollouts' log-probs, TIS weights and mismatch
        metrics would compare two different distributions."""
        want = logprob_temperature(sampling)
        if self.temperature != want:
            raise ConfigError(
                f"the rollouts sample at temperature {sampling.temperature} but the loss "
                f"computes log-probs at temperature {self.temperature}: build the backend "
                f"with LossConfig(temperature={want}) (logprob_temperature(sampling))"
            )


def logprob_temperature(sampling: SamplingParams) -> float:
    """The temperature of the distribution whose log-probs the engine reports for rollouts
    sampled with ``sampling``: its temperature, or 1 when it is greedy (the engine then
    takes the argmax of the plain logits)."""
    return 1.0 if sampling.greedy else sampling.temperature


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
