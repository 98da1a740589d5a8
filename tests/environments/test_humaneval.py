"""HumanEval in the sandbox: every canonical solution passes, a wrong one fails for every
problem, and the environment's reward runs end to end; the Python tool in a ToolEnv."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from agentenv import (
    ChatTokenizer,
    ListSink,
    RolloutConfig,
    Rubric,
    SamplingParams,
    ScriptedModel,
    Task,
    ToolEnv,
    run_rollouts,
)
from environments.humaneval import HumanEvalEnv, load_problems, solution_source
from environments.python_tool import python_interpreter
from sandboxes import Limits, Sandbox, check_python

pytestmark = [pytest.mark.anyio, pytest.mark.docker, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def sandbox() -> AsyncIterator[Sandbox]:
    async with Sandbox("docker", size=2, limits=Limits(timeout_s=10)) as s:
        yield s


def wrong(problem: dict[str, Any]) -> str:
    """A solution that returns a value no HumanEval test expects."""
    return problem["prompt"] + "    return ('not', 'this')\n"


@pytest.mark.slow  # 328 sandboxed runs: about 25 s on 2 cores
async def test_all_164_canonical_solutions_pass_and_wrong_ones_fail(sandbox: Sandbox) -> None:
    problems = load_problems()
    assert len(problems) == 164

    async def grade(p: dict[str, Any], code: str) -> bool:
        v = await check_python(
            sandbox, code, p["test"], entry_point=p["entry_point"], setup=p["prompt"]
        )
        return v.passed

    good = await asyncio.gather(
        *(grade(p, p["prompt"] + p["canonical_solution"]) for p in problems)
    )
    assert [p["task_id"] for p, ok in zip(problems, good, strict=True) if not ok] == []
    bad = await asyncio.gather(*(grade(p, wrong(p)) for p in problems))
    assert [p["task_id"] for p, ok in zip(problems, bad, strict=True) if ok] == []


def test_solution_source_takes_a_function_or_a_body() -> None:
    prompt = 'def add(a, b):\n    """Sum."""\n'
    full = solution_source(prompt, "Sure:\n```python\ndef add(a, b):\n    return a + b\n```", "add")
    body = solution_source(prompt, "    return a + b\n", "add")
    for src in (full, body):
        ns: dict[str, Any] = {}
        exec(src, ns)
        assert ns["add"](2, 3) == 5


async def test_the_environment_rewards_passing_code(
    sandbox: Sandbox, smollm2: ChatTokenizer
) -> None:
    env = HumanEvalEnv(sandbox)
    problems = {p["task_id"]: p for p in load_problems()}
    tasks = [t for t in env.tasks() if t.id in ("HumanEval/0", "HumanEval/2")]

    def answer(ctx: Any) -> str:
        if "has_close_elements" in ctx.text:
            p = problems["HumanEval/0"]
            return "```python\n" + p["prompt"] + p["canonical_solution"] + "```"
        return "```python\nimport sys\nsys.exit(0)\n```"  # a reward hack: scores 0

    sink = ListSink()
    await run_rollouts(
        env, tasks, ScriptedModel(smollm2, answer), tokenizer=smollm2, sink=sink,
        config=RolloutConfig(
            n_samples_per_prompt=1, sampling=SamplingParams(max_new_tokens=1024)
        ),
    )  # fmt: skip
    rewards = sorted(s.reward for s in sink.samples)
    assert rewards == [0.0, 1.0], [s.metadata for s in sink.samples]


class PythonEnv(ToolEnv):
    name = "python_test"
    tools = ()
    max_turns = 3
    rubric = Rubric()  # the test reads the transcript, not a reward


async def test_the_python_tool_runs_code_in_the_sandbox(
    sandbox: Sandbox, smollm2: ChatTokenizer
) -> None:
    env = PythonEnv()
    env.tools = (python_interpreter(sandbox),)  # type: ignore[misc]

    def script(ctx: Any) -> str:
        if "<|im_start|>tool" in ctx.text or "<tool_response>" in ctx.text:
            return "done"  # the tool answered
        code = "print(6 * 7, flush=True)\nimport os\nos._exit(3)"
        call = json.dumps({"name": "python", "arguments": {"code": code}})
        return f"<tool_call>\n{call}\n</tool_call>"

    sink = ListSink()
    await run_rollouts(
        env, [Task(id="t", prompt="compute")], ScriptedModel(smollm2, script),
        tokenizer=smollm2, sink=sink, config=RolloutConfig(n_samples_per_prompt=1),
    )  # fmt: skip
    text = smollm2.decode(list(sink.samples[0].completion_ids))
    assert "42" in text and "exit status 3" in text, text
    assert sink.samples[0].metadata["tool_calls"] == 1
