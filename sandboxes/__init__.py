"""Isolated execution of untrusted code: a Docker warm pool and a bubblewrap fallback.

::

    from sandboxes import Limits, Sandbox

    async with Sandbox() as sandbox:  # Docker if a daemon answers, else bubblewrap
        r = await sandbox.run(["python3", "main.py"], files={"main.py": "print(6 * 7)"},
                              limits=Limits(timeout_s=5, memory_mb=256))
        assert r.ok and r.stdout == "42\\n"

:func:`check_python` scores model-written Python against unit tests so that the usual
reward hacks (exiting early, always-equal objects, patched asserts, fake output) fail.
"""

from sandboxes._container import SANDBOX_IMAGE, Container, build_image
from sandboxes._python import CodeVerdict, GradedTest, check_python
from sandboxes._sandbox import Sandbox
from sandboxes._types import Job, Limits, Result, SandboxError, SandboxUnavailable

__all__ = [
    "SANDBOX_IMAGE",
    "CodeVerdict",
    "Container",
    "GradedTest",
    "Job",
    "Limits",
    "Result",
    "Sandbox",
    "SandboxError",
    "SandboxUnavailable",
    "build_image",
    "check_python",
]
