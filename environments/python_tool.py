"""A Python interpreter any tool-use environment can offer: the code runs in a sandbox.

::

    from environments.python_tool import python_interpreter

    class MathWithPython(ToolEnv):
        tools = (python_interpreter(),)
        rubric = Rubric(correct)

The model calls ``python(code=...)``; it gets back what the program printed, its errors
and exit status, or that it timed out -- every run in a fresh, locked-down sandbox
(:mod:`sandboxes`; Docker when a daemon answers, else bubblewrap).
"""

from __future__ import annotations

from agentenv import Tool
from sandboxes import Limits, Result, Sandbox

__all__ = ["format_result", "python_interpreter"]

MAX_CHARS = 4000


def format_result(r: Result, *, max_chars: int = MAX_CHARS) -> str:
    """A run's outcome as the model reads it: output, errors, status; long output cut."""
    parts = []
    if r.stdout:
        parts.append(
            _cut(r.stdout, max_chars) + (" [output truncated]" if r.stdout_truncated else "")
        )
    if r.stderr:
        parts.append("stderr:\n" + _cut(r.stderr, max_chars))
    if r.timed_out:
        parts.append(f"error: timed out after {r.duration_s:.1f} s")
    elif r.oom_killed:
        parts.append("error: out of memory")
    elif r.error:
        parts.append(f"error: {r.error}")
    elif r.exit_code != 0:
        parts.append(f"exit status {r.exit_code}")
    return "\n".join(parts) or "(no output)"


def _cut(text: str, n: int) -> str:
    return text if len(text) <= n else text[: n // 2] + "\n...\n" + text[-n // 2 :]


def python_interpreter(
    sandbox: Sandbox | None = None, *, limits: Limits | None = None, name: str = "python"
) -> Tool:
    """A :class:`~agentenv.Tool` named ``name`` that runs Python code in ``sandbox``.

    Args:
        sandbox: where to run (default: a :class:`~sandboxes.Sandbox` started on first use).
        limits: per-call limits (default: 10 s, 512 MB).
        name: the tool's name as the model sees it.
    """
    box = sandbox or Sandbox()
    job_limits = limits or Limits(timeout_s=10)

    async def python(code: str) -> str:
        """Run a Python 3 program and return what it printed.

        Args:
            code: the complete program; use print() to show results.
        """
        r = await box.run(["python3", "main.py"], files={"main.py": code}, limits=job_limits)
        return format_result(r)

    return Tool(python, name=name, timeout_s=job_limits.timeout_s + 30)
