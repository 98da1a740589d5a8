"""Bad input at the endpoint: refused with OpenAI's errors naming the field, or data."""

from __future__ import annotations

import json
from typing import Any

import anyio
import httpx
import openai
import pytest

import agentenv
from agentenv import ChatTokenizer, Limits, Rubric, ScriptedModel, Status, Task
from agentenv.endpoint import AgentEnv, ChatError, parse_chat, parse_responses

from .test_env import ADD_TOOL, calculator_script

pytestmark = pytest.mark.timeout(60)

USER = {"role": "user", "content": "What is 2+3?"}


class ProbeEnv(AgentEnv):
    """Runs ``probe(client)`` (set per test) as the agent, with the openai SDK."""

    rubric = Rubric()
    probe: Any = None

    async def run_agent(self, task: Task, client: Any) -> str:
        return str(await self.probe(client))


def run(probe: Any, tok: ChatTokenizer, n: int = 1, **kwargs: Any) -> agentenv.RolloutResult:
    env = ProbeEnv()
    env.probe = probe
    model = ScriptedModel(tok, kwargs.pop("script", calculator_script))
    tasks = [Task(id=f"t{i}", prompt="") for i in range(n)]
    return agentenv.run(env, model, tasks=tasks, **kwargs)


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"messages": [USER], "n": 2}, "n"),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "text", "text": "what is this?"},
                            {"type": "image_url", "image_url": {"url": "data:image/png;base64,"}},
                        ],
                    }
                ]
            },
            "messages[0].content[1].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0].type",
        ),
        ({"messages": [USER], "modalities": ["text", "audio"]}, "modalities"),
        ({"messages": [{"role": "critic", "content": "x"}]}, "messages[0].role"),
        ({"messages": []}, "messages"),
        ({"messages": [USER], "temperature": 3}, "temperature"),
        ({"messages": [USER], "stop": [""]}, "stop"),
        (
            {
                "messages": [USER],
                "tools": [
                    {"type": "function", "function": {"name": "add", "parameters": '{"a": 1}'}}
                ],
            },
            "tools[0].function.parameters",
        ),
        (
            {
                "messages": [USER],
                "tools": [{"type": "function", "function": {"name": "f", "description": 5}}],
            },
            "tools[0].function.description",
        ),
    ],
)
def test_refused_requests_name_the_field(request_body: dict[str, Any], param: str) -> None:
    with pytest.raises(ChatError) as info:
        parse_chat(request_body)
    assert info.value.status == 400
    assert info.value.param == param
    assert info.value.message.startswith(f"{param}:")


def test_the_sdk_sees_the_400_and_the_episode_goes_on(smollm2: ChatTokenizer) -> None:
    errors: list[openai.BadRequestError] = []

    async def probe(client: openai.AsyncOpenAI) -> str:
        for bad in (
            {"n": 2},
            {"messages": [{"role": "critic", "content": "x"}]},
        ):
            body: dict[str, Any] = {"model": "policy", "messages": [USER], **bad}
            try:
                await client.chat.completions.create(**body)
            except openai.BadRequestError as e:
                errors.append(e)
        r = await client.chat.completions.create(model="policy", messages=[USER])
        return r.choices[0].message.content or ""

    (sample,) = run(probe, smollm2).samples
    assert [e.param for e in errors] == ["n", "messages[0].role"]
    assert "only n=1 is supported" in errors[0].message
    assert "unknown role 'critic'" in errors[1].message
    assert sample.status is Status.COMPLETED and sample.metadata["calls"] == 3
    assert sample.metadata["refused_calls"] == 2


def test_deep_json_and_string_tool_parameters_are_refused_400_naming_the_problem(
    smollm2: ChatTokenizer,
) -> None:
    answers: list[httpx.Response] = []
    schema = json.dumps(ADD_TOOL["function"]["parameters"])  # type: ignore[index]

    async def probe(client: openai.AsyncOpenAI) -> str:
        url = f"{client.base_url}chat/completions"
        deep = b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        nested = json.loads("[" * 500 + "]" * 500)  # within json's own limit, not ours
        stringly = [{"type": "function", "function": {"name": "add", "parameters": schema}}]
        async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
            answers.append(await http.post(url, content=deep))
            answers.append(await http.post(url, json={"messages": [USER], "metadata": nested}))
            answers.append(await http.post(url, json={"messages": [USER], "tools": stringly}))
        r = await client.chat.completions.create(model="policy", messages=[USER])
        return r.choices[0].message.content or ""

    (sample,) = run(probe, smollm2).samples
    assert [a.status_code for a in answers] == [400, 400, 400], [a.text for a in answers]
    errors = [a.json()["error"] for a in answers]
    assert "deeper than 128 levels" in errors[0]["message"]
    assert "deeper than 128 levels" in errors[1]["message"]
    assert errors[2]["param"] == "tools[0].function.parameters"
    assert "expected a JSON Schema object" in errors[2]["message"]
    assert "not its JSON text" in errors[2]["message"]
    assert sample.status is Status.COMPLETED and sample.metadata["refused_calls"] == 3


def test_malformed_tool_arguments_reach_the_agent_and_are_counted(
    smollm2: ChatTokenizer,
) -> None:
    got: list[Any] = []

    def script(ctx: Any) -> str:
        if "tool\n" in ctx.text:
            return "Sorry."
        return '<tool_call>{"name": "add", "arguments": {"a": 2, "b": }}</tool_call>'

    async def probe(client: openai.AsyncOpenAI) -> str:
        r = await client.chat.completions.create(model="p", messages=[USER], tools=[ADD_TOOL])
        msg = r.choices[0].message
        got.append(r)
        (call,) = msg.tool_calls or []
        try:
            json.loads(call.function.arguments)  # type: ignore[union-attr]
        except ValueError as e:
            error = f"Error: the arguments are not valid JSON: {e}"
        tool = {"role": "tool", "tool_call_id": call.id, "content": error}
        messages: list[Any] = [USER, msg.model_dump(exclude_none=True), tool]
        r = await client.chat.completions.create(model="p", messages=messages, tools=[ADD_TOOL])
        return r.choices[0].message.content or ""

    (sample,) = run(probe, smollm2, script=script).samples
    choice = got[0].choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "add"
    assert call.function.arguments == '{"a": 2, "b": }'
    assert sample.metadata["tool_call_errors"] == 1 and sample.metadata["tool_calls"] == 0
    assert sample.metadata["turns"] == 2  # the agent's tool error extended the transcript


def test_a_call_that_overflows_the_context_is_refused_and_truncates(
    smollm2: ChatTokenizer,
) -> None:
    errors: list[openai.BadRequestError] = []

    async def probe(client: openai.AsyncOpenAI) -> str:
        r = await client.chat.completions.create(model="p", messages=[USER], tools=[ADD_TOOL])
        msg = r.choices[0].message
        (call,) = msg.tool_calls or []
        tool = {"role": "tool", "tool_call_id": call.id, "content": "5 " * 400}
        messages: list[Any] = [USER, msg.model_dump(exclude_none=True), tool]
        try:
            await client.chat.completions.create(model="p", messages=messages, tools=[ADD_TOOL])
        except openai.BadRequestError as e:
            errors.append(e)
            raise
        return ""

    limits = Limits(context_length=400)
    (sample,) = run(probe, smollm2, config=agentenv.RolloutConfig(limits=limits)).samples
    (error,) = errors
    assert error.code == "context_length_exceeded" and error.param == "messages"
    assert "maximum context length is 400 tokens" in error.message
    assert sample.status is Status.TRUNCATED
    assert sample.reason is not None and sample.reason.startswith("context:")
    assert (
        sample.metadata["turns"] == 1 and len(sample.prompt_ids) + len(sample.completion_ids) <= 400
    )


def test_an_agent_that_never_calls_is_a_failed_sample(smollm2: ChatTokenizer) -> None:
    async def probe(client: openai.AsyncOpenAI) -> str:
        return "42"

    (sample,) = run(probe, smollm2).samples
    assert sample.status is Status.FAILED
    assert sample.reason is not None and "the agent never called its endpoint" in sample.reason


def test_an_agent_that_raises_or_overruns_fails_alone(smollm2: ChatTokenizer) -> None:
    class Flaky(ProbeEnv):
        timeout_s = 0.5

        async def run_agent(self, task: Task, client: Any) -> str:
            r = await client.chat.completions.create(model="p", messages=[USER])
            if task.id == "t0":
                raise RuntimeError("the agent's own bug")
            if task.id == "t1":
                await anyio.sleep_forever()
            return str(r.choices[0].message.content)

    model = ScriptedModel(smollm2, calculator_script)
    tasks = [Task(id=f"t{i}") for i in range(3)]
    result = agentenv.run(Flaky(), model, tasks=tasks)
    by_task = {s.task_id: s for s in result.samples}
    assert by_task["t0"].status is Status.FAILED
    assert "RuntimeError: the agent's own bug" in (by_task["t0"].reason or "")
    assert by_task["t1"].status is Status.FAILED
    assert "ran past its timeout_s=0.5 s" in (by_task["t1"].reason or "")
    assert by_task["t2"].status is Status.COMPLETED


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "previous_response_id"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"input": [{"role": "critic", "content": "x"}]}, "input[0].role"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": []}, "input"),
        (
            {"input": "hi", "tools": [{"type": "function", "name": "f", "parameters": "{}"}]},
            "tools[0].parameters",
        ),
    ],
)
def test_refused_responses_requests_name_the_field(
    request_body: dict[str, Any], param: str
) -> None:
    with pytest.raises(ChatError) as info:
        parse_responses(request_body)
    assert info.value.status == 400 and info.value.param == param


def test_responses_api_with_the_openai_sdk(smollm2: ChatTokenizer) -> None:
    got: list[Any] = []
    flat = {"type": "function", **ADD_TOOL["function"]}  # type: ignore[dict-item]

    async def probe(client: openai.AsyncOpenAI) -> str:
        r = await client.responses.create(model="p", input="What is 2+3?", tools=[flat])
        got.append(r)
        (call,) = [o for o in r.output if o.type == "function_call"]
        items: list[Any] = [
            {"role": "user", "content": "What is 2+3?"},
            *[o.model_dump(exclude_none=True) for o in r.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "5"},
        ]
        stream = await client.responses.create(model="p", input=items, tools=[flat], stream=True)
        async for event in stream:
            if event.type == "response.completed":
                got.append(event.response)
        return got[-1].output_text

    (sample,) = run(probe, smollm2).samples
    first, last = got
    assert first.output[0].content[0].text == "Let me add."
    assert first.output[1].name == "add" and first.output[1].arguments == '{"a": 2, "b": 3}'
    assert first.usage.input_tokens == len(sample.prompt_ids)
    first_turn = (sample.loss_mask or []).index(0)  # the model's tokens before the tool's
    assert first.usage.output_tokens == first_turn
    assert last.output_text == "The answer is 5."
    assert sample.status is Status.COMPLETED and sample.metadata["turns"] == 2


def test_an_aborted_generation_is_a_503_and_aborts_the_samples(smollm2: ChatTokenizer) -> None:
    from agentenv import Completion, FinishReason

    inner = ScriptedModel(smollm2, calculator_script)
    errors: list[openai.APIStatusError] = []

    class AbortSecond:
        tokenizer = smollm2

        async def generate(self, input_ids: Any, params: Any, *, rid: Any = None) -> Completion:
            if inner.calls == 0:
                return await inner.generate(input_ids, params, rid=rid)
            return Completion(output_ids=[], logprobs=[], finish_reason=FinishReason("abort"))

    async def probe(client: openai.AsyncOpenAI) -> str:
        r = await client.chat.completions.create(model="p", messages=[USER], tools=[ADD_TOOL])
        msg = r.choices[0].message
        (call,) = msg.tool_calls or []
        tool = {"role": "tool", "tool_call_id": call.id, "content": "5"}
        try:
            messages: list[Any] = [USER, msg.model_dump(exclude_none=True), tool]
            await client.chat.completions.create(model="p", messages=messages, tools=[ADD_TOOL])
        except openai.APIStatusError as e:
            errors.append(e)
            raise
        return ""

    env = ProbeEnv()
    env.probe = probe
    (sample,) = agentenv.run(env, AbortSecond(), tasks=[Task(id="t")]).samples
    assert errors[0].status_code == 503 and "aborted" in errors[0].message
    assert sample.status is Status.ABORTED and sample.metadata["turns"] == 1
