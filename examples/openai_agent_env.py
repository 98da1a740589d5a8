"""A tool-using agent written only against the ``openai`` SDK, trained unchanged.

``solve`` is an ordinary OpenAI agent loop: chat completions with a ``calculator`` tool
until the model answers. :class:`CalculatorAgentEnv` hands it an ``AsyncOpenAI`` pointed
at the episode's endpoint; every call becomes token-exact samples. Train it on CPU::

    agentenv train --env examples/openai_agent_env.py:CalculatorAgentEnv \\
        --num-rollout 4 --rollout-batch-size 4 --n-samples-per-prompt 4 \\
        --rollout-max-response-len 64 --n-eval 8 --json

Outside training, ``solve`` runs against any OpenAI-compatible server (``agentenv serve``
or SGLang: ``AsyncOpenAI(base_url="http://127.0.0.1:30000/v1", api_key="none")``).
"""

from __future__ import annotations

import ast
import json
from typing import Any

from openai import AsyncOpenAI

from agentenv import AgentEnv, Rubric, State, Task

SYSTEM = (
    "You are a careful calculator. Call the calculator tool for any arithmetic, then reply "
    "'The answer is N.'"
)
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * and integers.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]


def calculator(expression: str) -> str:
    """The tool, run by the agent itself: integers with + - * and parentheses."""
    try:
        return str(_evaluate(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError):
        return f"error: cannot evaluate {expression!r}; use integers with + - *"


def _evaluate(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int and abs(node.value) < 10**9:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add | ast.Sub | ast.Mult):
        a, b = _evaluate(node.left), _evaluate(node.right)
        return (
            a + b
            if isinstance(node.op, ast.Add)
            else a - b
            if isinstance(node.op, ast.Sub)
            else a * b
        )
    raise ValueError("not integer arithmetic")


async def solve(client: AsyncOpenAI, question: str, max_calls: int = 3) -> str:
    """The agent: an OpenAI tool-calling loop."""
    messages: list[Any] = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": question},
    ]
    answer = ""
    for _ in range(max_calls):
        response = await client.chat.completions.create(
            model="policy", messages=messages, tools=TOOLS
        )
        message = response.choices[0].message
        messages.append(message)
        answer = message.content or ""
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
                result = calculator(str(expression))
            except (ValueError, AttributeError):
                result = "error: the arguments must be JSON with an 'expression'"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return answer


def correct(task: Task, state: State) -> float:
    return 1.0 if f"The answer is {task.answer}" in str(state.info["answer"]) else 0.0


class CalculatorAgentEnv(AgentEnv):
    name = "calculator_agent"
    rubric = Rubric(correct)
    timeout_s = 120.0

    def tasks(self, split: str = "train") -> list[Task]:
        offset = 0 if split == "train" else 50
        pairs = [(3 + i % 7 + offset, 4 + i % 5) for i in range(16)]
        return [
            Task(id=f"{split}-{i}", prompt=f"What is {a} * {b}?", answer=a * b)
            for i, (a, b) in enumerate(pairs)
        ]

    async def run_agent(self, task: Task, client: AsyncOpenAI) -> str:
        return await solve(client, str(task.prompt))
