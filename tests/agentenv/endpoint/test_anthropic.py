"""Anthropic's Messages API at the episode's endpoint, with the real ``anthropic`` SDK
(async and sync, streamed both ways, with tools, count_tokens): the samples are the same
token-exact ones chat completions give, and bad requests are refused in Anthropic's error
shape naming the field, counted as refused calls."""

from __future__ import annotations

import json
from typing import Any, ClassVar

import anthropic
import anyio
import httpx
import pytest

import agentenv
from agentenv import ChatTokenizer, Rubric, ScriptedModel, Status, Task
from agentenv._scripted import ScriptContext
from agentenv.endpoint import AgentEnv, ChatError, parse_messages

from .test_env import ADD_TOOL, OpenAIEnv, calculator_script, check_token_exact

pytestmark = pytest.mark.timeout(60)

SYSTEM = "You add numbers with the add tool."
TOOL = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": ADD_TOOL["function"]["parameters"],  # type: ignore[index]
}
EVENTS: list[list[str]] = []  # the event types of each raw stream, for the stream test


def _request(messages: list[Any]) -> dict[str, Any]:
    return {
        "model": "policy",
        "max_tokens": 256,
        "system": SYSTEM,
        "messages": messages,
        "tools": [TOOL],
    }


async def _raw_stream(client: anthropic.AsyncAnthropic, messages: list[Any]) -> list[Any]:
    """The reply's content blocks, put together from ``stream=True`` events."""
    blocks: dict[int, dict[str, Any]] = {}
    partial: dict[int, str] = {}
    kinds: list[str] = []
    events = await client.messages.create(**_request(messages), stream=True)
    async for event in events:
        kinds.append(event.type)
        if event.type == "content_block_start":
            blocks[event.index] = event.content_block.model_dump(exclude_none=True)
        elif event.type == "content_block_delta":
            if event.delta.type == "text_delta":
                blocks[event.index]["text"] += event.delta.text
            elif event.delta.type == "input_json_delta":
                partial[event.index] = partial.get(event.index, "") + event.delta.partial_json
        elif event.type == "content_block_stop" and event.index in partial:
            blocks[event.index]["input"] = json.loads(partial[event.index])
    EVENTS.append(kinds)
    return [blocks[i] for i in sorted(blocks)]


async def claude_agent(client: anthropic.AsyncAnthropic, question: str, *, mode: str) -> str:
    """A tool-using loop written only against the anthropic SDK."""
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(4):
        if mode == "helper":
            async with client.messages.stream(**_request(messages)) as stream:
                message = await stream.get_final_message()
            content = [b.model_dump(exclude_none=True) for b in message.content]
        elif mode == "raw":
            content = await _raw_stream(client, messages)
        else:
            message = await client.messages.create(**_request(messages))
            content = [b.model_dump(exclude_none=True) for b in message.content]
        messages.append({"role": "assistant", "content": content})
        uses = [b for b in content if b["type"] == "tool_use"]
        if not uses:
            return "".join(b["text"] for b in content if b["type"] == "text")
        results = [
            {
                "type": "tool_result",
                "tool_use_id": b["id"],
                "content": str(sum(b["input"].values())),
            }
            for b in uses
        ]
        messages.append({"role": "user", "content": results})
    return ""


class ClaudeEnv(OpenAIEnv):
    client_kind = "anthropic"
    mode: ClassVar[str] = "create"

    async def run_agent(self, task: Task, client: Any) -> str:
        assert isinstance(client, anthropic.AsyncAnthropic)
        return await claude_agent(client, str(task.prompt), mode=self.mode)


class HelperStreamEnv(ClaudeEnv):
    mode = "helper"


class RawStreamEnv(ClaudeEnv):
    mode = "raw"


class SyncClaudeEnv(ClaudeEnv):
    client_kind = "endpoint"

    async def run_agent(self, task: Task, client: Any) -> str:
        def run() -> str:
            sync = anthropic.Anthropic(
                base_url=client.anthropic_base_url, api_key="x", max_retries=0
            )
            try:
                messages: list[Any] = [{"role": "user", "content": str(task.prompt)}]
                for _ in range(3):
                    reply = sync.messages.create(**_request(messages))
                    content = [b.model_dump(exclude_none=True) for b in reply.content]
                    messages.append({"role": "assistant", "content": content})
                    if reply.stop_reason != "tool_use":
                        return "".join(b["text"] for b in content if b["type"] == "text")
                    messages.append(
                        {
                            "role": "user",
                            "content": [
                                {
                                    "type": "tool_result",
                                    "tool_use_id": b["id"],
                                    "content": str(sum(b["input"].values())),
                                }
                                for b in content
                                if b["type"] == "tool_use"
                            ],
                        }
                    )
            finally:
                sync.close()
            return ""

        return await anyio.to_thread.run_sync(run)


@pytest.mark.parametrize("env_cls", [ClaudeEnv, HelperStreamEnv, RawStreamEnv, SyncClaudeEnv])
@pytest.mark.parametrize("template", ["smollm2", "chatml_tools"])
def test_anthropic_clients_give_token_exact_samples(
    env_cls: type[ClaudeEnv], template: str, request: pytest.FixtureRequest
) -> None:
    tok: ChatTokenizer = request.getfixturevalue(template)
    env = env_cls()
    EVENTS.clear()
    result = agentenv.run(env, ScriptedModel(tok, calculator_script), tasks=env.tasks())
    assert len(result.samples) == 2
    for s in result.samples:
        assert s.status is Status.COMPLETED, s.reason
        assert s.reward == 1.0
        assert s.metadata["turns"] == 2  # one segment: the tool turn extended the first
        assert s.metadata["calls"] == 2 and s.metadata["tool_calls"] == 1
        assert s.metadata["refused_calls"] == 0
        generated = [t for t, m in zip(s.completion_ids, s.loss_mask or [], strict=True) if m]
        a, b = (int(x) for x in str(s.task_id).split("+"))
        call = json.dumps({"name": "add", "arguments": {"a": a, "b": b}})
        replies = [f"Let me add.<tool_call>{call}</tool_call>", f"The answer is {a + b}."]
        eot = tok.eos_token_id
        assert generated == [*tok.encode(replies[0]), eot, *tok.encode(replies[1]), eot]
        messages, tools = env.conversations[str(s.task_id)]
        assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
        assert messages[0]["content"].startswith(SYSTEM)
        assert messages[3] == {"role": "tool", "content": str(a + b), "tool_call_id": "call_1"}
        check_token_exact(s, tok, messages, tools)
    if env_cls is RawStreamEnv:
        tool_turn = ["message_start"]
        tool_turn += ["content_block_start", "content_block_delta", "content_block_stop"] * 2
        tool_turn += ["message_delta", "message_stop"]
        assert EVENTS[0] == tool_turn  # a text block, then the tool_use block


def test_the_message_object_usage_and_stop_reasons(smollm2: ChatTokenizer) -> None:
    got: list[Any] = []

    class Probe(AgentEnv):
        rubric = Rubric()
        client_kind = "anthropic"

        async def run_agent(self, task: Task, client: Any) -> str:
            question = [{"role": "user", "content": "What is 2+3?"}]
            counted = await client.messages.count_tokens(
                model="p", system=SYSTEM, messages=question, tools=[TOOL]
            )
            first = await client.messages.create(**_request(question))
            tool_result = {"type": "tool_result", "tool_use_id": first.content[1].id}
            history = [
                *question,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [{**tool_result, "content": "5"}]},
            ]
            last = await client.messages.create(**_request(history))
            got.extend([counted, first, last])
            return "".join(b.text for b in last.content if b.type == "text")

    (sample,) = agentenv.run(
        Probe(), ScriptedModel(smollm2, calculator_script), tasks=[Task(id="t")]
    ).samples
    counted, first, last = got
    assert first.type == "message" and first.role == "assistant" and first.id.startswith("msg_")
    assert [b.type for b in first.content] == ["text", "tool_use"]
    assert first.content[0].text == "Let me add."
    assert first.content[1].name == "add" and first.content[1].input == {"a": 2, "b": 3}
    assert first.stop_reason == "tool_use" and first.stop_sequence is None
    assert first.usage.input_tokens == len(sample.prompt_ids)
    assert counted.input_tokens == first.usage.input_tokens  # count_tokens renders the same
    first_turn = (sample.loss_mask or []).index(0)  # the model's tokens before the tool's
    assert first.usage.output_tokens == first_turn
    assert last.stop_reason == "end_turn" and last.content[0].text == "The answer is 5."
    assert sample.metadata["calls"] == 2  # count_tokens generates nothing and is no call


def test_stop_sequences_and_max_tokens_set_the_stop_reason(smollm2: ChatTokenizer) -> None:
    got: list[Any] = []

    class Probe(AgentEnv):
        rubric = Rubric()
        client_kind = "anthropic"

        async def run_agent(self, task: Task, client: Any) -> str:
            question = [{"role": "user", "content": "Count"}]
            stopped = await client.messages.create(
                model="p", max_tokens=64, messages=question, stop_sequences=["three"]
            )
            short = await client.messages.create(
                model="p", max_tokens=2, messages=[{"role": "user", "content": "Count again"}]
            )
            got.extend([stopped, short])
            return ""

    def script(ctx: ScriptContext) -> str:
        return "one two three four"

    agentenv.run(Probe(), ScriptedModel(smollm2, script), tasks=[Task(id="t")])
    stopped, short = got
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "three"
    assert stopped.content[0].text == "one two "  # Anthropic leaves the sequence out
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 2


def test_a_rewrite_by_a_claude_agent_starts_a_new_segment(smollm2: ChatTokenizer) -> None:
    class Rewriter(AgentEnv):
        rubric = Rubric()
        client_kind = "anthropic"

        async def run_agent(self, task: Task, client: Any) -> str:
            first = await client.messages.create(
                **_request([{"role": "user", "content": "What is 2+3?"}])
            )
            use = next(b for b in first.content if b.type == "tool_use")
            edited = [
                {"role": "user", "content": "Sum: 2+3"},  # the question summarised
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "5"}],
                },
            ]
            last = await client.messages.create(**_request(edited))
            return str(last.content[0].text)

    result = agentenv.run(
        Rewriter(), ScriptedModel(smollm2, calculator_script), tasks=[Task(id="t")]
    )
    first, second = result.samples
    assert [first.metadata.get("segment"), second.metadata.get("segment")] == [0, 1]
    assert "What is 2+3?" in smollm2.decode(first.prompt_ids)
    assert "Sum: 2+3" in smollm2.decode(second.prompt_ids)
    # The model's own tool call, tool-call markup included, is in the rewritten prompt.
    assert '<tool_call>{"name": "add"' in smollm2.decode(second.prompt_ids)
    assert smollm2.decode(second.completion_ids) == "The answer is 5.<|im_end|>"


USER = {"role": "user", "content": "What is 2+3?"}
USE = {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}}


@pytest.mark.parametrize(
    ("request_body", "param", "says"),
    [
        ({"messages": [USER]}, "max_tokens", "required"),
        (
            {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "video"}]}]},
            "messages[0].content[0].type",
            "unknown content block type 'video'",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [
                    USER,
                    {"role": "assistant", "content": [USE]},
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}],
                    },
                ],
            },
            "messages[2].content[0].tool_use_id",
            "'toolu_9' matches no earlier tool_use block (1 sent so far, the latest: toolu_1)",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "What is this?"},
                            {
                                "type": "image",
                                "source": {"type": "base64", "media_type": "image/png", "data": ""},
                            },
                        ],
                    }
                ],
            },
            "messages[0].content[1].type",
            "'image' content is not supported",
        ),
        (
            {"max_tokens": 8, "messages": [USER], "system": [{"type": "image"}]},
            "system[0].type",
            "not supported",
        ),
        (
            {"max_tokens": 8, "messages": [USER], "tools": [{"name": "f"}]},
            "tools[0].input_schema",
            "expected a JSON Schema object",
        ),
        (
            {"max_tokens": 8, "messages": [USER], "tools": [{"type": "web_search_20250305"}]},
            "tools[0].type",
            "server tools",
        ),
        (
            {"max_tokens": 8, "messages": [USER], "tool_choice": {"type": "sometimes"}},
            "tool_choice",
            "expected",
        ),
        ({"max_tokens": 8, "messages": [USER], "stop_sequences": [""]}, "stop_sequences", ""),
        (
            {"max_tokens": 8, "messages": [USER], "stop_sequences": ["a", "b", "c", "d", "e"]},
            "stop_sequences",
            "at most",
        ),
        ({"max_tokens": 0, "messages": [USER]}, "max_tokens", "must be in"),
        ({"max_tokens": 8, "messages": [USER], "temperature": 3}, "temperature", "must be in"),
        ({"max_tokens": 8, "messages": [USER], "top_p": 0}, "top_p", "must be in"),
        (
            {"max_tokens": 8, "messages": [{"role": "system", "content": "x"}]},
            "messages[0].role",
            "unknown role 'system'",
        ),
        (
            {"max_tokens": 8, "messages": [USER, {"role": "assistant", "content": "The"}]},
            "messages[1].role",
            "prefill",
        ),
        (
            {
                "max_tokens": 8,
                "messages": [
                    USER,
                    {"role": "assistant", "content": [{**USE, "input": "{}"}]},
                    USER,
                ],
            },
            "messages[1].content[0].input",
            "expected an object",
        ),
    ],
)
def test_refused_messages_requests_name_the_field(
    request_body: dict[str, Any], param: str, says: str
) -> None:
    with pytest.raises(ChatError) as info:
        parse_messages(request_body)
    assert info.value.status == 400 and info.value.param == param
    assert info.value.message.startswith(f"{param}:") and says in info.value.message


def test_the_request_maps_onto_chat_completions_fields() -> None:
    call = parse_messages(
        {
            "model": "claude",
            "max_tokens": 9,
            "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
            "messages": [
                USER,
                {"role": "assistant", "content": [{"type": "text", "text": "Adding."}, USE]},
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "5"},
                        {"type": "text", "text": "Thanks."},
                    ],
                },
            ],
            "tools": [TOOL],
            "tool_choice": {"type": "tool", "name": "add"},
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "stream": True,
        }
    )
    assert [m["role"] for m in call.messages] == ["system", "user", "assistant", "tool", "user"]
    assert call.messages[0]["content"] == "Be brief."
    assert call.messages[2]["tool_calls"] == [  # type: ignore[typeddict-item]
        {
            "type": "function",
            "id": "toolu_1",
            "function": {"name": "add", "arguments": USE["input"]},
        }
    ]
    assert call.messages[3] == {"role": "tool", "content": "5", "tool_call_id": "toolu_1"}
    assert call.tools == [{"type": "function", "function": {
        "name": "add", "description": "Add two integers.", "parameters": TOOL["input_schema"],
    }}]  # fmt: skip
    assert (call.model, call.max_tokens, call.stop, call.stream) == ("claude", 9, ("END",), True)
    assert (call.temperature, call.top_p, call.parse_tools) == (0.5, 0.9, True)
    none = parse_messages({"max_tokens": 1, "messages": [USER], "tools": [TOOL],
                           "tool_choice": {"type": "none"}})  # fmt: skip
    assert none.parse_tools is False


def test_the_sdk_sees_anthropic_errors_counted_as_refused_calls(smollm2: ChatTokenizer) -> None:
    errors: list[anthropic.BadRequestError] = []

    class Probe(AgentEnv):
        rubric = Rubric()
        client_kind = "anthropic"

        async def run_agent(self, task: Task, client: Any) -> str:
            image = {"type": "image", "source": {"type": "url", "url": "https://x/y.png"}}
            orphan = {"type": "tool_result", "tool_use_id": "toolu_404", "content": "5"}
            for content in ([{"type": "audio"}], [image], [orphan]):
                try:
                    await client.messages.create(
                        model="p", max_tokens=8, messages=[{"role": "user", "content": content}]
                    )
                except anthropic.BadRequestError as e:
                    errors.append(e)
            r = await client.messages.create(model="p", max_tokens=64, messages=[USER])
            return str(r.content[0].text)

    (sample,) = agentenv.run(
        Probe(), ScriptedModel(smollm2, calculator_script), tasks=[Task(id="t")]
    ).samples
    assert [e.status_code for e in errors] == [400, 400, 400]
    for e, param in zip(
        errors,
        ["messages[0].content[0].type", "messages[0].content[0].type",
         "messages[0].content[0].tool_use_id"],
        strict=True,
    ):  # fmt: skip
        assert e.body["type"] == "error", e.body  # type: ignore[index]
        error = e.body["error"]  # type: ignore[index]
        assert error["type"] == "invalid_request_error"
        assert error["message"].startswith(f"{param}:")
    says = [e.body["error"]["message"] for e in errors]  # type: ignore[index]
    assert "unknown content block type 'audio'" in says[0]
    assert "'image' content is not supported" in says[1]
    assert "matches no earlier tool_use block" in says[2]
    assert sample.status is Status.COMPLETED and sample.metadata["calls"] == 4
    assert sample.metadata["refused_calls"] == 3


@pytest.mark.anyio
async def test_the_client_is_closed_with_the_endpoint_and_then_answered_410(
    smollm2: ChatTokenizer,
) -> None:
    from agentenv import Episode
    from agentenv.endpoint import AgentServer

    def episode() -> Episode:
        policy = ScriptedModel(smollm2, calculator_script)
        return Episode(task=Task(id="t"), tokenizer=smollm2, policy=policy)

    server = AgentServer()
    async with server.open(episode()):  # keeps the server up
        async with server.open(episode()) as endpoint:
            client = endpoint.anthropic_client()
            r = await client.messages.create(model="p", max_tokens=64, messages=[USER])
            assert r.content[0].type == "text"
        assert client.is_closed()  # closed when the endpoint was given back
        late = anthropic.AsyncAnthropic(
            base_url=endpoint.anthropic_base_url, api_key="x", max_retries=0
        )
        async with late:
            with pytest.raises(anthropic.APIStatusError) as info:
                await late.messages.create(model="p", max_tokens=8, messages=[USER])
        assert info.value.status_code == 410
        # Refused by the server before the route (no episode holds it): Anthropic's shape.
        body: Any = info.value.body
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
        assert "it has ended" in body["error"]["message"], body


async def _huge_call(client: anthropic.AsyncAnthropic, huge: Any, *, count: bool) -> object:
    if count:
        return await client.messages.count_tokens(model="p", messages=[huge])
    return await client.messages.create(model="p", max_tokens=8, messages=[huge])


@pytest.mark.anyio
async def test_the_servers_own_refusals_of_messages_calls_are_in_anthropics_shape(
    smollm2: ChatTokenizer,
) -> None:
    """Too large a body (413) is refused by the HTTP layer before any route reads it; on a
    Messages route it is still Anthropic's error body, which the SDK parses."""
    from agentenv import Episode
    from agentenv._http import HTTPServer, Router
    from agentenv.endpoint import AgentServer, serve_chat

    policy = ScriptedModel(smollm2, calculator_script)
    huge = {"role": "user", "content": "x" * 5000}
    body: Any
    router = Router()
    serve_chat(router, policy, smollm2, model="m", context_length=2048)
    async with (
        AgentServer(max_body_bytes=4096).open(
            Episode(task=Task(id="t"), tokenizer=smollm2, policy=policy)
        ) as endpoint,
        HTTPServer(router, max_body_bytes=4096) as served,
    ):
        for base_url in (endpoint.anthropic_base_url, served.url):
            client = anthropic.AsyncAnthropic(base_url=base_url, api_key="x", max_retries=0)
            async with client:
                for count in (False, True):
                    with pytest.raises(anthropic.APIStatusError) as info:
                        await _huge_call(client, huge, count=count)
                    assert info.value.status_code == 413
                    body = info.value.body
                    assert body["type"] == "error", body
                    assert body["error"]["type"] == "request_too_large"
                    assert "takes at most 4096" in body["error"]["message"]
            # The chat-completions route keeps OpenAI's shape.
            async with httpx.AsyncClient(trust_env=False) as http:
                r = await http.post(
                    f"{base_url}/v1/chat/completions", json={"model": "p", "messages": [huge]}
                )
                assert r.status_code == 413 and "type" not in r.json(), r.text


def test_a_messages_call_that_overflows_the_context_is_refused_and_truncates(
    smollm2: ChatTokenizer,
) -> None:
    errors: list[anthropic.BadRequestError] = []

    class Probe(AgentEnv):
        rubric = Rubric()
        client_kind = "anthropic"

        async def run_agent(self, task: Task, client: Any) -> str:
            first = await client.messages.create(**_request([USER]))
            use = next(b for b in first.content if b.type == "tool_use")
            result = {"type": "tool_result", "tool_use_id": use.id, "content": "5 " * 400}
            history = [
                USER,
                {"role": "assistant", "content": [b.model_dump() for b in first.content]},
                {"role": "user", "content": [result]},
            ]
            try:
                await client.messages.create(**_request(history))
            except anthropic.BadRequestError as e:
                errors.append(e)
                raise
            return ""

    limits = agentenv.Limits(context_length=400)
    (sample,) = agentenv.run(
        Probe(),
        ScriptedModel(smollm2, calculator_script),
        tasks=[Task(id="t")],
        config=agentenv.RolloutConfig(limits=limits),
    ).samples
    (error,) = errors
    body = error.body["error"]  # type: ignore[index]
    assert body["type"] == "invalid_request_error"
    assert "maximum context length is 400 tokens" in body["message"]
    assert sample.status is Status.TRUNCATED
    assert sample.reason is not None and sample.reason.startswith("context:")
    assert sample.metadata["turns"] == 1
