"""The algorithm group of the training config (:class:`LossConfig`): the policy loss's
settings, slime's flags. Light (no torch): ``agentenv train`` validates it before anything
loads; :mod:`trainer.algorithm._losses` computes with it."""

from __future__ import annotations

from typing import Literal, Self

import pydantic

from agentenv import ConfigError, SamplingParams
from trainer.config._settings import Group, setting

__all__ = ["AGGREGATIONS", "KL_TYPES", "LossConfig", "logprob_temperature"]

KL_TYPES = ("k1", "k2", "k3", "low_var_kl")
AGGREGATIONS = ("per_sample", "per_token", "constant")


class LossConfig(Group):
    """The policy loss (``config.algorithm``; slime's flags): clipped ratio (asymmetric,
    dual clip), KL to the starting model, entropy bonus, truncated importance sampling.

    ``aggregation``: ``per_sample`` (mean over each sample's tokens, then over samples),
    ``per_token`` (mean over all tokens of the step) or ``constant`` (sum over tokens /
    (samples * ``max_response_len``): Dr. GRPO's length-unbiased form). The temperature
    of the log-probs is not a loss setting: it is the rollouts' (``--rollout-temperature``,
    :attr:`GRPOConfig.sampling <trainer.GRPOConfig.sampling>`), which the loop hands the
    backend with every call (:func:`logprob_temperature`).
    """

    eps_clip: float = setting(
        "--eps-clip", 0.2, "lower clip of the ratio, ratio >= 1 - eps_clip", ge=0.0,
        allow_inf_nan=False,
    )  # fmt: skip
    eps_clip_high: float | None = setting(
        "--eps-clip-high", None, "upper clip, ratio <= 1 + eps_clip_high (default: "
        "--eps-clip; DAPO's clip-higher: e.g. 0.28 against 0.2)", ge=0.0, allow_inf_nan=False,
    )  # fmt: skip
    dual_clip: float | None = setting(
        "--eps-clip-c", None, "dual clip: for negative advantages cap the loss at "
        "-A * this (default: off)", gt=1.0, allow_inf_nan=False,
    )  # fmt: skip
    aggregation: Literal["per_sample", "per_token", "constant"] = setting(
        "--calculate-per-token-loss", "per_sample",
        "average the loss over the step's tokens instead of per sample", const="per_token",
    )  # fmt: skip
    max_response_len: int | None = setting(None, None, "the constant of constant aggregation", ge=1)
    use_kl_loss: bool = setting(
        "--use-kl-loss", False, "penalise KL to the starting model, weighted by "
        "--kl-loss-coef (loads a frozen copy when the weight is > 0)",
    )  # fmt: skip
    kl_loss_coef: float = setting(
        "--kl-loss-coef", 0.0, "weight of the KL penalty (with --use-kl-loss)", ge=0.0,
        allow_inf_nan=False,
    )  # fmt: skip
    kl_type: Literal["k1", "k2", "k3", "low_var_kl"] = setting(
        "--kl-loss-type", "low_var_kl", "KL estimator (low_var_kl: k3 clamped to [-10, 10])"
    )
    entropy_coef: float = setting(
        "--entropy-coef", 0.0, "entropy bonus weight", ge=0.0, allow_inf_nan=False
    )
    use_tis: bool = setting(
        "--use-tis", False, "truncated importance sampling: weight each token by "
        "clamp(exp(train_logp_old - rollout_logp)), for the engine's numerics",
    )  # fmt: skip
    tis_clip_low: float = setting(
        "--tis-clip-low", 0.0, "--use-tis: lower bound of the weight", ge=0.0,
        allow_inf_nan=False,
    )  # fmt: skip
    tis_clip_high: float = setting(
        "--tis-clip", 2.0, "--use-tis: upper bound of the weight", ge=0.0, allow_inf_nan=False
    )

    @pydantic.model_validator(mode="after")
    def _rules(self) -> Self:
        if self.eps_clip_high is not None and self.eps_clip_high < self.eps_clip:
            raise ConfigError(
                f"--eps-clip-high ({self.eps_clip_high}) must be >= --eps-clip ({self.eps_clip})"
            )
        if self.aggregation == "constant" and not self.max_response_len:
            raise ConfigError("aggregation='constant' needs max_response_len")
        if self.tis_clip_high < self.tis_clip_low:
            raise ConfigError(
                f"--tis-clip ({self.tis_clip_high}) must be >= --tis-clip-low ({self.tis_clip_low})"
            )
        return self

    @property
    def kl_coef(self) -> float:
        """The KL penalty's weight: ``kl_loss_coef`` under ``use_kl_loss``, else 0 (as
        slime: the coefficient alone does nothing). A reference model is loaded when > 0."""
        return self.kl_loss_coef if self.use_kl_loss else 0.0

    @property
    def clip_high(self) -> float:
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high


def logprob_temperature(sampling: SamplingParams) -> float:
    """The temperature of the distribution whose log-probs the engine reports for rollouts
    sampled with ``sampling``: its temperature, or 1 when it is greedy (the engine then
    takes the argmax of the plain logits)."""
    return 1.0 if sampling.greedy else sampling.temperature
