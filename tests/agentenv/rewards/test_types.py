"""Rewards by name through an episode: ``reward_rubric`` for each ``--rm-type``,
``remote_rm`` against a local service, ``--custom-rm-path`` functions (sync, async, a
batch) and the bad inputs (an unknown type, no ``--rm-url``, a non-number)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp.web
import pytest

from agentenv import (
    ChatTokenizer,
    ConfigError,
    RewardError,
    Rubric,
    Sample,
    ScriptedModel,
    SingleTurnEnv,
    Status,
    Task,
    run,
    run_rollouts,
)
from agentenv.rewards import MathVerifier, RemoteReward, reward_rubric

pytestmark = pytest.mark.timeout(120)

TASKS = [
    Task(id="a", prompt="What is 1/2 as a decimal?", answer="0.5"),
    Task(id="b", prompt="What is 2+2?", answer="4"),
]


def env_with(rubric: Rubric) -> SingleTurnEnv:
    class Env(SingleTurnEnv):
        pass

    env = Env()
    env.rubric = rubric
    return env


def play(rubric: Rubric, reply: str, smollm2: ChatTokenizer, n: int = 1) -> list[Sample]:
    model = ScriptedModel(smollm2, [], default=reply)
    return run(env_with(rubric), model, tasks=TASKS, n_samples_per_prompt=n).samples


def test_math_by_name_in_an_episode_records_answer_and_reason(smollm2: ChatTokenizer) -> None:
    samples = play(reward_rubric("math"), "It is \\boxed{\\frac{1}{2}}.", smollm2)
    by_task = {s.group_id.split("@")[0]: s for s in samples}
    assert by_task["a"].reward == 1.0 and by_task["b"].reward == 0.0
    assert by_task["a"].metadata["rm_answer"] == "\\frac{1}{2}"
    assert by_task["a"].metadata["rewards"] == {"math": 1.0}
    empty = play(reward_rubric("math"), "", smollm2)
    assert {s.reward for s in empty} == {0.0}
    assert {s.status for s in empty} == {Status.COMPLETED}  # not judged, not a crash
    assert empty[0].metadata["rm_reason"] == "no answer: no \\boxed{} and no number"


def test_a_row_may_name_its_own_type(smollm2: ChatTokenizer) -> None:
    tasks = [Task(id="q", prompt="Capital of France?", answer="Paris", info={"rm_type": "f1"})]
    model = ScriptedModel(smollm2, [], default="the paris")
    out = run(env_with(reward_rubric("math")), model, tasks=tasks).samples
    assert out[0].reward == 1.0 and out[0].metadata["rewards"] == {"math": 1.0}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rm_type": "mathh"}, "--rm-type 'mathh' is not a reward type; known: dapo, deepscaler"),
        ({"rm_type": "remote_rm"}, "--rm-type remote_rm needs --rm-url"),
        ({}, "no reward: pass --rm-type"),
        ({"rm_type": "math", "custom_rm_path": "x:y"}, "both name the reward: pass one"),
        ({"group_rm": True, "rm_type": "math"}, "--group-rm scores whole groups"),
        ({"custom_rm_path": "nowhere_at_all:fn"}, "cannot import 'nowhere_at_all'"),
        ({"custom_rm_path": "json:nope"}, "'json' has no attribute 'nope'"),
        ({"custom_rm_path": "missing.py:fn"}, "--custom-rm-path 'missing.py': no such file"),
        ({"rm_type": "remote_rm", "rm_url": "127.0.0.1:1"}, "--rm-url must start with http"),
    ],
)
def test_bad_reward_flags_are_refused_naming_the_fix(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        reward_rubric(**kwargs)


def write_rewards(tmp_path: Path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(
        "def length(task, state):\n"
        "    return float(len(state.completion))\n"
        "async def exact(task, state):\n"
        "    return 1.0 if state.completion.strip() == str(task.answer) else 0.0\n"
        "def shortest(task, samples):\n"
        "    lengths = [len(s.completion_ids) for s in samples]\n"
        "    return [1.0 if n == min(lengths) else 0.0 for n in lengths]\n"
        "def words(task, state):\n"
        "    return 'one'\n"
        "def quits(task, state):\n"
        "    raise SystemExit(2)\n"
    )
    return path


def test_custom_reward_functions_sync_async_and_a_group(
    tmp_path: Path, smollm2: ChatTokenizer
) -> None:
    path = write_rewards(tmp_path)
    assert {s.reward for s in play(reward_rubric(custom_rm_path=f"{path}:length"), "abcd",
                                    smollm2)} == {4.0}  # fmt: skip
    exact = play(reward_rubric(custom_rm_path=f"{path}:exact"), "4", smollm2)
    assert {s.group_id.split("@")[0]: s.reward for s in exact} == {"a": 0.0, "b": 1.0}
    replies = iter(["one", "one two three four", "one", "one two three four"])
    model = ScriptedModel(smollm2, lambda ctx: next(replies))
    env = env_with(reward_rubric(custom_rm_path=f"{path}:shortest", group_rm=True))
    group = run(env, model, tasks=TASKS[:1], n_samples_per_prompt=4, concurrency=1).samples
    assert sorted(s.reward for s in group) == [0.0, 0.0, 1.0, 1.0]


def test_a_custom_reward_that_returns_a_non_number_fails_its_sample_by_name(
    tmp_path: Path, smollm2: ChatTokenizer
) -> None:
    samples = play(reward_rubric(custom_rm_path=f"{write_rewards(tmp_path)}:words"), "x", smollm2)
    assert {s.status for s in samples} == {Status.FAILED}
    assert "reward function 'words' returned str 'one'" in (samples[0].reason or "")


def test_a_custom_reward_that_raises_system_exit_fails_its_samples_not_the_run(
    tmp_path: Path, smollm2: ChatTokenizer
) -> None:
    samples = play(reward_rubric(custom_rm_path=f"{write_rewards(tmp_path)}:quits"), "x", smollm2)
    assert len(samples) == 2 and {s.status for s in samples} == {Status.FAILED}
    assert "reward function 'quits' raised SystemExit 2" in str(samples[0].reason)


# remote_rm against a service on the loopback.


@pytest.fixture
async def service() -> AsyncIterator[tuple[str, list[dict[str, Any]], dict[str, Any]]]:
    seen: list[dict[str, Any]] = []
    mode: dict[str, Any] = {"fail_first": 0, "answer": "number"}

    async def handle(request: aiohttp.web.Request) -> aiohttp.web.Response:
        body = await request.json()
        seen.append(body)
        if mode["fail_first"] > 0:
            mode["fail_first"] -= 1
            return aiohttp.web.Response(status=503, text="warming up")
        value = 1.0 if body["response"].strip() == str(body["label"]) else 0.0
        answers = {"number": value, "object": {"score": value, "acc": value == 1.0},
                   "garbage": "yes", "status": None}  # fmt: skip
        if mode["answer"] == "status":
            return aiohttp.web.Response(status=422, text="bad payload")
        return aiohttp.web.Response(text=json.dumps(answers[mode["answer"]]))

    app = aiohttp.web.Application()
    app.router.add_post("/reward", handle)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    site = aiohttp.web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"http://127.0.0.1:{port}/reward", seen, mode
    finally:
        await runner.cleanup()


async def play_async(rubric: Rubric, reply: str, smollm2: ChatTokenizer) -> list[Sample]:
    from agentenv import ListSink, RolloutConfig

    sink = ListSink()
    model = ScriptedModel(smollm2, [], default=reply)
    try:
        await run_rollouts(env_with(rubric), TASKS, model, sink=sink, config=RolloutConfig(),
                           tokenizer=smollm2)  # fmt: skip
    finally:
        for fn, _ in rubric.funcs:
            await fn.aclose()  # type: ignore[attr-defined]
    return sink.samples


@pytest.mark.anyio
async def test_remote_rm_posts_slimes_payload_and_reads_a_number_or_a_key(
    service: tuple[str, list[dict[str, Any]], dict[str, Any]], smollm2: ChatTokenizer
) -> None:
    url, seen, mode = service
    samples = await play_async(reward_rubric("remote_rm", rm_url=url), "4", smollm2)
    assert {s.group_id.split("@")[0]: s.reward for s in samples} == {"a": 0.0, "b": 1.0}
    assert sorted(seen, key=lambda b: b["label"]) == [
        {"prompt": "What is 1/2 as a decimal?", "response": "4", "label": "0.5"},
        {"prompt": "What is 2+2?", "response": "4", "label": "4"},
    ]
    mode["answer"] = "object"
    keyed = await play_async(reward_rubric("remote_rm", rm_url=url, reward_key="score"), "4",
                             smollm2)  # fmt: skip
    assert sorted(s.reward for s in keyed) == [0.0, 1.0]
    unkeyed = await play_async(reward_rubric("remote_rm", rm_url=url), "4", smollm2)
    assert {s.status for s in unkeyed} == {Status.FAILED}
    assert "answered an object (keys: ['acc', 'score']); pass --reward-key" in str(
        unkeyed[0].reason
    )


@pytest.mark.anyio
async def test_remote_rm_retries_a_failing_service_then_fails_the_sample(
    service: tuple[str, list[dict[str, Any]], dict[str, Any]],
) -> None:
    url, seen, mode = service
    remote = RemoteReward(url, backoff_s=0.01, max_retries=2)
    payload = {"prompt": "p", "response": "4", "label": "4"}
    mode["fail_first"] = 2
    assert remote.read(await remote.post(payload)) == 1.0 and len(seen) == 3
    mode["fail_first"] = 5
    with pytest.raises(RewardError, match="failed after 3 attempts: RewardError: HTTP 503"):
        await remote.post(payload)
    mode.update(fail_first=0, answer="garbage")
    with pytest.raises(RewardError, match="returned str 'yes'; it must return a finite number"):
        remote.read(await remote.post(payload))
    mode["answer"] = "status"
    with pytest.raises(RewardError, match="HTTP 422: bad payload"):
        await remote.post(payload)
    await remote.aclose()


@pytest.mark.anyio
async def test_remote_rm_that_cannot_be_reached_fails_the_sample(smollm2: ChatTokenizer) -> None:
    remote = RemoteReward("http://127.0.0.1:9/reward", max_retries=1, backoff_s=0.01)
    samples = await play_async(Rubric(remote), "4", smollm2)
    assert {s.status for s in samples} == {Status.FAILED}
    assert "failed after 2 attempts: ConnectError" in str(samples[0].reason)


def test_the_verifier_is_shared_by_the_rubric(smollm2: ChatTokenizer) -> None:
    verifier = MathVerifier(max_workers=1)
    try:
        rubric = reward_rubric("deepscaler", verifier=verifier)
        samples = play(rubric, "<think>hmm</think>\\boxed{0.50}", smollm2)
        assert {s.group_id.split("@")[0]: s.reward for s in samples} == {"a": 1.0, "b": 0.0}
    finally:
        verifier.close()


# remote_rm against hostile services: a huge answer, one that drips, one that never answers.


@pytest.fixture
async def hostile() -> AsyncIterator[tuple[str, dict[str, Any]]]:
    """A raw HTTP service on the loopback whose answer ``mode["kind"]`` picks."""
    mode: dict[str, Any] = {"kind": "huge", "requests": 0}
    release = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(next(
                (line.split(b":")[1] for line in head.split(b"\r\n")
                 if line.lower().startswith(b"content-length")), b"0",
            ))  # fmt: skip
            await reader.readexactly(length)
            mode["requests"] += 1
            kind = mode["kind"]
            if kind == "huge":  # says how long it is
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 5000\r\n\r\n" + b"1" * 5000)
            elif kind == "endless":  # says nothing of its length; 2 MiB before it ends
                writer.write(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n")
                for _ in range(512):
                    writer.write(b"1" * 4096)
                    await writer.drain()
                    await asyncio.sleep(0)
            elif kind == "drip":  # a valid answer, a byte at a time, 20 s in all
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 200\r\n\r\n")
                for _ in range(199):
                    writer.write(b" ")
                    await writer.drain()
                    await asyncio.sleep(0.1)
                writer.write(b"1")
            elif kind == "hang":  # reads the request, never answers
                await release.wait()
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass  # the client gave up, as it should
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}/reward", mode
    finally:
        release.set()
        server.close()
        await server.wait_closed()


PAYLOAD = {"prompt": "p", "response": "1", "label": "1"}


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["huge", "endless"])
async def test_remote_rm_refuses_an_answer_over_its_size_bound(
    hostile: tuple[str, dict[str, Any]], kind: str
) -> None:
    url, mode = hostile
    mode["kind"] = kind
    remote = RemoteReward(url, max_response_bytes=1000, max_retries=2, backoff_s=0.01)
    try:
        with pytest.raises(
            RewardError,
            match="the answer is longer than 1000 bytes; raise the bound with "
            "--rm-max-response-bytes",
        ):
            await remote.post(PAYLOAD)
        assert mode["requests"] == 1  # refused at once, not retried
    finally:
        await remote.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize("kind", ["drip", "hang"])
async def test_remote_rm_has_a_deadline_per_reward_retries_included(
    hostile: tuple[str, dict[str, Any]], kind: str
) -> None:
    url, mode = hostile
    mode["kind"] = kind
    remote = RemoteReward(url, timeout_s=0.5, max_retries=3, backoff_s=0.01)
    try:
        with pytest.raises(
            RewardError,
            match=r"no answer within 0.5 s \(the deadline of one reward, retries included; "
            "raise it with --rm-timeout",
        ):
            await remote.post(PAYLOAD)
    finally:
        await remote.aclose()


@pytest.mark.anyio
async def test_remote_rm_bounds_come_from_the_reward_flags(
    hostile: tuple[str, dict[str, Any]], smollm2: ChatTokenizer
) -> None:
    url, _ = hostile  # its default: a huge answer
    rubric = reward_rubric("remote_rm", rm_url=url, rm_timeout=30.0, rm_max_response_bytes=100)
    samples = await play_async(rubric, "4", smollm2)
    assert {s.status for s in samples} == {Status.FAILED}
    assert "the answer is longer than 100 bytes" in str(samples[0].reason)
    with pytest.raises(ConfigError, match="--rm-timeout must be a positive number"):
        RemoteReward(url, timeout_s=0)
    with pytest.raises(ConfigError, match="--rm-max-response-bytes must be at least 1"):
        RemoteReward(url, max_response_bytes=0)
