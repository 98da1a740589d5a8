"""The optimizer group of the training config (:class:`OptimConfig`): optimizer and
learning-rate schedule, slime's flags. Light (no torch): every backend builds its
optimizer from it."""

from __future__ import annotations

import math
from typing import Literal, Self

import pydantic

from agentenv import ConfigError
from trainer.config._settings import Group, setting

__all__ = ["LR_DECAY_STYLES", "OPTIMIZERS", "OptimConfig"]

OPTIMIZERS: tuple[str, ...] = ("adam", "sgd")
LR_DECAY_STYLES: tuple[str, ...] = ("constant", "linear", "cosine")


class OptimConfig(Group):
    """Optimizer and learning-rate schedule (``config.optimizer``; slime's flags).

    The schedule: linear warm-up from 0 over ``lr_warmup_iters`` optimizer steps, then
    ``lr_decay_style`` decay from ``lr`` to ``min_lr`` until ``lr_decay_iters`` (``None``:
    constant ``lr``; a :class:`~trainer.TrainConfig` sets it to the whole run).
    """

    optimizer: Literal["adam", "sgd"] = setting(
        "--optimizer", "adam", "adam (AdamW: decoupled weight decay) or sgd"
    )
    lr: float = setting("--lr", 1e-6, "peak learning rate", gt=0.0, allow_inf_nan=False)
    adam_beta1: float = setting("--adam-beta1", 0.9, "Adam beta1", ge=0.0, lt=1.0)
    adam_beta2: float = setting("--adam-beta2", 0.98, "Adam beta2", ge=0.0, lt=1.0)
    eps: float = setting("--adam-eps", 1e-8, "Adam epsilon", gt=0.0)
    weight_decay: float = setting("--weight-decay", 0.0, "decoupled weight decay", ge=0.0)
    grad_clip: float = setting("--clip-grad", 1.0, "gradient norm clip (0: off)", ge=0.0)
    lr_decay_style: Literal["constant", "linear", "cosine"] = setting(
        "--lr-decay-style", "constant", "learning-rate decay from --lr to --min-lr"
    )
    lr_warmup_iters: int = setting("--lr-warmup-iters", 0, "optimizer steps of warm-up", ge=0)
    lr_decay_iters: int | None = setting(
        "--lr-decay-iters", None, "optimizer steps of the decay (default: the whole run)", ge=1
    )
    min_lr: float = setting("--min-lr", 0.0, "the decay's final learning rate", ge=0.0)

    @pydantic.model_validator(mode="after")
    def _rules(self) -> Self:
        if self.min_lr > self.lr:
            raise ConfigError(f"--min-lr ({self.min_lr}) must be <= --lr ({self.lr})")
        return self

    @property
    def betas(self) -> tuple[float, float]:
        """Adam's ``(beta1, beta2)``."""
        return self.adam_beta1, self.adam_beta2

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
