"""How calls become transcripts: extensions append, rewrites start a segment, concurrent
branches get their own, log-probs come back as the generator's."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import anyio
import httpx
import pytest

import agentenv
from agentenv import (
    ChatTokenizer,
    Completion,
    Episode,
    Rubric,
    SamplingParams,
    ScriptedModel,
    Status,
    Task,
)
from agentenv._scripted import scripted_logprob
from agentenv.endpoint import AgentEnv, AgentServer

from .test_env import ADD_TOOL, calculator_script

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _post(http: httpx.AsyncClient, url: str, messages: list[Any], **extra: Any) -> Any:
    return http.post(f"{url}/chat/completions", json={"messages": messages, **extra})


class RawEnv(AgentEnv):
    """An environment whose agent is a function of (task, base_url), set per test."""

    rubric = Rubric()
    client_kind = "base_url"
    agent: Any = None

    async def run_agent(self, task: Task, client: Any) -> str:
        async with httpx.AsyncClient() as http:
            return str(await self.agent(http, client))


def run(agent: Any, tok: ChatTokenizer, **kwargs: Any) -> agentenv.RolloutResult:
    env = RawEnv()
    env.agent = agent
    model = kwargs.pop("model", None) or ScriptedModel(tok, calculator_script)
    return agentenv.run(env, model, tasks=[Task(id="t", prompt="")], **kwargs)


def test_logprobs_returned_are_the_generators(smollm2: ChatTokenizer) -> None:
    got: list[Any] = []

    async def agent(http: httpx.AsyncClient, url: str) -> str:
        r = await _post(
            http, url, [{"role": "user", "content": "hi"}], logprobs=True, top_logprobs=1
        )
        body = r.json()
        got.append(body)
        return str(body["choices"][0]["message"]["content"])

    (sample,) = run(agent, smollm2).samples
    content = got[0]["choices"][0]["logprobs"]["content"]
    assert [c["logprob"] for c in content] == list(sample.rollout_logprobs or [])
    start = len(sample.prompt_ids)
    assert list(sample.rollout_logprobs or []) == [
        scripted_logprob(t, start + i) for i, t in enumerate(sample.completion_ids)
    ]
    assert [c["token"] for c in content] == [smollm2.decode([t]) for t in sample.completion_ids]
    assert got[0]["usage"]["prompt_tokens"] == start
    assert got[0]["usage"]["completion_tokens"] == len(sample.completion_ids)
    assert got[0]["system_fingerprint"] == "scripted"


def test_a_rewrite_by_the_agent_starts_a_new_segment(smollm2: ChatTokenizer) -> None:
    async def agent(http: httpx.AsyncClient, url: str) -> str:
        system = {"role": "system", "content": "You add numbers."}
        first = [system, {"role": "user", "content": "What is 2+3?"}]
        r = (await _post(http, url, first, tools=[ADD_TOOL])).json()
        reply = r["choices"][0]["message"]
        call = reply["tool_calls"][0]
        tool = {"role": "tool", "tool_call_id": call["id"], "content": "5"}
        # The agent summarises the question: the history the model saw is edited.
        edited = [system, {"role": "user", "content": "Sum: 2+3"}, reply, tool]
        r = (await _post(http, url, edited, tools=[ADD_TOOL])).json()
        return str(r["choices"][0]["message"]["content"])

    samples = run(agent, smollm2).samples
    assert [s.metadata.get("segment") for s in samples] == [0, 1]
    first, second = samples
    assert sum(first.loss_mask or []) > 0 and sum(second.loss_mask or []) > 0
    # The second segment's prompt is the edited conversation, rendered afresh.
    assert "Sum: 2+3" in smollm2.decode(second.prompt_ids)
    assert smollm2.decode(second.completion_ids).startswith("The answer is 5.")


def test_a_rewrite_under_the_error_policy_is_refused(smollm2: ChatTokenizer) -> None:
    answers: list[Any] = []

    async def agent(http: httpx.AsyncClient, url: str) -> str:
        first = [{"role": "user", "content": "What is 2+3?"}]
        reply = (await _post(http, url, first, tools=[ADD_TOOL])).json()["choices"][0]["message"]
        tool = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "5"}
        r = await _post(
            http, url, [{"role": "user", "content": "2+3"}, reply, tool], tools=[ADD_TOOL]
        )
        answers.append((r.status_code, r.json()))
        return ""

    config = agentenv.RolloutConfig(on_history_rewrite="error")
    (sample,) = run(agent, smollm2, config=config).samples
    status, body = answers[0]
    assert status == 400 and body["error"]["code"] == "history_rewritten"
    assert "renders the conversation differently" in body["error"]["message"]
    assert sample.status is Status.COMPLETED and sample.metadata["turns"] == 1


class Gate:
    """A generator that holds every call until ``n`` are in flight (a real concurrency)."""

    def __init__(self, inner: ScriptedModel, n: int) -> None:
        self.inner, self.n, self.tokenizer = inner, n, inner.tokenizer
        self.waiting = 0
        self.open = anyio.Event()

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        self.waiting += 1
        if self.waiting >= self.n:
            self.open.set()
        await self.open.wait()
        return await self.inner.generate(input_ids, params, rid=rid)


def test_concurrent_branches_from_one_prefix_are_their_own_segments(
    smollm2: ChatTokenizer,
) -> None:
    async def agent(http: httpx.AsyncClient, url: str) -> str:
        first = [{"role": "user", "content": "What is 2+3?"}]
        reply = (await _post(http, url, first, tools=[ADD_TOOL])).json()["choices"][0]["message"]
        call_id = reply["tool_calls"][0]["id"]

        async def branch(result: str) -> None:
            tool = {"role": "tool", "tool_call_id": call_id, "content": result}
            await _post(http, url, [*first, reply, tool], tools=[ADD_TOOL])

        async with anyio.create_task_group() as tg:
            tg.start_soon(branch, "5")
            tg.start_soon(branch, "6")
        return ""

    env = RawEnv()
    env.agent = agent

    class TwoStep(Gate):
        async def generate(
            self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
        ) -> Completion:
            if self.inner.calls == 0:
                return await self.inner.generate(input_ids, params, rid=rid)
            return await super().generate(input_ids, params, rid=rid)

    model = TwoStep(ScriptedModel(smollm2, calculator_script), n=2)
    result = agentenv.run(env, model, tasks=[Task(id="t", prompt="")], tokenizer=smollm2)
    samples = result.samples
    assert len(samples) == 2
    texts = sorted(smollm2.decode(s.prompt_ids + s.completion_ids) for s in samples)
    assert any("The answer is 5." in t for t in texts)
    assert any("The answer is 6." in t for t in texts)
    # One branch extends the first call's ids (two model turns), the other starts afresh.
    assert sorted(s.metadata["turns"] for s in samples) == [1, 2]


async def test_an_ended_episode_answers_410(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, calculator_script)
    server = AgentServer()

    def episode() -> Episode:
        return Episode(task=Task(id="t"), tokenizer=smollm2, policy=model)

    async with server.open(episode()) as keep, httpx.AsyncClient() as http:
        async with server.open(episode()) as gone:
            url = gone.base_url
            ok = await _post(http, url, [{"role": "user", "content": "hi"}])
            assert ok.status_code == 200
        r = await _post(http, url, [{"role": "user", "content": "hi"}])
        assert r.status_code == 410
        assert r.json()["error"]["code"] == "episode_ended"
        models = await http.get(f"{keep.base_url}/models")
        assert models.json()["data"][0]["id"] == "policy"
        assert (await http.get(f"{url}/models")).status_code == 410


async def test_each_role_has_its_own_endpoint_and_samples(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, calculator_script)
    episode = Episode(task=Task(id="t"), tokenizer=smollm2, policy=model)
    server = AgentServer()
    async with server.open(episode) as endpoint, httpx.AsyncClient() as http:
        critic = endpoint.role("critic")
        assert critic is endpoint.role("critic") and critic.base_url != endpoint.base_url
        await _post(http, endpoint.base_url, [{"role": "user", "content": "hi"}])
        await _post(http, critic.base_url, [{"role": "user", "content": "judge"}])
    assert [t.role for t in episode.transcripts] == [None, "critic"]
    assert critic.recorder.closed and critic.recorder.calls == 1
    samples = [s for t in episode.transcripts for s in episode.samples(t, 1.0)]
    assert [s.role for s in samples] == [None, "critic"]
