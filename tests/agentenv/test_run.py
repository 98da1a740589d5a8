"""agentenv.run: an environment on a model in one synchronous call."""

from __future__ import annotations

import pytest

import agentenv
from agentenv import (
    ChatTokenizer,
    ConfigError,
    Limits,
    ListSink,
    RolloutConfig,
    Rubric,
    ScriptedModel,
    SingleTurnEnv,
    State,
    Task,
)

pytestmark = pytest.mark.timeout(60)


def exact(task: Task, state: State) -> float:
    return 1.0 if state.completion.strip() == str(task.answer) else 0.0


class Echo(SingleTurnEnv):
    rubric = Rubric(exact)

    def tasks(self, split: str = "train") -> list[Task]:
        return [Task(id=f"{split}{i}", prompt=f"say {i}", answer=str(i)) for i in range(3)]


def test_run_returns_the_samples_and_stats_with_the_models_tokenizer(
    smollm2: ChatTokenizer,
) -> None:
    model = ScriptedModel(smollm2, [(r"say (\d)", r"\1")])
    result = agentenv.run(Echo(), model, split="test", n=2, n_samples_per_prompt=2)
    assert [s.task_id for s in result.samples] == ["test0", "test0", "test1", "test1"]
    assert [s.reward for s in result.samples] == [1.0] * 4
    assert result.stats.episodes == 4 and result.summary()["reward_mean"] == 1.0
    assert sorted(result.by_task()) == ["test0", "test1"]


def test_run_takes_tasks_a_config_and_a_sink(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, [(r"say (\d)", "wrong")])
    sink = ListSink()
    result = agentenv.run(
        Echo(),
        model,
        tasks=[Task(id="x", prompt="say 1", answer="1")],
        sink=sink,
        config=RolloutConfig(limits=Limits(max_turns=1)),
    )
    assert [s.reward for s in result.samples] == [0.0]
    assert sink.samples == result.samples


def test_run_names_unknown_settings(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, [(".", "x")])
    with pytest.raises(ConfigError, match=r"unknown run setting\(s\) \['n_sample'\]"):
        agentenv.run(Echo(), model, n_sample=2)
    with pytest.raises(ConfigError, match="either config= or RolloutConfig fields"):
        agentenv.run(Echo(), model, config=RolloutConfig(), seed=1)


@pytest.mark.anyio
async def test_run_inside_an_event_loop_points_to_the_async_api(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, [(".", "x")])
    with pytest.raises(RuntimeError, match=r"await run_rollouts\(env, tasks, model"):
        agentenv.run(Echo(), model)


def test_the_tokenizer_comes_from_the_models_directory_or_is_asked_for(
    smollm2: ChatTokenizer,
) -> None:
    from agentenv._runner import policy_tokenizer
    from agentenv.engine._models import resolve_model

    class EngineLike:  # what the embedded engine exposes: a raw tokenizer and its directory
        tokenizer = object()
        model_path = resolve_model("smollm2-135m")

    assert policy_tokenizer(EngineLike()).encode("hi") == smollm2.encode("hi")  # type: ignore[arg-type]

    class ClientLike:
        pass

    with pytest.raises(ConfigError, match=r"pass tokenizer=ChatTokenizer\.load\("):
        policy_tokenizer(ClientLike())  # type: ignore[arg-type]
