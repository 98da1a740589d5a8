"""A tool-using agent written only against the ``anthropic`` SDK, trained unchanged.

    agentenv eval --env examples/anthropic_agent_env.py:ClaudeAdderEnv --n 2 \\
        --model scripted:examples/scripts/anthropic_adder.json --json
"""

from __future__ import annotations

from typing import Any

from anthropic import AsyncAnthropic

from agentenv import AgentEnv, Rubric, State, Task

ADD = {
    "name": "add",
    "description": "Add two integers.",
    "input_schema": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
    },
}


async def solve(client: AsyncAnthropic, question: str) -> str:
    """The agent, as it was: Messages calls with the add tool until the model answers."""
    messages: list[Any] = [{"role": "user", "content": question}]
    for _ in range(3):
        reply = await client.messages.create(
            model="policy", max_tokens=1024, system="Use the add tool.", messages=messages,
            tools=[ADD],
        )  # fmt: skip
        messages.append({"role": "assistant", "content": reply.content})
        uses = [b for b in reply.content if b.type == "tool_use"]
        if not uses:
            return "".join(b.text for b in reply.content if b.type == "text")
        results = [
            {"type": "tool_result", "tool_use_id": b.id, "content": str(sum(b.input.values()))}
            for b in uses
        ]
        messages.append({"role": "user", "content": results})
    return ""


def correct(task: Task, state: State) -> float:
    return 1.0 if f"The answer is {task.answer}." == state.info["answer"] else 0.0


class ClaudeAdderEnv(AgentEnv):
    rubric = Rubric(correct)
    client_kind = "anthropic"  # run_agent gets an anthropic.AsyncAnthropic

    def tasks(self, split: str = "train") -> list[Task]:
        pairs = [(3 + i, 4 + 2 * i) for i in range(8)]
        return [Task(id=f"{a}+{b}", prompt=f"What is {a}+{b}?", answer=a + b) for a, b in pairs]

    async def run_agent(self, task: Task, client: AsyncAnthropic) -> str:
        return await solve(client, str(task.prompt))
