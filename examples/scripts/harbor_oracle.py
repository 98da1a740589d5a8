"""A scripted agent for ``harbor``: it runs the task's reference ``solution/solve.sh`` with
the ``bash`` tool, then stops -- every bundled task should score 1.0. Use with
``--model scripted:examples/scripts/harbor_oracle.py``.
"""

import json

from environments.harbor import load_tasks

SOLUTIONS = {t.instruction.strip(): t.solution for t in load_tasks()}


def reply(ctx) -> str:  # type: ignore[no-untyped-def]
    if "<|im_start|>tool" in ctx.text:  # the tool answered: done
        return "Done."
    solve = next(s for text, s in SOLUTIONS.items() if text in ctx.text)
    call = {"name": "bash", "arguments": {"command": solve}}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"
