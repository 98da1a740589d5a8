"""Loading environments: typos get suggestions, environment arguments are type-checked."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv import ConfigError, load_environment

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_a_class_name_typo_suggests_the_close_name() -> None:
    with pytest.raises(ConfigError, match=r"no attribute 'ReverseEnvv'; did you mean ReverseEnv\?"):
        load_environment(f"{EXAMPLES / 'reverse_env.py'}:ReverseEnvv")


def test_an_environment_name_typo_suggests_the_registered_name() -> None:
    with pytest.raises(ConfigError, match=r"'arithmetc' \(did you mean arithmetic\?\)"):
        load_environment("arithmetc")


def test_env_args_are_checked_against_the_constructor() -> None:
    with pytest.raises(
        ConfigError, match=r"TicTacToeEnv argument 'retries' must be int, got str 'one'"
    ):
        load_environment("tictactoe", {"retries": "one"})
    with pytest.raises(ConfigError, match=r"no argument 'retris' \(did you mean retries\?\)"):
        load_environment("tictactoe", {"retris": 1})
    env = load_environment("tictactoe", {"retries": 2, "discount": 1})
    assert getattr(env, "retries", None) == 2 and getattr(env, "discount", None) == 1.0
