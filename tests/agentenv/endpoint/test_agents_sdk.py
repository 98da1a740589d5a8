"""The OpenAI Agents SDK as a real client: an Agent with two @function_tools run by
Runner.run (and run_streamed) against the episode's endpoint, through chat completions
and through the Responses API, its default (tracing off, no other network)."""

from __future__ import annotations

import json
import re
from typing import Any, ClassVar

import pytest
from agents import (
    Agent,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunConfig,
    Runner,
    function_tool,
)

import agentenv
from agentenv import ChatTokenizer, Rubric, Sample, ScriptedModel, State, Status, Task
from agentenv._scripted import ScriptContext, scripted_logprob
from agentenv.endpoint import AgentEnv

from .test_env import check_token_exact

pytestmark = pytest.mark.timeout(60)


@function_tool
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@function_tool
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


def call(name: str, **arguments: int) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def script(ctx: ScriptContext) -> str:
    """(a+b)*c: add, then multiply the sum, then answer."""
    text = ctx.text
    a, b, c = (int(x) for x in re.findall(r"What is \((\d+)\+(\d+)\)\*(\d+)\?", text)[-1])
    results = re.findall(r"(?:tool_response>\n|tool\n)(-?\d+)", text)
    if not results:
        return "First the sum." + call("add", a=a, b=b)
    if len(results) == 1:
        return call("multiply", a=int(results[0]), b=c)
    return f"The answer is {results[-1]}."


def correct(task: Task, state: State) -> float:
    return 1.0 if f"The answer is {task.answer}." == state.info["answer"] else 0.0


class AgentsSDKEnv(AgentEnv):
    rubric = Rubric(correct)
    api: ClassVar[str] = "chat"
    streamed: ClassVar[bool] = False

    def __init__(self) -> None:
        self.conversation: Any = None

    async def rollout(self, task: Task, episode: agentenv.Episode) -> list[Sample]:
        out = await super().rollout(task, episode)
        t = episode.transcripts[0]
        self.conversation = (t.messages, t.tools if t.tokenizer.supports_tools else None)
        return out

    def tasks(self, split: str = "train") -> list[Task]:
        return [Task(id="t", prompt="What is (2+3)*4?", answer=20)]

    async def run_agent(self, task: Task, client: Any) -> str:
        agent = Agent(
            name="calculator",
            instructions="Compute with the tools.",
            tools=[add, multiply],
            model=OpenAIChatCompletionsModel(model="policy", openai_client=client)
            if self.api == "chat"
            else OpenAIResponsesModel(model="policy", openai_client=client),
        )
        config = RunConfig(tracing_disabled=True)
        if self.streamed:
            streamed = Runner.run_streamed(agent, str(task.prompt), run_config=config)
            async for _ in streamed.stream_events():
                pass
            return str(streamed.final_output)
        result = await Runner.run(agent, str(task.prompt), run_config=config)
        return str(result.final_output)


@pytest.mark.parametrize(
    ("api", "streamed"),
    [("chat", False), ("chat", True), ("responses", False), ("responses", True)],
)
@pytest.mark.parametrize("template", ["smollm2", "chatml_tools"])
def test_agents_sdk_runner_gives_one_token_exact_sample(
    template: str, api: str, streamed: bool, request: pytest.FixtureRequest
) -> None:
    tok: ChatTokenizer = request.getfixturevalue(template)

    class Env(AgentsSDKEnv):
        pass

    Env.api, Env.streamed = api, streamed
    env = Env()
    result = agentenv.run(env, ScriptedModel(tok, script), tasks=env.tasks())
    (sample,) = result.samples
    assert sample.status is Status.COMPLETED, sample.reason
    assert sample.reward == 1.0
    assert sample.metadata["calls"] == 3 and sample.metadata["tool_calls"] == 2
    assert sample.metadata["turns"] == 3  # one segment: every call extended the last
    eot = tok.eos_token_id
    replies = ["First the sum." + call("add", a=2, b=3), call("multiply", a=5, b=4)]
    replies.append("The answer is 20.")
    expected = [t for r in replies for t in [*tok.encode(r), eot]]
    mask = sample.loss_mask or []
    assert [t for t, m in zip(sample.completion_ids, mask, strict=True) if m] == expected
    start = len(sample.prompt_ids)
    for i, (t, m) in enumerate(zip(sample.completion_ids, mask, strict=True)):
        lp = (sample.rollout_logprobs or [])[i]
        assert lp == (scripted_logprob(t, start + i) if m else 0.0)
    # The tool results the agent sent are environment tokens (mask 0).
    text = tok.decode([t for t, m in zip(sample.completion_ids, mask, strict=True) if not m])
    assert "5" in text and "20" in text
    messages, tools = env.conversation
    roles = [m["role"] for m in messages]
    assert roles[-5:] == ["assistant", "tool", "assistant", "tool", "assistant"]
    check_token_exact(sample, tok, messages, tools)
