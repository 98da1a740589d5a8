"""A child process spoken to in JSON lines (the verifiers workers, the mini-swe-agent harness)."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
from collections.abc import Mapping, Sequence
from typing import Any, Self

_GONE = (BrokenPipeError, ConnectionResetError, RuntimeError)


class LineProcess:
    """A started child: :meth:`send` it a line, :meth:`read` its next one. Its stderr is
    read all along (a full pipe would stall it), its last ``tail_lines`` kept."""

    def __init__(self, proc: asyncio.subprocess.Process, tail_lines: int) -> None:
        assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
        self.proc, self.stdin, self.stdout = proc, proc.stdin, proc.stdout
        self.stderr: collections.deque[str] = collections.deque(maxlen=tail_lines)
        self._drain = asyncio.ensure_future(self._keep_tail(proc.stderr))

    @classmethod
    async def start(
        cls, argv: Sequence[str], *, env: Mapping[str, str], line_limit: int, tail_lines: int
    ) -> Self:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=dict(env),
            limit=line_limit,
        )
        return cls(proc, tail_lines)

    async def _keep_tail(self, stream: asyncio.StreamReader) -> None:
        while line := await stream.readline():
            self.stderr.append(line.decode(errors="replace").rstrip())

    def stderr_tail(self, chars: int) -> str:
        return "\n".join(self.stderr)[-chars:].strip()

    def write(self, line: Mapping[str, Any]) -> None:
        """Queue one line; a dead child's broken pipe shows as the end of its stdout."""
        with contextlib.suppress(*_GONE):
            self.stdin.write((json.dumps(line) + "\n").encode())

    async def send(self, line: Mapping[str, Any]) -> None:
        """:meth:`write`, then wait until the pipe has room again."""
        self.write(line)
        with contextlib.suppress(*_GONE):
            await self.stdin.drain()

    async def read(self) -> dict[str, Any] | None:
        """The child's next line; ``None`` once its stdout has ended."""
        line = await self.stdout.readline()
        return json.loads(line) if line.strip() else None

    async def exit_code(self, grace_s: float = 5.0) -> int:
        """The exit code of a child whose stdout has ended (its stderr read to the end):
        no answer can come, so one still alive after ``grace_s`` is killed. Not killed at
        once: a kill first polls the process (``Popen.send_signal``), which reaps one that
        has just exited behind asyncio's child watcher, which then reports 255, not its code."""
        try:
            code = await asyncio.wait_for(asyncio.shield(self.proc.wait()), grace_s)
        except TimeoutError:
            self.kill()
            code = await asyncio.shield(self.proc.wait())
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._drain, 5)
        return code

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()

    async def aclose(self) -> None:
        """Kill the child if it still runs, and reap it."""
        if self.proc.returncode is None:
            self.kill()
        await asyncio.shield(self.proc.wait())
        self._drain.cancel()
