"""A scripted model for ``mini_swe``: through mini-swe-agent's ``bash`` tool it runs the
task's reference ``solution/solve.sh``, then submits as mini-swe-agent asks (``echo
COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT``) -- every bundled task should score 1.0. Use with
``--model scripted:examples/scripts/mini_swe_oracle.py``.
"""

import json

from environments.harbor import load_tasks

SOLUTIONS = {t.instruction.strip(): t.solution for t in load_tasks()}


def bash(command: str) -> str:
    return (
        "<tool_call>\n"
        + json.dumps({"name": "bash", "arguments": {"command": command}})
        + "\n</tool_call>"
    )


def reply(ctx) -> str:  # type: ignore[no-untyped-def]
    if "<|im_start|>tool" in ctx.text:  # the solution ran: submit
        return "Done.\n" + bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")
    solve = next(s for text, s in SOLUTIONS.items() if text in ctx.text)
    return "Running the fix.\n" + bash(solve)
