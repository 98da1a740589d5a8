"""A code-fixing agent whose tool reads the task's unit tests (tested offline in
``test_fix_code_env.py``).

``run_tests`` declares ``task: Task`` and ``state: State``: the runner gives it the
episode's task (whose ``info`` holds the tests) and state (``state.info`` keeps what this
episode's runs found), and neither appears in the schema the model sees -- the model only
writes ``code``. The reward reads what the tool recorded.

The candidate runs in a plain ``python -I`` subprocess to keep the example free of
dependencies; code from a model being trained belongs in a sandbox
(``sandboxes.check_python``, docs/sandboxes.md).
"""

from __future__ import annotations

import sys

import anyio

from agentenv import Rubric, State, Task, ToolEnv, tool

BUGGY = "def add(a, b):\n    return a - b\n"


@tool(timeout_s=20)
async def run_tests(code: str, task: Task, state: State) -> str:
    """Run the task's unit tests against a new version of the code.

    Args:
        code: the complete fixed source of the module.
    """
    program = f"{code}\n{task.info['tests']}\nprint('all tests passed')\n"
    passed, output = False, "the tests ran out of time (10 s)"
    with anyio.move_on_after(10):
        result = await anyio.run_process([sys.executable, "-I", "-c", program], check=False)
        passed = result.returncode == 0
        output = (result.stdout if passed else result.stderr).decode(errors="replace")
    state.info["test_runs"] = int(state.info.get("test_runs", 0)) + 1
    state.info["passed"] = passed
    return output.strip()[-1000:]  # the end of a traceback names the failing assert


def tests_pass(task: Task, state: State) -> float:
    """1 when the last run of the task's tests passed."""
    return 1.0 if state.info.get("passed") else 0.0


class FixCodeEnv(ToolEnv):
    name = "fix_code"
    system_prompt = "Fix the code. Call run_tests with the whole fixed module until it passes."
    tools = (run_tests,)
    max_turns = 4
    rubric = Rubric(tests_pass)

    def tasks(self, split: str = "train") -> list[Task]:
        tests = "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n"
        return [
            Task(
                id="add",
                prompt=f"This module fails its tests:\n\n{BUGGY}",
                info={"tests": tests},
            )
        ]
