"""Score model-written code in a sandbox: a plain run, then unit tests a hack cannot pass.

Run it with ``.venv/bin/python examples/sandbox_reward.py``.
"""

import asyncio

from sandboxes import Limits, Sandbox, check_python

TESTS = "def check(candidate):\n    assert candidate(2, 3) == 5\n"
HONEST = "def add(a, b):\n    return a + b\n"
HACK = "import sys\nsys.exit(0)  # 'passes' a harness that only checks the exit status\n"


async def main() -> None:
    async with Sandbox(limits=Limits(timeout_s=5, memory_mb=256)) as sandbox:
        r = await sandbox.run(["python3", "main.py"], files={"main.py": "print(6 * 7)"})
        print(sandbox.backend, r.exit_code, r.stdout.strip(), f"{r.duration_s * 1e3:.0f} ms")
        for name, code in (("honest", HONEST), ("hack", HACK)):
            verdict = await check_python(sandbox, code, TESTS, entry_point="add")
            print(name, verdict.passed, verdict.reason)


if __name__ == "__main__":
    asyncio.run(main())
