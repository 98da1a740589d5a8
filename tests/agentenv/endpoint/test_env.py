"""AgentEnv with real clients: the openai SDK (async and sync, streamed and not, with
tools) and raw httpx. Each checks that the samples' ids decode to exactly the chat
template's rendering of the conversation, that the mask is 1 exactly on generated
tokens, that the log-probs are the generator's, and that a rewrite starts a segment."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import anyio
import httpx
import openai
import pytest

import agentenv
from agentenv import ChatTokenizer, Rubric, Sample, ScriptedModel, State, Status, Task
from agentenv._scripted import ScriptContext, scripted_logprob
from agentenv.endpoint import AgentEnv

pytestmark = pytest.mark.timeout(60)

ADD_TOOL = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def calculator_script(ctx: ScriptContext) -> str:
    """Call add for 'What is A+B?', then answer with the tool's result."""
    text = ctx.text
    result = re.findall(r"(?:tool_response>\n|tool\n)(-?\d+)", text)
    if result:
        return f"The answer is {result[-1]}."
    m = re.findall(r"What is (\d+)\+(\d+)\?", text)
    if m:
        a, b = m[-1]
        args = json.dumps({"name": "add", "arguments": {"a": int(a), "b": int(b)}})
        return f"Let me add.<tool_call>{args}</tool_call>"
    return "I do not know."


def answer(task: Task, state: State) -> float:
    return 1.0 if str(task.answer) in str(state.info["answer"]) else 0.0


def tasks() -> list[Task]:
    return [
        Task(id=f"{a}+{b}", prompt=f"What is {a}+{b}?", answer=a + b) for a, b in [(2, 3), (4, 5)]
    ]


async def openai_agent(client: openai.AsyncOpenAI, question: str, *, stream: bool) -> str:
    """A tool-using loop written only against the openai SDK."""
    messages: list[Any] = [
        {"role": "system", "content": "You add numbers with the add tool."},
        {"role": "user", "content": question},
    ]
    for _ in range(4):
        if stream:
            content, calls = "", {}
            events = await client.chat.completions.create(
                model="policy", messages=messages, tools=[ADD_TOOL], stream=True, logprobs=True
            )
            async for chunk in events:
                delta = chunk.choices[0].delta if chunk.choices else None
                if delta is None:
                    continue
                content += delta.content or ""
                for tc in delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                    entry["id"] += tc.id or ""
                    entry["name"] += (tc.function and tc.function.name) or ""
                    entry["arguments"] += (tc.function and tc.function.arguments) or ""
            tool_calls = [
                {
                    "id": c["id"],
                    "type": "function",
                    "function": {"name": c["name"], "arguments": c["arguments"]},
                }
                for c in calls.values()
            ]
            message: dict[str, Any] = {"role": "assistant", "content": content or None}
            if tool_calls:
                message["tool_calls"] = tool_calls
            messages.append(message)
        else:
            response = await client.chat.completions.create(
                model="policy", messages=messages, tools=[ADD_TOOL], logprobs=True
            )
            msg = response.choices[0].message
            messages.append(msg.model_dump(exclude_none=True))
            tool_calls = [tc.model_dump() for tc in msg.tool_calls or []]
            content = msg.content or ""
        if not tool_calls:
            return content
        for tc in tool_calls:
            args = json.loads(tc["function"]["arguments"])
            messages.append(
                {"role": "tool", "tool_call_id": tc["id"], "content": str(args["a"] + args["b"])}
            )
    return ""


class OpenAIEnv(AgentEnv):
    rubric = Rubric(answer)
    stream: ClassVar[bool] = False

    def __init__(self) -> None:
        self.conversations: dict[str, Any] = {}  # task id -> (messages, tools) recorded

    def tasks(self, split: str = "train") -> list[Task]:
        return tasks()

    async def rollout(self, task: Task, episode: agentenv.Episode) -> list[Sample]:
        out = await super().rollout(task, episode)
        t = episode.transcripts[0]
        tools = t.tools if t.tokenizer.supports_tools else None  # else in the system message
        self.conversations[task.id] = (t.messages, tools)
        return out

    async def run_agent(self, task: Task, client: Any) -> str:
        return await openai_agent(client, str(task.prompt), stream=self.stream)


class StreamingEnv(OpenAIEnv):
    stream = True


class SyncEnv(OpenAIEnv):
    client_kind = "base_url"

    async def run_agent(self, task: Task, client: Any) -> str:
        def run() -> str:
            sync = openai.OpenAI(base_url=client, api_key="x", max_retries=0)
            try:
                messages: list[Any] = [{"role": "user", "content": str(task.prompt)}]
                for _ in range(3):
                    r = sync.chat.completions.create(
                        model="policy", messages=messages, tools=[ADD_TOOL]
                    )
                    msg = r.choices[0].message
                    messages.append(msg.model_dump(exclude_none=True))
                    if not msg.tool_calls:
                        return msg.content or ""
                    for tc in msg.tool_calls:
                        args = json.loads(tc.function.arguments)  # type: ignore[union-attr]
                        messages.append(
                            {
                                "role": "tool",
                                "tool_call_id": tc.id,
                                "content": str(sum(args.values())),
                            }
                        )
            finally:
                sync.close()
            return ""

        return await anyio.to_thread.run_sync(run)


class HttpxEnv(OpenAIEnv):
    client_kind = "base_url"

    async def run_agent(self, task: Task, client: Any) -> str:
        async with httpx.AsyncClient(base_url=client) as http:
            messages: list[Any] = [{"role": "user", "content": str(task.prompt)}]
            for _ in range(3):
                r = await http.post(
                    "/chat/completions",
                    json={"model": "policy", "messages": messages, "tools": [ADD_TOOL]},
                )
                r.raise_for_status()
                msg = r.json()["choices"][0]["message"]
                messages.append(msg)
                if not msg.get("tool_calls"):
                    return str(msg["content"])
                for tc in msg["tool_calls"]:
                    args = json.loads(tc["function"]["arguments"])
                    messages.append(
                        {
                            "role": "tool",
                            "tool_call_id": tc["id"],
                            "content": str(sum(args.values())),
                        }
                    )
        return ""


def check_token_exact(sample: Sample, tok: ChatTokenizer, messages: list[Any], tools: Any) -> None:
    """ids decode to the template's rendering; mask 1 on the model's tokens; log-probs."""
    ids = sample.prompt_ids + sample.completion_ids
    decoded = tok.decode(ids)
    rendered = tok.render(messages, tools=tools)
    assert rendered.startswith(decoded)
    assert rendered[len(decoded) :] == "\n"  # the template's newline after the last end-of-turn
    assert sample.loss_mask is not None and sample.rollout_logprobs is not None
    start = len(sample.prompt_ids)
    for i, (m, lp) in enumerate(zip(sample.loss_mask, sample.rollout_logprobs, strict=True)):
        if m:
            assert lp == scripted_logprob(sample.completion_ids[i], start + i)
        else:
            assert lp == 0.0


@pytest.mark.parametrize("env_cls", [OpenAIEnv, StreamingEnv, SyncEnv, HttpxEnv])
@pytest.mark.parametrize("template", ["smollm2", "chatml_tools"])
def test_real_clients_give_token_exact_samples(
    env_cls: type[OpenAIEnv], template: str, request: pytest.FixtureRequest
) -> None:
    tok: ChatTokenizer = request.getfixturevalue(template)
    model = ScriptedModel(tok, calculator_script)
    env = env_cls()
    result = agentenv.run(env, model, tasks=env.tasks())
    assert len(result.samples) == 2
    for s in result.samples:
        assert s.status is Status.COMPLETED, s.reason
        assert s.reward == 1.0
        assert s.metadata["turns"] == 2
        assert s.metadata["calls"] == 2 and s.metadata["tool_calls"] == 1
        # The model's tokens are exactly the scripted replies (each ended by its stop id).
        generated = [t for t, m in zip(s.completion_ids, s.loss_mask or [], strict=True) if m]
        a, b = s.task_id.split("+") if s.task_id else ("", "")
        call = json.dumps({"name": "add", "arguments": {"a": int(a), "b": int(b)}})
        replies = [f"Let me add.<tool_call>{call}</tool_call>", f"The answer is {int(a) + int(b)}."]
        eot = tok.eos_token_id
        assert generated == [*tok.encode(replies[0]), eot, *tok.encode(replies[1]), eot]
        messages, tools = env.conversations[str(s.task_id)]
        assert [m["role"] for m in messages][-3:] == ["assistant", "tool", "assistant"]
        assert messages[-2]["content"] == str(int(a) + int(b))  # what the agent sent
        check_token_exact(s, tok, messages, tools)


def test_the_conversation_renders_to_the_sample(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, calculator_script)
    env = OpenAIEnv()
    result = agentenv.run(env, model, tasks=env.tasks()[:1])
    (sample,) = result.samples
    messages, tools = env.conversations["2+3"]
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[3]["content"] == "5" and messages[3]["tool_call_id"] == "call_1"
    check_token_exact(sample, smollm2, messages, tools)


REWRITE_SYSTEM = {"role": "system", "content": "You add numbers."}


async def rewriting_agent(post: Any) -> str:
    """Ask, get a tool call, then send the history with the question summarised."""
    first = [REWRITE_SYSTEM, {"role": "user", "content": "What is 2+3?"}]
    reply = await post(first)
    tool = {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "5"}
    edited = [REWRITE_SYSTEM, {"role": "user", "content": "Sum: 2+3"}, reply, tool]
    return str((await post(edited))["content"])


class RewriteEnv(AgentEnv):
    rubric = Rubric()
    kind: ClassVar[str] = "async"

    async def run_agent(self, task: Task, client: Any) -> str:
        if self.kind == "async":

            async def post(messages: list[Any]) -> Any:
                r = await client.chat.completions.create(
                    model="p", messages=messages, tools=[ADD_TOOL]
                )
                return r.choices[0].message.model_dump(exclude_none=True)

            return await rewriting_agent(post)
        if self.kind == "sync":
            sync = openai.OpenAI(base_url=str(client.base_url), api_key="x", max_retries=0)

            async def post(messages: list[Any]) -> Any:
                def call() -> Any:
                    r = sync.chat.completions.create(model="p", messages=messages, tools=[ADD_TOOL])
                    return r.choices[0].message.model_dump(exclude_none=True)

                return await anyio.to_thread.run_sync(call)

            try:
                return await rewriting_agent(post)
            finally:
                sync.close()
        async with httpx.AsyncClient(base_url=str(client.base_url)) as http:

            async def post(messages: list[Any]) -> Any:
                body = {"messages": messages, "tools": [ADD_TOOL]}
                return (await http.post("chat/completions", json=body)).json()["choices"][0][
                    "message"
                ]

            return await rewriting_agent(post)


@pytest.mark.parametrize("kind", ["async", "sync", "httpx"])
def test_a_rewrite_by_the_agent_starts_a_new_segment_with_every_client(
    kind: str, smollm2: ChatTokenizer
) -> None:
    class Env(RewriteEnv):
        pass

    Env.kind = kind
    model = ScriptedModel(smollm2, calculator_script)
    result = agentenv.run(Env(), model, tasks=[Task(id="t")])
    first, second = result.samples
    assert [first.metadata.get("segment"), second.metadata.get("segment")] == [0, 1]
    assert "What is 2+3?" in smollm2.decode(first.prompt_ids)
    assert "Sum: 2+3" in smollm2.decode(second.prompt_ids)
    assert smollm2.decode(second.completion_ids) == "The answer is 5.<|im_end|>"
    assert second.loss_mask is not None and all(second.loss_mask)


def test_an_agent_that_closes_its_client_leaves_the_others_theirs(smollm2: ChatTokenizer) -> None:
    class Closing(OpenAIEnv):
        async def run_agent(self, task: Task, client: Any) -> str:
            async with client:  # closes the client when this agent is done
                return await openai_agent(client, str(task.prompt), stream=False)

    model = ScriptedModel(smollm2, calculator_script)
    env = Closing()
    # One agent answers in one call and closes its client while the others are mid-way.
    tasks = [Task(id="quick", prompt="Hello", answer="know"), *env.tasks()]
    result = agentenv.run(env, model, tasks=tasks, concurrency=3)
    assert {s.task_id: s.status for s in result.samples} == {
        "quick": Status.COMPLETED, "2+3": Status.COMPLETED, "4+5": Status.COMPLETED,
    }  # fmt: skip
    assert [s.reward for s in result.samples] == [1.0, 1.0, 1.0]


def test_a_multi_agent_episode_has_one_endpoint_per_role(smollm2: ChatTokenizer) -> None:
    def script(ctx: ScriptContext) -> str:
        return "Looks right." if "Review:" in ctx.text else "Draft: 5."

    class Team(AgentEnv):
        rubric = Rubric()
        client_kind = "endpoint"

        async def run_agent(self, task: Task, client: Any) -> str:
            writer, critic = client.client(), client.role("critic").client()
            draft = await writer.chat.completions.create(
                model="p", messages=[{"role": "user", "content": "What is 2+3?"}]
            )
            text = draft.choices[0].message.content
            review = await critic.chat.completions.create(
                model="p", messages=[{"role": "user", "content": f"Review: {text}"}]
            )
            return str(review.choices[0].message.content)

    result = agentenv.run(Team(), ScriptedModel(smollm2, script), tasks=[Task(id="t")])
    by_role = {s.role: s for s in result.samples}
    assert set(by_role) == {None, "critic"}
    assert smollm2.decode(by_role[None].completion_ids) == "Draft: 5.<|im_end|>"
    assert smollm2.decode(by_role["critic"].completion_ids) == "Looks right.<|im_end|>"
    assert all(s.metadata["calls"] == 2 for s in result.samples)
