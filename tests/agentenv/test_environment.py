"""Environments, episodes and the runner, driven by the scripted model."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import anyio
import pytest

from agentenv import (
    ChatTokenizer,
    Completion,
    ConfigError,
    Environment,
    Episode,
    FinishReason,
    Generator,
    JsonlSink,
    Limits,
    ListSink,
    MultiTurnEnv,
    RolloutConfig,
    Rubric,
    Sample,
    SamplingParams,
    ScriptedModel,
    SingleTurnEnv,
    State,
    Status,
    Task,
    ToolEnv,
    run_rollouts,
    tool,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def exact(task: Task, state: State) -> float:
    return 1.0 if state.completion.strip() == str(task.answer) else 0.0


class Echo(SingleTurnEnv):
    name = "echo_test"
    rubric = Rubric(exact)


def tasks(n: int) -> list[Task]:
    return [Task(id=f"t{i}", prompt=f"say {i}", answer=str(i)) for i in range(n)]


async def one_sample(
    env: Environment,
    ts: list[Task],
    model: Generator,
    tok: ChatTokenizer,
    config: RolloutConfig | None = None,
) -> Sample:
    """Run the tasks and return the single sample they produce."""
    sink = ListSink()
    await run_rollouts(env, ts, model, tokenizer=tok, sink=sink, config=config)
    (s,) = sink.samples
    return s


def say_number(ctx) -> str:  # type: ignore[no-untyped-def]
    return ctx.text.rsplit("say ", 1)[1].split("<|im_end|>")[0]


async def test_single_turn_groups_rewards_and_tokens(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, say_number)
    sink = ListSink()
    stats = await run_rollouts(
        Echo(),
        tasks(5),
        model,
        tokenizer=smollm2,
        sink=sink,
        config=RolloutConfig(n_samples_per_prompt=3, concurrency=4),
    )
    assert stats.episodes == 15 and stats.samples == 15 and stats.turns == 15
    assert stats.reward_mean == 1.0 and not stats.failed
    groups: dict[str, list[Sample]] = {}
    for s in sink.samples:
        assert s.group_id is not None
        groups.setdefault(s.group_id, []).append(s)
    assert len(groups) == 5 and all(len(g) == 3 for g in groups.values())
    # A group is emitted whole: its samples are adjacent in the sink.
    order = [s.group_id for s in sink.samples]
    assert all(order[i : i + 3].count(order[i]) == 3 for i in range(0, 15, 3))
    s = sink.samples[0]
    assert s.status is Status.COMPLETED and s.metadata["rewards"] == {"exact": 1.0}
    assert s.completion_ids[-1] == smollm2.eos_token_id and list(s.loss_mask or ()) == [1] * len(
        s.completion_ids
    )
    assert s.weight_versions == ["scripted"]
    assert stats.completion_tokens == sum(len(x.completion_ids) for x in sink.samples)


class Counter(MultiTurnEnv):
    """The environment says 'more' until the model has answered three times."""

    name = "counter_test"
    max_turns = 10
    rubric = Rubric(lambda task, state: float(state.turns))

    async def respond(self, task: Task, state: State) -> list[dict[str, str]] | None:
        if state.turns >= 3:
            return None
        return [{"role": "user", "content": "more"}]


async def test_multi_turn_masks_and_completion(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, lambda ctx: "ok")
    s = await one_sample(Counter(), tasks(1), model, smollm2)
    assert s.reward == 3.0 and s.metadata["turns"] == 3
    assert s.loss_mask.count(1) == 3 * len([*smollm2.encode("ok"), 0])  # type: ignore[union-attr]
    assert 0 in s.loss_mask  # type: ignore[operator]
    assert s.rollout_logprobs is not None
    assert all(
        lp == 0.0 for lp, m in zip(s.rollout_logprobs, s.loss_mask or [], strict=True) if m == 0
    )


async def test_turns_ending_on_endoftext_are_one_sample(chatml_tools: ChatTokenizer) -> None:
    # A Qwen2.5-style model stops on either <|im_end|> or <|endoftext|>.
    im_end, endoftext = chatml_tools.eos_token_id, chatml_tools.token_to_id("<|endoftext|>")
    assert im_end is not None and endoftext is not None
    model = ScriptedModel(chatml_tools, lambda ctx: "ok", end_of_turn=endoftext)
    config = RolloutConfig(sampling=SamplingParams(stop_token_ids=[im_end, endoftext]))
    s = await one_sample(Counter(), tasks(1), model, chatml_tools, config)
    assert s.status is Status.COMPLETED and s.metadata["turns"] == 3 and "segment" not in s.metadata
    turn = [*chatml_tools.encode("ok"), endoftext]
    ids = list(s.completion_ids)
    assert ids[: len(turn)] == turn and ids[-len(turn) :] == turn
    assert ids.count(endoftext) == 3
    assert s.loss_mask is not None and sum(s.loss_mask) == 3 * len(turn)


class Thinker(Echo):
    chat_template_kwargs: ClassVar[Mapping[str, Any]] = {"enable_thinking": False}


async def test_template_arguments_from_run_environment_and_episode(
    thinking: ChatTokenizer,
) -> None:
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    prompts: list[str] = []

    def record(ctx) -> str:  # type: ignore[no-untyped-def]
        prompts.append(ctx.text)
        return "4"

    model = ScriptedModel(thinking, record)
    run = RolloutConfig(chat_template_kwargs={"enable_thinking": False})
    await one_sample(Echo(), tasks(1), model, thinking, run)
    assert prompts.pop().endswith(empty_think)
    # The environment's own arguments are laid over the run's.
    run = RolloutConfig(chat_template_kwargs={"enable_thinking": True})
    await one_sample(Thinker(), tasks(1), model, thinking, run)
    assert prompts.pop().endswith(empty_think)
    await one_sample(Echo(), tasks(1), model, thinking, run)
    assert not prompts.pop().endswith(empty_think)
    # And a transcript's over the episode's.
    episode = Episode(
        task=tasks(1)[0],
        tokenizer=thinking,
        policy=model,
        chat_template_kwargs=run.chat_template_kwargs,
    )
    t = episode.transcript("hi", chat_template_kwargs={"enable_thinking": False})
    assert t.text.endswith(empty_think) and not episode.transcript("hi").text.endswith(empty_think)


def test_bad_template_arguments_are_refused_at_configuration() -> None:
    with pytest.raises(ConfigError, match="may not set 'messages'"):
        RolloutConfig(chat_template_kwargs={"messages": []})


async def test_turn_limit_truncates(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, lambda ctx: "ok")
    s = await one_sample(
        Counter(), tasks(1), model, smollm2, RolloutConfig(limits=Limits(max_turns=2))
    )
    assert s.status is Status.TRUNCATED and "max_turns" in (s.reason or "")
    assert s.metadata["turns"] == 2


async def test_context_budget_truncates_not_raises(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, lambda ctx: "ok " * 20)
    s = await one_sample(
        Counter(), tasks(1), model, smollm2, RolloutConfig(limits=Limits(context_length=90))
    )
    assert s.status is Status.TRUNCATED and (s.reason or "").startswith(("context", "length"))
    assert len(s.prompt_ids) + len(s.completion_ids) <= 90


async def test_max_new_tokens_truncates(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, lambda ctx: "a long answer that goes on")
    s = await one_sample(
        Echo(), tasks(1), model, smollm2, RolloutConfig(sampling=SamplingParams(max_new_tokens=3))
    )
    assert s.status is Status.TRUNCATED and "max_new_tokens" in (s.reason or "")
    assert len(s.completion_ids) == 3


async def test_prompt_longer_than_context_is_a_failed_sample(smollm2: ChatTokenizer) -> None:
    sink = ListSink()
    long = [Task(id="long", prompt="word " * 200, answer="")]
    stats = await run_rollouts(
        Echo(),
        long,
        ScriptedModel(smollm2, lambda c: "x"),
        tokenizer=smollm2,
        sink=sink,
        config=RolloutConfig(limits=Limits(context_length=64)),
    )
    (s,) = sink.samples
    assert s.status is Status.FAILED and s.error_type == "ContextLengthError"
    assert "context_length is 64" in (s.reason or "")
    assert stats.failed == {"ContextLengthError": 1}


# -- failures are data ----------------------------------------------------------------------
class Flaky(SingleTurnEnv):
    """Task 'boom' raises, 'nan' scores NaN, 'str' scores a string, 'slow' hangs."""

    name = "flaky_test"

    @staticmethod
    def score(task: Task, state: State) -> float:
        if task.id == "boom":
            raise ValueError("verifier exploded")
        if task.id == "nan":
            return math.nan
        if task.id == "str":
            return "1.0"  # type: ignore[return-value]
        return 1.0

    rubric = Rubric(score)

    async def respond(self, task: Task, state: State) -> None:
        if task.id == "slow":
            await anyio.sleep_forever()
        return None


async def test_failures_become_failed_samples_and_siblings_survive(smollm2: ChatTokenizer) -> None:
    ts = [Task(id=i, prompt=i) for i in ("ok1", "boom", "nan", "str", "slow", "ok2")]
    sink = ListSink()
    # (A scripted episode takes milliseconds: 2 s is the slow one's alone, even under load.)
    stats = await run_rollouts(
        Flaky(),
        ts,
        ScriptedModel(smollm2, lambda c: "fine"),
        tokenizer=smollm2,
        sink=sink,
        config=RolloutConfig(concurrency=6, limits=Limits(timeout_s=2.0)),
    )
    by_task = {s.group_id.split("@")[0]: s for s in sink.samples}  # type: ignore[union-attr]
    assert by_task["ok1"].status is Status.COMPLETED and by_task["ok2"].reward == 1.0
    assert (
        by_task["boom"].error_type == "ValueError" and "verifier exploded" in by_task["boom"].reason
    )
    assert by_task["nan"].error_type == "RewardError" and "finite" in by_task["nan"].reason
    assert by_task["str"].error_type == "RewardError" and "str" in by_task["str"].reason
    assert by_task["slow"].error_type == "EpisodeTimeout" and "2.0 s" in by_task["slow"].reason
    assert by_task["boom"].prompt_ids  # the failed sample still says what the prompt was
    assert stats.failed == {"EpisodeTimeout": 1, "RewardError": 2, "ValueError": 1}
    assert stats.rewards == [1.0, 1.0]


class StallsAfterATurn(MultiTurnEnv):
    """Answers the first turn; on the second, hangs (task 'hang') or raises (task 'raise')."""

    rubric = Rubric(exact)

    async def respond(self, task: Task, state: State) -> str:
        if state.turns == 2:
            if task.id == "raise":
                raise ValueError("the checker crashed")
            await anyio.sleep_forever()
        return "go on"


@pytest.mark.parametrize(
    ("task_id", "error_type"), [("hang", "EpisodeTimeout"), ("raise", "ValueError")]
)
async def test_a_failed_episode_keeps_the_tokens_of_its_turns(
    smollm2: ChatTokenizer, task_id: str, error_type: str
) -> None:
    model = ScriptedModel(smollm2, lambda ctx: f"turn {ctx.text.count('go on') + 1}")
    sink = ListSink()
    config = RolloutConfig(limits=Limits(timeout_s=1.0))
    await run_rollouts(
        StallsAfterATurn(), [Task(id=task_id, prompt="start")], model, sink=sink, config=config
    )
    (s,) = sink.samples
    assert s.status is Status.FAILED and s.error_type == error_type
    assert not s.trainable  # kept for inspection, never trained on
    assert s.metadata["turns"] == 2
    text = smollm2.decode(s.completion_ids)
    assert "turn 1" in text and "go on" in text and "turn 2" in text
    assert "start" in smollm2.decode(s.prompt_ids)
    # The model's tokens are masked in with their log-probs; the environment's are not.
    assert list(s.loss_mask).count(1) == sum(1 for lp in s.rollout_logprobs or [] if lp != 0.0)
    assert 0 in list(s.loss_mask)


class Empty:
    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        return Completion(output_ids=[], logprobs=[], finish_reason=FinishReason("stop", matched=2))


async def test_empty_completion_is_a_failed_sample(smollm2: ChatTokenizer) -> None:
    s = await one_sample(Echo(), tasks(1), Empty(), smollm2)
    assert s.error_type == "GenerationError" and "empty completion" in (s.reason or "")


class Aborting:
    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        return Completion(
            output_ids=[5, 6],
            logprobs=[-1.0, -1.0],
            finish_reason=FinishReason("abort", message="weights updating"),
        )


async def test_abort_gives_aborted_sample(smollm2: ChatTokenizer) -> None:
    s = await one_sample(Echo(), tasks(1), Aborting(), smollm2)
    assert s.status is Status.ABORTED and s.reason == "weights updating"


class Raw(Environment):
    """A custom rollout that returns the wrong thing."""

    async def rollout(self, task: Task, episode: Episode) -> Sequence[Sample]:
        t = episode.transcript(task.prompt)  # type: ignore[arg-type]
        await episode.generate(t)
        return ["not a sample"]  # type: ignore[list-item]


async def test_rollout_returning_garbage_is_a_failed_sample(smollm2: ChatTokenizer) -> None:
    sink = ListSink()
    await run_rollouts(
        Raw(), tasks(1), ScriptedModel(smollm2, lambda c: "x"), tokenizer=smollm2, sink=sink
    )
    assert sink.samples[0].error_type == "ConfigError"
    assert "must return Sample objects" in (sink.samples[0].reason or "")


async def test_concurrency_is_bounded_and_run_is_cancellable(smollm2: ChatTokenizer) -> None:
    in_flight = peak = 0

    class Slow:
        async def generate(
            self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
        ) -> Completion:
            nonlocal in_flight, peak
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                await anyio.sleep(0.01)
            finally:
                in_flight -= 1
            return Completion(
                output_ids=[2], logprobs=[-0.1], finish_reason=FinishReason("stop", matched=2)
            )

    await run_rollouts(
        Echo(), tasks(40), Slow(), tokenizer=smollm2, config=RolloutConfig(concurrency=7)
    )
    assert peak == 7
    started = anyio.Event()

    class FirstPut(ListSink):
        async def put_group(self, samples: Sequence[Sample]) -> None:
            await super().put_group(samples)
            started.set()

    sink = FirstPut()
    with anyio.fail_after(60):  # cancelled once groups arrive, whatever the machine's load
        async with anyio.create_task_group() as tg:

            async def cancel_when_started() -> None:
                await started.wait()
                tg.cancel_scope.cancel()

            tg.start_soon(cancel_when_started)
            await run_rollouts(
                Echo(),
                tasks(10_000),
                Slow(),
                tokenizer=smollm2,
                sink=sink,
                config=RolloutConfig(concurrency=8),
            )
    assert in_flight == 0 and 0 < len(sink.samples) < 10_000


async def test_group_rewards_see_the_whole_group(smollm2: ChatTokenizer) -> None:
    def shortest_bonus(task: Task, samples: Sequence[Sample]) -> list[float]:
        shortest = min(len(s.completion_ids) for s in samples)
        return [1.0 if len(s.completion_ids) == shortest else 0.0 for s in samples]

    class Grouped(SingleTurnEnv):
        rubric = Rubric(group=[(shortest_bonus, 0.5)])

    replies = iter(["a", "a b c", "a b"])
    model = ScriptedModel(smollm2, lambda ctx: next(replies))
    sink = ListSink()
    await run_rollouts(
        Grouped(),
        tasks(1),
        model,
        tokenizer=smollm2,
        sink=sink,
        config=RolloutConfig(n_samples_per_prompt=3, concurrency=1),
    )
    assert sorted(s.reward for s in sink.samples) == [0.0, 0.0, 0.5]


async def test_duplicate_task_ids_rejected(smollm2: ChatTokenizer) -> None:
    from agentenv import ConfigError

    with pytest.raises(ConfigError, match="unique"):
        await run_rollouts(Echo(), [Task(id="a"), Task(id="a")], Empty(), tokenizer=smollm2)


async def test_jsonl_sink_round_trips(smollm2: ChatTokenizer, tmp_path) -> None:  # type: ignore[no-untyped-def]
    path = tmp_path / "out" / "samples.jsonl"
    with JsonlSink(path) as sink:
        await run_rollouts(
            Echo(), tasks(3), ScriptedModel(smollm2, say_number), tokenizer=smollm2, sink=sink
        )
    lines = path.read_text().splitlines()
    assert len(lines) == 3
    assert all(Sample.from_json(line).reward == 1.0 for line in lines)


# -- tools ----------------------------------------------------------------------------------
@tool(timeout_s=0.2)
async def slow_tool(x: int) -> int:
    """Sleeps too long."""
    await anyio.sleep(5)
    return x


@tool
def broken(x: int) -> int:
    """Always raises."""
    raise RuntimeError("disk on fire")


@tool
async def double(x: int) -> int:
    """Double a number.

    Args:
        x: the number.
    """
    return 2 * x


class Tools(ToolEnv):
    tools = (double, broken, slow_tool)
    max_turns = 10
    rubric = Rubric(lambda task, state: 1.0 if "84" in state.completion else 0.0)


async def test_tool_errors_go_back_to_the_model(smollm2: ChatTokenizer) -> None:
    script = iter(
        [
            "<tool_call>{not json}</tool_call>",
            '<tool_call>{"name": "nope", "arguments": {}}</tool_call>',
            '<tool_call>{"name": "double", "arguments": {"x": "forty"}}</tool_call>',
            '<tool_call>{"name": "broken", "arguments": {"x": 1}}</tool_call>',
            '<tool_call>{"name": "slow_tool", "arguments": {"x": 1}}</tool_call>',
            '<tool_call>{"name": "double", "arguments": {"x": 42}}</tool_call>',
            "The answer is 84.",
        ]
    )
    model = ScriptedModel(smollm2, lambda ctx: next(script))
    s = await one_sample(Tools(), tasks(1), model, smollm2)
    assert s.status is Status.COMPLETED and s.reward == 1.0
    assert s.metadata["tool_calls"] == 6 and s.metadata["tool_errors"] == 5
    text = smollm2.decode(s.completion_ids)
    assert "Error: tool call 0 is not valid JSON" in text
    assert "Error: unknown tool 'nope'; available tools: ['broken', 'double', 'slow_tool']" in text
    assert "Error: invalid arguments for 'double': x:" in text
    assert "Error: tool 'broken' raised RuntimeError: disk on fire" in text
    assert "Error: tool 'slow_tool' timed out after 0.2 s" in text
    assert "<|im_start|>tool\n84<|im_end|>" in text
    # The tools were described to the model (SmolLM2's template has no tool support).
    assert '"name": "double"' in smollm2.decode(s.prompt_ids)


async def test_tools_see_their_own_episode_in_concurrent_episodes(smollm2: ChatTokenizer) -> None:
    n = 4
    arrived, everyone = 0, anyio.Event()

    @tool
    async def check(answer: int, task: Task, state: State) -> str:
        """Check an answer against the task.

        Args:
            answer: the proposed answer.
        """
        nonlocal arrived
        arrived += 1
        if arrived == n:
            everyone.set()
        await everyone.wait()  # every episode's call is in flight before any returns
        state.info["checked"] = task.id
        return f"{task.id}: {'right' if str(answer) == task.answer else 'wrong'}"

    class Checked(ToolEnv):
        tools = (check,)
        rubric = Rubric(lambda task, state: 1.0 if "right" in state.completion else 0.0)

    rules = [
        (r"say (\d+)", '<tool_call>{"name": "check", "arguments": {"answer": \\1}}</tool_call>'),
        (r"<\|im_start\|>tool\n([^<]*)<\|im_end\|>", r"\1"),
    ]
    sink = ListSink()
    config = RolloutConfig(concurrency=n)
    await run_rollouts(Checked(), tasks(n), ScriptedModel(smollm2, rules), sink=sink, config=config)
    assert sorted(s.task_id or "" for s in sink.samples) == [f"t{i}" for i in range(n)]
    for s in sink.samples:
        assert s.metadata["checked"] == s.task_id
        assert smollm2.decode(s.completion_ids).endswith(f"{s.task_id}: right<|im_end|>")
        assert s.reward == 1.0


# -- multi-agent ----------------------------------------------------------------------------
async def test_fixed_opponent_policy_per_role(smollm2: ChatTokenizer) -> None:
    from environments.word_guess import GUESSER, WordGuessEnv

    giver = ScriptedModel(smollm2, lambda ctx: "A keyboard instrument.", weight_version="7")
    guesser = ScriptedModel(smollm2, lambda ctx: "piano", weight_version="frozen")
    sink = ListSink()
    await run_rollouts(
        WordGuessEnv(),
        [Task(id="p", answer="piano")],
        giver,
        tokenizer=smollm2,
        sink=sink,
        policies={GUESSER: guesser},
    )
    versions = {s.role: s.weight_versions for s in sink.samples}
    assert versions == {"clue_giver": ["7"], "guesser": ["frozen"]}
    assert all(s.reward == 1.0 for s in sink.samples)


async def test_transcripts_of_one_role_generate_under_their_own_rids(
    smollm2: ChatTokenizer,
) -> None:
    rids: list[str | None] = []

    def script(ctx: Any) -> str:
        rids.append(ctx.rid)
        return "ok"

    episode = Episode(task=Task(id="t"), tokenizer=smollm2, policy=ScriptedModel(smollm2, script))
    first, second = episode.transcript("a"), episode.transcript("b")
    async with anyio.create_task_group() as tg:  # parallel sub-agents, both at turn 0
        tg.start_soon(episode.generate, first)
        tg.start_soon(episode.generate, second)
    assert sorted(r or "" for r in rids) == ["t/0/policy/0", "t/0/policy/0/1"]


class _LongEnv(SingleTurnEnv):
    rubric = Rubric(lambda task, state: 1.0)
    sampling: ClassVar[Mapping[str, Any]] = {"max_new_tokens": 6, "temperature": 0.5}

    def tasks(self, split: str = "train") -> list[Task]:
        return [Task(id="t", prompt="say it")]


def test_the_run_sampling_wins_over_the_environments_which_wins_over_defaults(
    smollm2: ChatTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    from agentenv import resolve_sampling, run

    env = _LongEnv()
    seen: list[SamplingParams] = []

    class Recording(ScriptedModel):
        async def generate(self, input_ids: Any, params: SamplingParams, **kw: Any) -> Any:
            seen.append(params)
            return await super().generate(input_ids, params, **kw)

    model = Recording(smollm2, lambda ctx: "word " * 50)
    # Nothing given: the environment's defaults over SamplingParams'.
    assert [len(s.completion_ids) for s in run(env, model).samples] == [6]
    assert (seen[-1].max_new_tokens, seen[-1].temperature) == (6, 0.5)
    # A SamplingParams given is used as it is: the environment no longer overrides it.
    samples = run(env, model, sampling=SamplingParams(max_new_tokens=3)).samples
    assert [len(s.completion_ids) for s in samples] == [3]
    assert (seen[-1].max_new_tokens, seen[-1].temperature) == (3, 1.0)
    # Field by field: what was given explicitly wins, and a disagreement is logged.
    mixed = resolve_sampling(env, SamplingParams(max_new_tokens=3), {"max_new_tokens": "mine"})
    assert (mixed.max_new_tokens, mixed.temperature) == (3, 0.5)
    assert "mine wins over _LongEnv.sampling's max_new_tokens=6" in caplog.text


def test_an_environments_sampling_must_name_sampling_parameters() -> None:
    from agentenv import resolve_sampling

    class Bad(_LongEnv):
        sampling: ClassVar[Mapping[str, Any]] = {"max_tokens": 6}

    with pytest.raises(ConfigError, match=r"Bad.sampling names \['max_tokens'\], which are"):
        resolve_sampling(Bad(), SamplingParams())

    class Worse(_LongEnv):
        sampling: ClassVar[Mapping[str, Any]] = {"top_p": 2.0}

    with pytest.raises(ConfigError, match=r"Worse.sampling: top_p must be in \(0, 1\], got 2.0"):
        resolve_sampling(Worse(), SamplingParams())
