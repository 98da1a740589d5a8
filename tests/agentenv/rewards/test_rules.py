"""The rule-based reward types against hand-checked cases (``cases.py``), their reasons
in the metadata, slime's ``boxed_`` prefix and the verifier's bound on one check."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from agentenv import ConfigError
from agentenv.rewards import (
    RM_TYPES,
    Equivalence,
    MathVerifier,
    after_thinking,
    last_boxed,
    last_number,
    score,
)
from tests.agentenv.rewards.cases import DAPO, DEEPSCALER, F1, MATH


@pytest.fixture(scope="module")
def verifier() -> Iterator[MathVerifier]:
    v = MathVerifier(max_workers=1)
    yield v
    v.close()


def test_each_type_has_at_least_thirty_reference_cases() -> None:
    assert min(len(MATH), len(DEEPSCALER), len(DAPO), len(F1)) >= 30


@pytest.mark.parametrize(
    ("rm_type", "response", "label", "expected"),
    [("math", *c) for c in MATH]
    + [("deepscaler", *c) for c in DEEPSCALER]
    + [("dapo", *c) for c in DAPO]
    + [("f1", *c) for c in F1],
)
def test_reference_cases(
    verifier: MathVerifier, rm_type: str, response: str, label: Any, expected: float
) -> None:
    assert score(rm_type, response, label, verifier).reward == pytest.approx(expected)


@pytest.mark.parametrize(
    ("rm_type", "response", "label", "reason"),
    [
        ("math", "", "7", "no answer: no \\boxed{} and no number"),
        ("math", "<think>\\boxed{7}", "7", "no answer: <think> is never closed"),
        ("math", "\\boxed{7}", "", "empty label"),
        ("math", "\\boxed{\\frac{}{}}", "2", "answer not parseable by math-verify"),
        ("math", "\\boxed{2}", "\\frac{", "label not parseable by math-verify"),
        ("math", "\\boxed{" + "1+" * 600 + "1}", "2", "answer longer than 1000 characters"),
        ("deepscaler", "\\boxed{4}", "4", "no answer: no </think> or ###Response before it"),
        ("deepscaler", "<think></think>4", "4", "no answer: no \\boxed{} after the thinking"),
        ("dapo", "12", "12", "no answer: no 'Answer:' line in the last 300 characters"),
        ("f1", "", "Paris", "empty response"),
    ],
)
def test_what_cannot_be_judged_scores_zero_with_the_reason(
    verifier: MathVerifier, rm_type: str, response: str, label: str, reason: str
) -> None:
    verdict = score(rm_type, response, label, verifier)
    assert verdict.reward == (-1.0 if rm_type == "dapo" else 0.0)
    assert verdict.reason == reason
    assert verdict.metadata()["rm_reason"] == reason


def test_a_wrong_answer_is_judged_and_says_what_was_read(verifier: MathVerifier) -> None:
    verdict = score("math", "<think>maybe 3</think>so \\boxed{4}", "3", verifier)
    assert (verdict.reward, verdict.answer, verdict.reason) == (0.0, "4", None)
    dapo = score("dapo", "Answer: 12 cm", "13", verifier)
    assert dapo.metadata() == {"rm_answer": "12", "rm_reason": None, "acc": False, "pred": "12"}


def test_boxed_prefix_scores_the_last_box_by_the_type() -> None:
    assert score("boxed_f1", "I say \\boxed{Paris} not \\boxed{the Paris}", "Paris").reward == 1.0
    assert score("boxed_f1", "Paris", "Paris").reward == 0.0  # no box: an empty response
    assert score("boxed_dapo", "\\boxed{Answer: 3}", "3").reward == 1.0


def test_an_unknown_type_lists_the_known_ones() -> None:
    with pytest.raises(ConfigError) as e:
        score("deepscalar", "x", "y")
    assert "known: dapo, deepscaler, f1, math, remote_rm" in str(e.value)
    assert "did you mean deepscaler" in str(e.value)
    assert RM_TYPES == ("dapo", "deepscaler", "f1", "math", "remote_rm")
    with pytest.raises(ConfigError, match="not a reward type"):
        score("boxed_remote_rm", "x", "y")


@pytest.mark.timeout(60)
def test_an_answer_that_keeps_sympy_busy_is_a_timeout_and_the_worker_is_replaced() -> None:
    v = MathVerifier(max_workers=1, timeout_s=2.0)
    try:
        # 9^(9^(9^9)) does not finish; math-verify's own alarm cannot interrupt it.
        assert v.equivalent("1", "9^{9^{9^{9}}}") in (Equivalence.TIMEOUT, Equivalence.DIFFERENT)
        assert v.equivalent("\\frac{1}{2}", "0.5") is Equivalence.EQUAL  # a new worker
    finally:
        v.close()


@pytest.mark.parametrize(
    ("text", "thinking", "boxed", "number"),
    [
        ("<think>1</think> 2", " 2", None, "2"),
        ("<think>1", None, None, "1"),
        ("\\boxed{\\frac{1}{2}}", "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", "2"),
        ("\\boxed{a} \\boxed{b}", "\\boxed{a} \\boxed{b}", "b", None),
        ("\\boxed{unclosed", "\\boxed{unclosed", None, None),
        ("1,234 and 3/4", "1,234 and 3/4", None, "3/4"),
        ("-1,234.5", "-1,234.5", None, "-1234.5"),
    ],
)
def test_extraction(text: str, thinking: str | None, boxed: str | None, number: str | None) -> None:
    assert after_thinking(text) == thinking
    assert last_boxed(text) == boxed
    assert last_number(text) == number


def test_the_public_surface_is_sorted_complete_and_documented() -> None:
    import inspect

    import agentenv.rewards as rewards

    names = rewards.__all__
    assert names == sorted(names, key=lambda n: (not n.isupper(), n))
    public = {n for n in dir(rewards) if not n.startswith("_")}
    modules = {n for n in public if inspect.ismodule(getattr(rewards, n))}
    assert set(names) == public - modules
    for name in names:
        value = getattr(rewards, name)
        if not name.isupper():
            assert inspect.getdoc(value), f"{name} has no docstring"
