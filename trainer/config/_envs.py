"""How a run's environment is built -- in the driver and, the same way, in every rollout
worker (:mod:`trainer.distributed._workers`): from a registered name or ``module:Class``
and its arguments, never pickled with state, scored by the reward flags' rubric in place
of its own (``--rm-type``, ``--custom-rm-path``) without changing the built instance."""

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
    """The environment; with reward flags, scored by their rubric in place of its own
    (``load_environment(..., rubric=)``: the environment's class with that rubric, the
    instance left as it was built)."""
    from agentenv import MultiTurnEnv, environment_class, load_environment
    from agentenv.rewards import reward_rubric

    if not spec.reward_args:
        return load_environment(spec.name, dict(spec.args))
    cls = environment_class(spec.name)
    if not issubclass(cls, MultiTurnEnv):
        flags = " ".join(f"--{k.replace('_', '-')}" for k in spec.reward_args)
        raise ConfigError(
            f"{flags}: --env {spec.name} ({cls.__name__}) scores its own episodes in its "
            "rollout; the reward flags replace the rubric of a SingleTurnEnv, MultiTurnEnv "
            "or ToolEnv (or leave --env out for prompt_data)"
        )
    rubric = reward_rubric(**dict(spec.reward_args))
    return load_environment(spec.name, dict(spec.args), rubric=rubric)
