"""A new user's first mistakes: each is refused where it is made, naming the fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from agentenv import (
    ChatTokenizer,
    ConfigError,
    MultiTurnEnv,
    Rubric,
    ScriptedModel,
    SingleTurnEnv,
    State,
    Status,
    Task,
    ToolEnv,
    run_rollouts,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def exact(task: Task, state: State) -> float:
    return 1.0 if state.completion.strip() == str(task.answer) else 0.0


def test_a_plain_function_as_a_tool_is_refused_where_the_class_is_defined() -> None:
    def add(a: int, b: int) -> int:
        return a + b

    with pytest.raises(ConfigError, match=r"tools holds 'add', which is not a Tool: decorate it"):

        class Adder(ToolEnv):
            tools = (add,)


async def test_tools_set_per_instance_are_checked_before_the_first_episode(
    smollm2: ChatTokenizer,
) -> None:
    class Adder(ToolEnv):
        rubric = Rubric(exact)

        def __init__(self) -> None:
            self.tools = [len]  # type: ignore[misc]

    with pytest.raises(ConfigError, match="decorate it with @tool"):
        await run_rollouts(Adder(), [Task(id="a")], ScriptedModel(smollm2, [(".", "x")]))


def test_respond_without_async_is_refused_where_the_class_is_defined() -> None:
    with pytest.raises(ConfigError, match=r"Chat\.respond must be a coroutine function: write "):

        class Chat(MultiTurnEnv):
            rubric = Rubric(exact)

            def respond(self, task: Task, state: State) -> str:  # type: ignore[override]
                return "more"


def test_rollout_without_async_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"`async def rollout\(...\)`"):

        class Custom(SingleTurnEnv):
            def rollout(self, task: Task, episode: Any) -> Any:  # type: ignore[override]
                return []


async def test_tasks_as_dicts_are_refused_naming_the_fix(smollm2: ChatTokenizer) -> None:
    class Dicts(SingleTurnEnv):
        rubric = Rubric(exact)

        def tasks(self, split: str = "train") -> Sequence[Task]:
            return [{"id": "a", "prompt": "hi"}]  # type: ignore[list-item]

    env = Dicts()
    with pytest.raises(ConfigError, match=r"item 0 is dict .*return Task\(id=\.\.\."):
        await run_rollouts(env, env.tasks(), ScriptedModel(smollm2, [(".", "x")]))


async def test_an_environment_without_a_rubric_is_refused(smollm2: ChatTokenizer) -> None:
    class NoReward(SingleTurnEnv):
        pass

    with pytest.raises(ConfigError, match=r"NoReward has no rubric.*rubric = Rubric\(my_reward\)"):
        await run_rollouts(NoReward(), [Task(id="a")], ScriptedModel(smollm2, [(".", "x")]))

    class NoRewardOnPurpose(SingleTurnEnv):
        rubric = Rubric()

    stats = await run_rollouts(
        NoRewardOnPurpose(), [Task(id="a")], ScriptedModel(smollm2, [(".", "x")])
    )
    assert stats.status == {"completed": 1}


async def test_a_bug_in_an_environment_names_its_type_and_line(smollm2: ChatTokenizer) -> None:
    def grade(task: Task, state: State) -> float:
        return float(task.info["points"])  # a KeyError: the task has no "points"

    class Buggy(SingleTurnEnv):
        rubric = Rubric(grade)

    stats = await run_rollouts(Buggy(), [Task(id="a")], ScriptedModel(smollm2, [(".", "x")]))
    ((reason, count),) = stats.top_failures()
    line = grade.__code__.co_firstlineno + 1
    assert reason == f"KeyError: 'points' (at tests/agentenv/test_mistakes.py:{line} in grade)"
    assert count == 1 and stats.all_failed
    assert stats.to_dict()["failure_reasons"] == [[reason, 1]]


async def test_the_tokenizer_comes_from_the_scripted_model(smollm2: ChatTokenizer) -> None:
    class Echo(SingleTurnEnv):
        rubric = Rubric(exact)

    stats = await run_rollouts(
        Echo(), [Task(id="a", answer="x")], ScriptedModel(smollm2, [(".", "x")])
    )
    assert stats.rewards == [1.0] and stats.status == {Status.COMPLETED.value: 1}


class Grading(MultiTurnEnv):
    """Records in respond which turns it saw (what the guide warns about)."""

    max_turns = 2
    rubric = Rubric(exact)

    async def respond(self, task: Task, state: State) -> str:
        seen = state.info.setdefault("responded", [])
        assert isinstance(seen, list)
        seen.append(state.turns)
        return "again"


async def test_the_loop_ends_as_the_guide_says(smollm2: ChatTokenizer) -> None:
    from agentenv import ListSink, RolloutConfig, SamplingParams

    model = ScriptedModel(smollm2, [(".", "a long answer of many tokens")])
    sink = ListSink()
    cut = RolloutConfig(sampling=SamplingParams(max_new_tokens=2))
    await run_rollouts(Grading(), [Task(id="a")], model, sink=sink, config=cut)
    (s,) = sink.samples
    # cut at max_new_tokens: respond never saw the turn
    assert s.status is Status.TRUNCATED and s.reason == "length: hit max_new_tokens"
    assert "responded" not in s.metadata
    sink = ListSink()
    await run_rollouts(Grading(), [Task(id="a")], model, sink=sink)
    (s,) = sink.samples
    # a reply to the last allowed turn: truncated, the reply not added
    assert s.status is Status.TRUNCATED and s.reason == "max_turns: reached 2 turns"
    assert s.metadata["responded"] == [1, 2] and s.metadata["turns"] == 2


async def test_an_environments_own_timeout_error_is_not_the_episode_timeout(
    smollm2: ChatTokenizer,
) -> None:
    from agentenv import Limits, RolloutConfig

    class OwnTimeout(SingleTurnEnv):
        rubric = Rubric(exact)

        async def respond(self, task: Task, state: State) -> None:
            raise TimeoutError("the verifier's server did not answer")

    config = RolloutConfig(limits=Limits(timeout_s=30))
    model = ScriptedModel(smollm2, [(".", "x")])
    stats = await run_rollouts(OwnTimeout(), [Task(id="a")], model, config=config)
    assert stats.failed == {"TimeoutError": 1}
    ((reason, _),) = stats.top_failures()
    assert reason.startswith("TimeoutError: the verifier's server did not answer (at tests/")
