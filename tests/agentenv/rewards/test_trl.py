"""TRL's reward functions (``GRPOTrainer``'s ``reward_funcs``): through ``from_trl`` and
detected on ``--custom-rm-path`` -- completions as chat messages or text, dataset columns
by name, a list back (``None``: no reward, ``bool``: 0/1) -- and what is refused."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from agentenv import (
    ChatTokenizer,
    ConfigError,
    Rubric,
    Sample,
    ScriptedModel,
    SingleTurnEnv,
    Status,
    Task,
    run,
)
from agentenv.rewards import from_trl, reward_rubric

pytestmark = pytest.mark.timeout(120)

CHAT = [
    Task(id="a", prompt=[{"role": "user", "content": "2+2?"}], answer="4", info={"level": 1}),
    Task(id="b", prompt=[{"role": "user", "content": "3+3?"}], answer="6", info={"level": 2}),
]
TEXT = [Task(id="c", prompt="2+2?", answer="4", info={"level": 1})]


def accuracy_reward(completions: list[Any], solution: list[str], **kwargs: Any) -> list[float]:
    """As TRL's docs write one: conversational completions, the label column by name."""
    contents = [completion[0]["content"] for completion in completions]
    return [float(c.strip() == s) for c, s in zip(contents, solution, strict=True)]


def play(rubric: Rubric, tasks: list[Task], reply: str, smollm2: ChatTokenizer) -> list[Sample]:
    class Env(SingleTurnEnv):
        pass

    env = Env()
    env.rubric = rubric
    model = ScriptedModel(smollm2, [], default=reply)
    return run(env, model, tasks=tasks).samples


def rewards(samples: list[Sample]) -> dict[str, float]:
    return {str(s.task_id): s.reward for s in samples}


def test_a_trl_function_scores_conversational_completions_with_the_label_column(
    smollm2: ChatTokenizer,
) -> None:
    samples = play(Rubric(from_trl(accuracy_reward, label_key="solution")), CHAT, "4", smollm2)
    assert {s.status for s in samples} == {Status.COMPLETED}
    assert rewards(samples) == {"a": 1.0, "b": 0.0}
    assert samples[0].metadata["rewards"] == {"accuracy_reward": 1.0}


def test_what_a_trl_function_is_given(smollm2: ChatTokenizer) -> None:
    seen: list[dict[str, Any]] = []

    def record(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[bool]:
        seen.append({"prompts": prompts, "completions": completions, **kwargs})
        return [True]  # bool: 1.0

    samples = play(Rubric(from_trl(record)), CHAT[:1] + TEXT, "4", smollm2)
    assert rewards(samples) == {"a": 1.0, "c": 1.0}
    (chat,) = [k for k in seen if not isinstance(k["prompts"][0], str)]
    (text,) = [k for k in seen if isinstance(k["prompts"][0], str)]
    assert chat["prompts"] == [[{"role": "user", "content": "2+2?"}]]
    assert chat["completions"] == [[{"role": "assistant", "content": "4"}]]
    assert text["prompts"] == ["2+2?"] and text["completions"] == ["4"]
    for given in (chat, text):
        assert given["answer"] == ["4"] and given["level"] == [1]
        (ids,) = given["completion_ids"]
        assert ids and all(isinstance(i, int) for i in ids)


def test_a_trl_function_of_named_columns_only_gets_those(smollm2: ChatTokenizer) -> None:
    def by_level(completions: list[str], level: list[int]) -> list[float]:
        return [float(n) for n in level]

    assert rewards(play(Rubric(from_trl(by_level)), TEXT, "4", smollm2)) == {"c": 1.0}


def test_async_trl_functions_and_none_as_no_reward(smollm2: ChatTokenizer) -> None:
    async def abstains(completions: list[str], **kwargs: Any) -> list[float | None]:
        return [None]

    samples = play(Rubric(from_trl(abstains)), TEXT, "4", smollm2)
    assert {s.status for s in samples} == {Status.COMPLETED} and rewards(samples) == {"c": 0.0}


@pytest.mark.parametrize(
    ("returned", "message"),
    [
        (0.5, "returned float 0.5; it must return a list with one number per completion"),
        ([1.0, 0.0], "returned 2 values for 1 completion"),
        (["x"], "reward function 'shaky' returned str 'x'"),
    ],
)
def test_a_bad_trl_answer_fails_the_sample_naming_it(
    returned: Any, message: str, smollm2: ChatTokenizer
) -> None:
    def shaky(completions: list[str], **kwargs: Any) -> Any:
        return returned

    (sample,) = play(Rubric(from_trl(shaky)), TEXT, "4", smollm2)
    assert sample.status is Status.FAILED and message in str(sample.reason)


def test_a_missing_column_names_the_columns_and_the_label_key(smollm2: ChatTokenizer) -> None:
    (sample,) = play(Rubric(from_trl(accuracy_reward)), TEXT, "4", smollm2)
    assert sample.status is Status.FAILED
    assert (
        "TRL reward 'accuracy_reward' needs the column(s) ['solution'], but task 'c' has "
        "['answer', 'level']; task.answer is passed as 'answer' (--label-key"
    ) in str(sample.reason)


def test_an_unwrapped_trl_function_is_refused_naming_from_trl() -> None:
    with pytest.raises(ConfigError, match=r"wrap it: agentenv.rewards.from_trl\(accuracy_rew"):
        Rubric(accuracy_reward)
    with pytest.raises(ConfigError, match="TRL passes every argument by keyword"):
        from_trl(lambda completions, /, **kw: [1.0])
    # (task, completions) is a group reward function of ours, not TRL's
    Rubric(group=[lambda task, completions: [1.0] * len(completions)])


def test_custom_rm_path_detects_a_trl_function(tmp_path: Path, smollm2: ChatTokenizer) -> None:
    path = tmp_path / "trl_rewards.py"
    path.write_text(
        "def accuracy_reward(completions, solution, **kwargs):\n"
        "    return [c[0]['content'] == s for c, s in zip(completions, solution)]\n"
    )
    rubric = reward_rubric(custom_rm_path=f"{path}:accuracy_reward", label_key="solution")
    assert rewards(play(rubric, CHAT, "6", smollm2)) == {"a": 0.0, "b": 1.0}
    with pytest.raises(ConfigError, match=r"is a TRL reward function .* drop --group-rm"):
        reward_rubric(custom_rm_path=f"{path}:accuracy_reward", group_rm=True)
