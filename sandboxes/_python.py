"""Scoring model-written Python against unit tests, robust to reward hacks.

The tests run in a grader process and the solution in another (see
:mod:`sandboxes._grader`); pass or fail is decided by the grader, outside the solution's
process, and reported with a random per-run nonce on the grader's last output line. The
sandbox job runs ``python3 -I -S`` (no site, no user paths, no ``PYTHON*`` variables, so a
``sitecustomize.py``, ``*.pth`` or ``conftest.py`` the solution drops is never loaded), and
the tests are handed to the grader on its standard input, never written where the
solution could read or change them.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

from sandboxes._grader import Unrepresentable, dumps, loads
from sandboxes._sandbox import Sandbox
from sandboxes._types import Job, Limits, Result, SandboxError

__all__ = ["CodeVerdict", "check_python"]

_GRADER = Path(__file__).with_name("_grader.py").read_text()


@dataclasses.dataclass(frozen=True, slots=True)
class CodeVerdict:
    """``passed`` only when the grader, tagged with this run's nonce, said so."""

    passed: bool
    reason: str
    result: Result


async def check_python(
    sandbox: Sandbox,
    solution: str,
    tests: str,
    *,
    entry_point: str,
    setup: str = "",
    check: str | None = "check",
    limits: Limits | None = None,
) -> CodeVerdict:
    """Run ``tests`` against the function ``entry_point`` defined by ``solution``.

    Args:
        sandbox: where to run; a :class:`Sandbox` not started yet starts on this first
            job (it stays up for the next ones: close it with ``aclose()`` or ``async
            with``).
        solution: the model's Python source; it must define ``entry_point``.
        tests: Python source run in the grader, where the solution's function is named
            ``entry_point`` and ``candidate``: asserts at top level and/or a function
            named by ``check`` (HumanEval's ``check(candidate)``), then called with it.
        entry_point: the name of the function under test.
        setup: trusted Python run in the grader before ``tests`` (e.g. HumanEval's prompt,
            whose helper functions some tests call).
        check: the name of the function in ``tests`` to call with the solution (default
            ``"check"``: ``tests`` must define it), or ``None`` when ``tests`` holds only
            top-level asserts.
        limits: the job's limits (default: the sandbox's).
    """
    if not entry_point.isidentifier():
        raise SandboxError(f"entry_point must be a Python identifier, got {entry_point!r}")
    limits = limits or sandbox.limits
    nonce = secrets.token_hex(16)
    spec = {
        "nonce": nonce,
        "solution": "solution.py",
        "entry_point": entry_point,
        "setup": setup,
        "tests": tests,
        "check": check,
        # The grader's own deadline comes first, so it can still report a verdict.
        "timeout_s": max(0.1, limits.timeout_s * 0.9 - 0.2),
    }
    job = Job(
        cmd=["python3", "-I", "-S", "_grader.py"],
        files={"solution.py": solution, "_grader.py": _GRADER},
        stdin=dumps(spec),
        limits=limits,
        separate_real_gid=True,
    )
    result = await sandbox.run(job)
    return CodeVerdict(*_verdict(result, nonce), result)


def _verdict(result: Result, nonce: str) -> tuple[bool, str]:
    if result.timed_out:
        return False, "timed out"
    if result.oom_killed:
        return False, "out of memory"
    if result.error:
        return False, result.error
    last = result.stdout.rstrip("\n").rsplit("\n", 1)[-1]
    try:
        report = loads(bytes.fromhex(last))
    except (ValueError, Unrepresentable):
        report = None
    if not isinstance(report, dict) or report.get("nonce") != nonce:
        return False, "the grader gave no verdict"
    if result.exit_code != 0:
        return False, f"the grader exited with status {result.exit_code}"
    return report.get("passed") is True, str(report.get("reason", ""))
