"""Scoring model-written Python against unit tests, robust to reward hacks.

The tests run in a grader process apart from the solution's (:mod:`sandboxes._grader`),
handed to it on its standard input, never written where the solution could read or change
them; the job runs ``python3 -I -S``, so a ``sitecustomize.py``, ``*.pth`` or
``conftest.py`` the solution drops is never loaded.
"""

from __future__ import annotations

import dataclasses
import secrets
from pathlib import Path

from sandboxes._grader import Unrepresentable, dumps, loads
from sandboxes._sandbox import Sandbox
from sandboxes._types import Job, Limits, Result, SandboxError

__all__ = ["CodeVerdict", "GradedTest", "check_python"]

_GRADER = Path(__file__).with_name("_grader.py").read_text()


@dataclasses.dataclass(frozen=True, slots=True)
class GradedTest:
    """One test's outcome: its ``name`` (``check``, a ``test*`` function, or ``tests``
    for top-level asserts), whether it ``passed``, and ``reason`` (``"passed"``, or the
    failing line, the solution's error, "the solution ran out of time", ...)."""

    name: str
    passed: bool
    reason: str


@dataclasses.dataclass(frozen=True, slots=True)
class CodeVerdict:
    """``passed`` only when the grader, tagged with this run's nonce, said every test
    passed; ``tests`` holds each test's outcome (empty when no test ran: the solution did
    not load, the job timed out or ran out of memory)."""

    passed: bool
    reason: str
    result: Result
    tests: tuple[GradedTest, ...] = ()

    @property
    def fraction_passed(self) -> float:
        """The share of the tests that passed (0.0 when none ran): a graded reward."""
        if not self.tests:
            return 0.0
        return sum(t.passed for t in self.tests) / len(self.tests)


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
        sandbox: where to run (one not started yet starts on this job and stays up).
        solution: the model's Python source; it must define ``entry_point``.
        tests: Python source run in the grader, where the solution's function is named
            ``entry_point`` and ``candidate``: the function named by ``check``, called with
            it, then every ``test*`` function, or else the top-level asserts, each test
            graded apart in ``verdict.tests`` (docs/sandboxes.md: how they share the
            solution's process and time).
        entry_point: the name of the function under test.
        setup: trusted Python run in the grader before ``tests`` (e.g. HumanEval's prompt,
            whose helper functions some tests call).
        check: the name of the function in ``tests`` to call with the solution (default
            ``"check"``: ``tests`` must define it unless it defines ``test*``
            functions), or ``None`` when ``tests`` holds only ``test*`` functions or
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
    passed, reason, graded = _verdict(result, nonce)
    return CodeVerdict(passed, reason, result, graded)


def _verdict(result: Result, nonce: str) -> tuple[bool, str, tuple[GradedTest, ...]]:
    if result.timed_out:
        return False, "timed out", ()
    if result.oom_killed:
        return False, "out of memory", ()
    if result.error:
        return False, result.error, ()
    last = result.stdout.rstrip("\n").rsplit("\n", 1)[-1]
    try:
        report = loads(bytes.fromhex(last))
    except (ValueError, Unrepresentable):
        report = None
    if not isinstance(report, dict) or report.get("nonce") != nonce:
        if result.stdout_truncated:
            return (
                False,
                (
                    f"the grader's verdict did not fit limits.output_bytes "
                    f"({len(result.stdout)} bytes; up to ~640 per test): raise output_bytes"
                ),
                (),
            )
        return False, "the grader gave no verdict", ()
    if result.exit_code != 0:
        return False, f"the grader exited with status {result.exit_code}", ()
    graded = _graded(report.get("tests"))
    if graded is None:
        return False, "the grader gave a malformed verdict", ()
    passed = report.get("passed") is True and bool(graded) and all(t.passed for t in graded)
    return passed, str(report.get("reason", "")), graded


def _graded(tests: object) -> tuple[GradedTest, ...] | None:
    """The per-test outcomes of a verdict, or None when they are not what the grader
    writes (a list of ``[name, passed, reason]``)."""
    if type(tests) is not list:
        return None
    out: list[GradedTest] = []
    for entry in tests:
        if type(entry) is not list or len(entry) != 3:
            return None
        name, passed, reason = entry
        if type(name) is not str or type(passed) is not bool or type(reason) is not str:
            return None
        out.append(GradedTest(name, passed, reason))
    return tuple(out)
