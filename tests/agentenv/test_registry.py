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


def test_a_rubric_given_to_the_loader_scores_in_place_of_the_environments_own() -> None:
    from agentenv import MultiTurnEnv, Rubric, environment_class

    rubric = Rubric(lambda task, state: 0.5)
    cls = environment_class("arithmetic")
    own = cls.__dict__.get("rubric", None) or getattr(cls, "rubric", None)
    env = load_environment("arithmetic", rubric=rubric)
    assert isinstance(env, cls) and isinstance(env, MultiTurnEnv)
    assert type(env).__name__ == cls.__name__ and env.rubric is rubric
    assert "rubric" not in vars(env)  # the instance's attributes are its own
    assert getattr(cls, "rubric", None) is own  # and the class keeps its rubric
    assert load_environment("arithmetic").rubric is own  # type: ignore[attr-defined]
    with pytest.raises(ConfigError, match=r"TicTacToeEnv scores its own episodes"):
        load_environment("tictactoe", rubric=rubric)
