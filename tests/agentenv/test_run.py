"""agentenv.run: an environment on a model in one synchronous call."""

from __future__ import annotations

import anyio
import pytest

import agentenv
from agentenv import (
    ChatTokenizer,
    ConfigError,
    Environment,
    Episode,
    Limits,
    ListSink,
    RolloutConfig,
    Rubric,
    Sample,
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


class LastTaskFirst(Environment):
    """Each episode finishes only after every episode of the later tasks: the runner's
    groups complete in the reverse of the task order."""

    def __init__(self, n_tasks: int, n_samples: int) -> None:
        self.n_tasks, self.n_samples = n_tasks, n_samples
        self.turns: dict[int, anyio.Event] = {}  # made in the run's event loop

    def turn(self, k: int) -> anyio.Event:
        return self.turns.setdefault(k, anyio.Event())

    def tasks(self, split: str = "train") -> list[Task]:
        return [Task(id=f"t{i}", prompt="go") for i in range(self.n_tasks)]

    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        t = episode.transcript("go")
        await episode.generate(t)
        index = int(task.id[1:])
        k = (self.n_tasks - 1 - index) * self.n_samples + (self.n_samples - 1 - episode.index)
        if k > 0:  # every episode is in flight at once: wait for the one before
            await self.turn(k).wait()
        self.turn(k + 1).set()
        return episode.samples(t, float(index))


def test_run_returns_samples_in_task_order_whatever_order_they_finish_in(
    smollm2: ChatTokenizer,
) -> None:
    env = LastTaskFirst(n_tasks=3, n_samples=2)
    completion_order = ListSink()
    result = agentenv.run(
        env, ScriptedModel(smollm2, [(".", "ok")]), n_samples_per_prompt=2, sink=completion_order
    )
    # The sink streams groups as they finish; the result is in the order of the tasks.
    assert [s.task_id for s in completion_order.samples] == ["t2", "t2", "t1", "t1", "t0", "t0"]
    assert [(s.task_id, s.episode) for s in result.samples] == [
        ("t0", 0), ("t0", 1), ("t1", 0), ("t1", 1), ("t2", 0), ("t2", 1),
    ]  # fmt: skip
    assert list(result.by_task()) == ["t0", "t1", "t2"]
