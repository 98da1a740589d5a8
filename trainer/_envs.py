"""How a run's environment is built -- in the driver and, the same way, in every rollout
worker (:mod:`trainer.distributed._workers`): from a registered name or ``module:Class``
and its arguments, never pickled with state, with the reward flags' rubric in place of its
own (``--rm-type``, ``--custom-rm-path``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from agentenv import ConfigError, Environment

__all__ = ["EnvSpec", "build_env"]


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """``name`` (registered, or ``module:Class``) built with ``args``; ``reward_args``: the
    reward flags' rubric replaces the environment's (none: its own)."""

    name: str
    args: Mapping[str, Any]
    reward_args: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def build_env(spec: EnvSpec) -> Environment:
    from agentenv import load_environment

    env = load_environment(spec.name, dict(spec.args))
    if spec.reward_args:
        _score_with(env, spec.name, dict(spec.reward_args))
    return env


def _score_with(env: Environment, name: str, reward_args: dict[str, Any]) -> None:
    """The reward flags' rubric in place of ``env``'s own."""
    from agentenv import MultiTurnEnv
    from agentenv.rewards import reward_rubric

    if not isinstance(env, MultiTurnEnv):
        flags = " ".join(f"--{k.replace('_', '-')}" for k in reward_args)
        raise ConfigError(
            f"{flags}: --env {name} ({type(env).__name__}) scores its own episodes in its "
            "rollout; the reward flags replace the rubric of a SingleTurnEnv, MultiTurnEnv "
            "or ToolEnv (or leave --env out for prompt_data)"
        )
    env.rubric = reward_rubric(**reward_args)
