"""Rewards: weighted rubrics, sync/async/blocking reward functions, value checks, group rewards."""

from __future__ import annotations

import math
import threading
from collections.abc import Awaitable, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import pytest

from agentenv import (
    ChatTokenizer,
    Completion,
    ConfigError,
    FinishReason,
    Limits,
    ListSink,
    RewardError,
    RolloutConfig,
    Rubric,
    Sample,
    ScriptedModel,
    SingleTurnEnv,
    State,
    Status,
    Task,
    Transcript,
    reward,
    run_rollouts,
)

TASK = Task(id="t1", prompt="What is 2+2?", answer="4")


def state(info: dict[str, Any] | None = None) -> State:
    # These reward functions read only the task and ``info``; no transcript or episode needed.
    return State(TASK, None, None, info or {})  # type: ignore[arg-type]


def correct(task: Task, state: State) -> float:
    return 1.0 if state.info.get("answer") == task.answer else 0.0


def brevity(task: Task, state: State) -> float:
    return -float(state.info.get("length", 0))


async def judged(task: Task, state: State) -> float:
    await anyio.lowlevel.checkpoint()
    return 0.5


def samples(n: int) -> list[Sample]:
    return [Sample(prompt_ids=[1], completion_ids=[2] * (i + 1), reward=0.0) for i in range(n)]


# -- Rubric.score ------------------------------------------------------------------------


@pytest.mark.anyio
async def test_weighted_sum_and_components() -> None:
    rubric = Rubric(correct, (brevity, 0.1))
    total, parts = await rubric.score(TASK, state({"answer": "4", "length": 20}))
    assert parts == {"correct": 1.0, "brevity": -20.0}
    assert total == pytest.approx(1.0 + 0.1 * -20.0)


@pytest.mark.anyio
async def test_components_are_raw_values_not_weighted() -> None:
    rubric = Rubric((correct, 3), (brevity, -2))
    total, parts = await rubric.score(TASK, state({"answer": "4", "length": 1}))
    assert parts == {"correct": 1.0, "brevity": -1.0}
    assert total == 3 * 1.0 + -2 * -1.0
    assert rubric.funcs == [(correct, 3.0), (brevity, -2.0)]
    assert all(type(w) is float for _, w in rubric.funcs)


@pytest.mark.anyio
async def test_empty_rubric_scores_zero() -> None:
    assert await Rubric().score(TASK, state()) == (0.0, {})


@pytest.mark.anyio
async def test_async_reward_function() -> None:
    total, parts = await Rubric(judged, (correct, 2.0)).score(TASK, state({"answer": "4"}))
    assert parts == {"judged": 0.5, "correct": 1.0}
    assert total == 2.5


@pytest.mark.anyio
async def test_int_reward_becomes_float() -> None:
    def count(task: Task, state: State) -> int:
        return 3

    total, parts = await Rubric(count).score(TASK, state())
    assert parts == {"count": 3.0}
    assert type(parts["count"]) is float
    assert type(total) is float


@pytest.mark.anyio
async def test_reward_reads_a_real_transcript(smollm2: ChatTokenizer) -> None:
    def says_four(task: Task, state: State) -> float:
        return float(state.completion.strip() == task.answer)

    transcript = Transcript(smollm2, TASK.prompt)
    ids = [*smollm2.encode("4"), smollm2.eos_token_id]
    transcript.add_completion(
        Completion(
            output_ids=ids,
            logprobs=[-0.1] * len(ids),
            finish_reason=FinishReason("stop", matched=smollm2.eos_token_id),
        )
    )
    st = State(TASK, transcript, None)  # type: ignore[arg-type]
    assert await Rubric(says_four).score(TASK, st) == (1.0, {"says_four": 1.0})


BAD_VALUES = [
    (math.nan, "returned nan; it must be finite"),
    (math.inf, "returned inf; it must be finite"),
    (-math.inf, "returned -inf; it must be finite"),
    (None, "returned NoneType None"),
    ("1", "returned str '1'"),
    ([1.0], r"returned list \[1.0\]"),
    pytest.param(10**400, "returned an int beyond float range", id="huge-int"),
]


@pytest.mark.anyio
@pytest.mark.parametrize(("value", "message"), BAD_VALUES)
async def test_bad_reward_values_name_the_function(value: Any, message: str) -> None:
    def shaky(task: Task, state: State) -> Any:
        return value

    with pytest.raises(RewardError, match=rf"reward function 'shaky' {message}"):
        await Rubric(correct, shaky).score(TASK, state())


@pytest.mark.anyio
async def test_bad_value_from_async_function_names_it() -> None:
    async def flaky(task: Task, state: State) -> float:
        return math.nan

    with pytest.raises(RewardError, match="'flaky' returned nan"):
        await Rubric(flaky).score(TASK, state())


# -- reward(...) decorator ------------------------------------------------------------------


@pytest.mark.anyio
async def test_blocking_reward_runs_in_a_worker_thread() -> None:
    seen: list[int] = []

    @reward(blocking=True)
    def verify(task: Task, state: State) -> float:
        seen.append(threading.get_ident())
        return 1.0

    total, parts = await Rubric(verify).score(TASK, state())
    assert (total, parts) == (1.0, {"verify": 1.0})
    assert seen
    assert seen[0] != threading.get_ident()


@pytest.mark.anyio
async def test_blocking_reward_does_not_block_the_loop() -> None:
    started, released = threading.Event(), threading.Event()

    @reward(blocking=True)
    def slow_verifier(task: Task, state: State) -> float:
        started.set()
        # Only a task on the event loop releases it: a reward that blocked the loop waits
        # out the bound and scores 0.
        return 1.0 if released.wait(60) else 0.0

    async def release() -> None:
        await anyio.to_thread.run_sync(started.wait, abandon_on_cancel=True)
        released.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release)
        assert await Rubric(slow_verifier).score(TASK, state()) == (1.0, {"slow_verifier": 1.0})


@pytest.mark.anyio
async def test_blocking_reward_values_are_checked() -> None:
    @reward(blocking=True)
    def nothing(task: Task, state: State) -> Any:
        return None

    with pytest.raises(RewardError, match="'nothing' returned NoneType None"):
        await Rubric(nothing).score(TASK, state())


@pytest.mark.anyio
async def test_blocking_reward_with_name() -> None:
    @reward(blocking=True, name="unit_tests")
    def run_tests(task: Task, state: State) -> float:
        return 0.25

    assert run_tests.__name__ == "unit_tests"
    assert await Rubric(run_tests).score(TASK, state()) == (0.25, {"unit_tests": 0.25})


@pytest.mark.anyio
async def test_reward_name_renames_the_component() -> None:
    fn = reward(name="exact_match")(lambda task, state: 1.0)
    _, parts = await Rubric(fn).score(TASK, state())
    assert parts == {"exact_match": 1.0}


def test_reward_without_options_returns_the_function_itself() -> None:
    assert reward()(correct) is correct


def test_blocking_async_reward_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="reward 'judged' is async; blocking=True is for sync"):
        reward(blocking=True)(judged)


# -- configuration errors ----------------------------------------------------------------------


@pytest.mark.parametrize("weight", [math.nan, math.inf, -math.inf, "1", True, None, [1.0]])
def test_bad_weights_are_config_errors(weight: Any) -> None:
    with pytest.raises(ConfigError, match=r"weight for 'correct' must be a finite number, got"):
        Rubric((correct, weight))
    with pytest.raises(ConfigError, match=r"weight for .shortest. must be a finite number, got"):
        Rubric(group=[(shortest, weight)])


@pytest.mark.parametrize("item", [(correct,), (correct, 1.0, 2.0), ()])
def test_weighted_reward_must_be_a_pair(item: tuple[Any, ...]) -> None:
    with pytest.raises(ConfigError, match=r"a \(function, weight\) pair"):
        Rubric(item)  # type: ignore[arg-type]


@pytest.mark.parametrize("item", [1.0, "correct", (1.0, correct)])
def test_reward_must_be_callable(item: Any) -> None:
    with pytest.raises(ConfigError, match="a reward must be callable"):
        Rubric(item)


def test_duplicate_component_names_are_a_config_error() -> None:
    # Components are keyed by name; a second "correct" would overwrite the first's value.
    with pytest.raises(ConfigError, match=r"names must be unique, got \['correct'\]"):
        Rubric(correct, (correct, 0.5))
    with pytest.raises(ConfigError, match=r"\['<lambda>'\]"):
        Rubric(lambda t, s: 1.0, lambda t, s: 0.0)
    Rubric(correct, (reward(name="correct_again")(lambda t, s: 0.0), 0.5))  # the fix works


def test_group_given_as_a_bare_function_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="group must be a list of group reward functions"):
        Rubric(group=shortest)  # type: ignore[arg-type]


def test_negative_and_zero_weights_are_allowed() -> None:
    assert Rubric((correct, -1), (brevity, 0)).funcs == [(correct, -1.0), (brevity, 0.0)]


# -- group rewards ------------------------------------------------------------------------------


def shortest(task: Task, group: Sequence[Sample]) -> list[float]:
    best = min(len(s.completion_ids) for s in group)
    return [1.0 if len(s.completion_ids) == best else 0.0 for s in group]


async def rank(task: Task, group: Sequence[Sample]) -> list[float]:
    await anyio.lowlevel.checkpoint()
    return [float(i) for i in range(len(group))]


@pytest.mark.anyio
async def test_group_rewards_weighted_and_summed() -> None:
    rubric = Rubric(correct, group=[(shortest, 0.5), rank])
    assert await rubric.score_group(TASK, samples(3)) == [0.5 + 0.0, 0.0 + 1.0, 0.0 + 2.0]


@pytest.mark.anyio
async def test_group_rewards_default_to_zero() -> None:
    assert await Rubric(correct).score_group(TASK, samples(4)) == [0.0] * 4
    assert await Rubric(group=[rank]).score_group(TASK, []) == []


@pytest.mark.anyio
async def test_group_reward_may_return_any_sequence() -> None:
    def as_tuple(task: Task, group: Sequence[Sample]) -> tuple[int, ...]:
        return tuple(range(len(group)))

    assert await Rubric(group=[(as_tuple, 2)]).score_group(TASK, samples(2)) == [0.0, 2.0]


@pytest.mark.anyio
@pytest.mark.parametrize("returned", [[1.0], [1.0, 2.0, 3.0], []])
async def test_group_reward_lengths_are_checked(returned: list[float]) -> None:
    def wrong(task: Task, group: Sequence[Sample]) -> list[float]:
        return returned

    with pytest.raises(RewardError, match=rf"'wrong' returned {len(returned)} values for 2 sam"):
        await Rubric(group=[wrong]).score_group(TASK, samples(2))


@pytest.mark.anyio
async def test_group_reward_returning_one_number_names_the_function() -> None:
    async def average(task: Task, group: Sequence[Sample]) -> float:
        return 0.5

    with pytest.raises(RewardError, match=r"group reward 'average' returned float 0\.5"):
        await Rubric(group=[average]).score_group(TASK, samples(2))


@pytest.mark.anyio
@pytest.mark.parametrize(("value", "message"), BAD_VALUES)
async def test_bad_group_values_name_the_function(value: Any, message: str) -> None:
    def odd(task: Task, group: Sequence[Sample]) -> list[Any]:
        return [0.0, value]

    with pytest.raises(RewardError, match=rf"reward function 'odd' {message}"):
        await Rubric(group=[odd]).score_group(TASK, samples(2))


def test_numpy_scalars_are_numbers() -> None:
    import numpy as np

    from agentenv._rewards import check_reward

    assert check_reward(np.float32(0.5), "np") == 0.5
    assert check_reward(np.int64(2), "np") == 2.0
    assert Sample(prompt_ids=[1], completion_ids=[2], reward=np.float32(1.0)).reward == 1.0


def test_a_reward_function_of_the_wrong_shape_is_refused_naming_the_signature() -> None:
    def one_arg(state: State) -> float:
        return 1.0

    with pytest.raises(ConfigError, match=r"def one_arg\(task, state\) -> float"):
        Rubric(one_arg)
    with pytest.raises(ConfigError, match=r"def one_arg\(task, samples\) -> float"):
        Rubric(group=[one_arg])

    def any_args(*args: Any) -> float:
        return 1.0

    def with_default(task: Task, state: State, extra: int = 0) -> float:
        return 1.0

    Rubric(any_args, with_default)  # these can be called so


def test_a_bare_weight_names_the_pair() -> None:
    with pytest.raises(ConfigError, match=r"Rubric\(\(my_reward, 0.5\)\)"):
        Rubric(lambda task, state: 1.0, 0.5)  # type: ignore[arg-type]


# -- bool rewards ----------------------------------------------------------------------------


@pytest.mark.anyio
async def test_bool_rewards_count_as_one_and_zero() -> None:
    def matches(task: Task, state: State) -> bool:
        return state.info.get("answer") == task.answer

    def firsts(task: Task, group: Sequence[Sample]) -> list[bool]:
        return [i == 0 for i in range(len(group))]

    assert await Rubric(matches).score(TASK, state({"answer": "4"})) == (1.0, {"matches": 1.0})
    assert await Rubric(matches).score(TASK, state({"answer": "5"})) == (0.0, {"matches": 0.0})
    assert await Rubric(group=[firsts]).score_group(TASK, samples(2)) == [1.0, 0.0]


# -- what a reward function raises fails its sample, never the run ---------------------------


class Halt(BaseException):
    """A BaseException of the user's own (neither an Exception nor a cancellation)."""


@pytest.mark.anyio
@pytest.mark.parametrize("error", [SystemExit(3), GeneratorExit(), Halt("stop")])
@pytest.mark.parametrize("kind", ["sync", "async", "group"])
async def test_a_base_exception_from_a_reward_function_is_a_reward_error(
    error: BaseException, kind: str
) -> None:
    def quits(task: Task, state: Any) -> float:
        raise error

    async def quits_async(task: Task, state: State) -> float:
        raise error

    if kind == "group":
        scoring: Awaitable[Any] = Rubric(group=[quits]).score_group(TASK, samples(2))
    else:
        scoring = Rubric(quits if kind == "sync" else quits_async).score(TASK, state())
    name = type(error).__name__
    with pytest.raises(RewardError, match=rf"reward function 'quits\w*' raised {name}"):
        await scoring


@pytest.mark.anyio
async def test_keyboard_interrupt_from_a_reward_function_still_stops() -> None:
    async def interrupted(task: Task, state: State) -> float:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        await Rubric(interrupted).score(TASK, state())


# -- sync reward functions run in worker threads ---------------------------------------------


@pytest.mark.anyio
async def test_eight_sync_rewards_run_at_once_off_the_event_loop() -> None:
    # Each waits for all eight: on the event loop one after another, the first would
    # wait alone until the barrier's timeout broke it.
    barrier = threading.Barrier(8, timeout=30)
    loop_thread = threading.get_ident()
    threads: set[int] = set()

    def slow_verifier(task: Task, state: State) -> float:
        threads.add(threading.get_ident())
        barrier.wait()
        return 1.0

    rubric = Rubric(slow_verifier)
    results: list[tuple[float, dict[str, float]]] = []

    async def one() -> None:
        results.append(await rubric.score(TASK, state()))

    async with anyio.create_task_group() as tg:
        for _ in range(8):
            tg.start_soon(one)
    assert results == [(1.0, {"slow_verifier": 1.0})] * 8
    assert len(threads) == 8 and loop_thread not in threads


@pytest.mark.anyio
async def test_max_threads_bounds_the_sync_rewards_at_once() -> None:
    lock = threading.Lock()
    barrier = threading.Barrier(2, timeout=30)  # two at a time must meet
    running = peak = 0

    def verify(task: Task, state: State) -> float:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        barrier.wait()
        with lock:
            running -= 1
        return 1.0

    rubric = Rubric(verify, max_threads=2)
    async with anyio.create_task_group() as tg:
        for _ in range(6):
            tg.start_soon(rubric.score, TASK, state())
    assert peak == 2
    with pytest.raises(ConfigError, match="max_threads must be a positive int, got 0"):
        Rubric(verify, max_threads=0)


@pytest.mark.anyio
async def test_a_cancelled_sync_reward_is_abandoned_in_a_daemon_thread() -> None:
    entered, release = threading.Event(), threading.Event()
    returned: list[bool] = []

    def stuck(task: Task, state: State) -> float:
        entered.set()
        release.wait(timeout=30)  # bounded: a loop it blocked would see it return
        returned.append(True)
        return 1.0

    try:
        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(Rubric(stuck).score, TASK, state())
                assert await anyio.to_thread.run_sync(entered.wait, 30)
                scope.cancel()  # what an episode's timeout does
        assert scope.cancelled_caught
        assert not returned  # cancelled while the function still ran
        (thread,) = [t for t in threading.enumerate() if t.name == "reward stuck"]
        assert thread.daemon  # it cannot keep the process alive
    finally:
        release.set()


# -- under the episode timeout, in a run -------------------------------------------------------


class _OneAnswer(SingleTurnEnv):
    pass


async def _run_with_timeout(
    rubric: Rubric, smollm2: ChatTokenizer, n: int, timeout_s: float
) -> list[Sample]:
    env = _OneAnswer()
    env.rubric = rubric
    sink = ListSink()
    config = RolloutConfig(n_samples_per_prompt=n, limits=Limits(timeout_s=timeout_s))
    model = ScriptedModel(smollm2, [], default="4")
    await run_rollouts(env, [TASK], model, tokenizer=smollm2, sink=sink, config=config)
    return sink.samples


@pytest.mark.anyio
async def test_a_sync_reward_that_never_returns_fails_at_the_episode_timeout(
    smollm2: ChatTokenizer,
) -> None:
    entered, release = threading.Event(), threading.Event()
    returned: list[bool] = []

    def never_returns(task: Task, state: State) -> float:
        entered.set()
        release.wait(timeout=30)
        returned.append(True)
        return 1.0

    try:
        # (generous: the episode reaches its reward long before the timeout)
        (sample,) = await _run_with_timeout(Rubric(never_returns), smollm2, 1, 5.0)
        assert entered.is_set() and not returned
        assert sample.status is Status.FAILED and sample.error_type == "EpisodeTimeout"
    finally:
        release.set()


@pytest.mark.anyio
async def test_a_sync_group_reward_that_never_returns_fails_its_group_at_the_timeout(
    smollm2: ChatTokenizer,
) -> None:
    release = threading.Event()
    returned: list[bool] = []

    def never_returns(task: Task, group: Sequence[Sample]) -> list[float]:
        release.wait(timeout=30)
        returned.append(True)
        return [1.0] * len(group)

    try:
        group = await _run_with_timeout(Rubric(group=[never_returns]), smollm2, 2, 1.0)
        assert not returned
        assert {s.status for s in group} == {Status.FAILED}
        assert group[0].reason == "group reward: exceeded the episode timeout of 1.0 s"
    finally:
        release.set()
