"""``module:attr`` names: one resolver (``--env``, ``--dynamic-sampling-filter-path``, the
megatron followers' backend factory), each failure a ConfigError naming the flag."""

from __future__ import annotations

import os.path

import pytest

from agentenv import ConfigError, Rubric, resolve_name


def test_both_spellings_and_dotted_attributes() -> None:
    assert resolve_name("os.path:join", what="--x") is os.path.join
    assert resolve_name("os.path.join", what="--x") is os.path.join
    assert resolve_name("agentenv:Rubric.score", what="--x") is Rubric.score


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nodots", r"--x 'nodots': expected module:function or module.function"),
        ("os.path:", r"expected module:function"),
        (":join", r"expected module:function"),
        ("os.path:1x", r"expected module:function"),
        ("nowhere.f", r"--x 'nowhere.f': cannot import 'nowhere': No module named 'nowhere'"),
        ("nowhere:f", r"cannot import 'nowhere'"),
        ("os.path:joinn", r"'os.path' has no attribute 'joinn'; did you mean join\?"),
        ("os.path.joinn", r"'os.path' has no attribute 'joinn'; did you mean join\?"),
        ("agentenv:Rubric.scor", r"'agentenv:Rubric' has no attribute 'scor'; did you mean score"),
    ],
)
def test_failures_name_the_flag_and_the_fix(spec: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_name(spec, what="--x", kind="function")
