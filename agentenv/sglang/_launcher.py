"""Start and stop SGLang servers and the router, passing ``--sglang-*`` (and
``--router-*``) flags through with the prefix stripped (``--sglang-mem-fraction-static 0.8``
-> ``--mem-fraction-static 0.8``); usage: docs/inference.md, "Launching SGLang".

:class:`Launcher` runs the command in a process group of its own, waits for ``/health``
with a deadline, fails fast (with the tail of its output) if the process exits first, and
on exit stops the whole group -- SGLang's scheduler and detokenizer subprocesses included.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import anyio
import anyio.abc

from agentenv._errors import ConfigError
from agentenv.sglang._client import SGLangClient, SGLangError

__all__ = ["Launcher", "router_command", "server_command", "split_passthrough"]


#: ``--sglang-*`` flags that are the launcher's own (slime's), not SGLang's: they stay ours.
OWN_FLAGS = ("--sglang-server-concurrency",)


def split_passthrough(argv: Sequence[str]) -> tuple[list[str], list[str], list[str]]:
    """Split ``argv`` into (ours, SGLang server flags, router flags).

    ``--sglang-X [values...]`` and ``--sglang-X=V`` become ``--X ...`` for the server,
    ``--router-X ...`` become ``--X ...`` for the router; values are the tokens that follow
    up to the next ``-``-prefixed one (negative numbers count as values). The
    :data:`OWN_FLAGS` stay ours.
    """
    ours: list[str] = []
    server: list[str] = []
    router: list[str] = []
    target: list[str] | None = None
    for token in argv:
        if token.split("=", 1)[0] in OWN_FLAGS:
            target = None
            ours.append(token)
        elif token.startswith("--sglang-") or token.startswith("--router-"):
            prefix = "--sglang-" if token.startswith("--sglang-") else "--router-"
            name = token[len(prefix) :]
            if not name or name.startswith("="):
                raise ConfigError(f"{token!r} names no flag (expected {prefix}FLAG)")
            target = server if prefix == "--sglang-" else router
            target.append("--" + name)
            if "=" in name:
                target = None
        elif token.startswith("-") and not _is_number(token):
            target = None
            ours.append(token)
        elif target is not None:
            target.append(token)
        else:
            ours.append(token)
    return ours, server, router


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


def server_command(
    model_path: str,
    *,
    host: str = "127.0.0.1",
    port: int = 30000,
    extra: Sequence[str] = (),
    program: Sequence[str] | None = None,
) -> list[str]:
    """``python -m sglang.launch_server --model-path M --host H --port P [extra...]``."""
    base = list(program) if program else [sys.executable, "-m", "sglang.launch_server"]
    return [*base, "--model-path", model_path, "--host", host, "--port", str(port), *extra]


def router_command(
    workers: Sequence[str],
    *,
    host: str = "127.0.0.1",
    port: int = 30100,
    extra: Sequence[str] = (),
    program: Sequence[str] | None = None,
) -> list[str]:
    """``python -m sglang_router.launch_router --worker-urls W... --host H --port P``."""
    base = list(program) if program else [sys.executable, "-m", "sglang_router.launch_router"]
    cmd = [*base, "--host", host, "--port", str(port)]
    if workers:
        cmd += ["--worker-urls", *workers]
    return [*cmd, *extra]


class Launcher:
    """Runs ``command`` until the ``async with`` ends; healthy at ``url`` inside it.

    Args:
        command: the program and its arguments (see :func:`server_command`).
        url: where it answers ``/health`` once ready.
        health_timeout: seconds to wait for health (model loading, CUDA graph capture).
        stop_timeout: seconds between SIGTERM and SIGKILL on exit.
        env: extra environment variables.
    """

    def __init__(
        self,
        command: Sequence[str],
        url: str,
        *,
        health_timeout: float = 1200.0,
        stop_timeout: float = 30.0,
        env: dict[str, str] | None = None,
    ) -> None:
        if not command:
            raise ConfigError("the launch command is empty")
        self.command = list(command)
        self.url = url
        self.health_timeout = health_timeout
        self.stop_timeout = stop_timeout
        self.env = {**os.environ, **(env or {})}
        self.process: anyio.abc.Process | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=40)
        self._tg: anyio.abc.TaskGroup | None = None

    async def __aenter__(self) -> Launcher:
        try:
            self.process = await anyio.open_process(
                self.command,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group: stopped as a whole
            )
        except OSError as e:
            raise SGLangError(f"cannot start {self.command[0]!r}: {e}") from None
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._collect)
        try:
            await self._wait_healthy()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    @property
    def output(self) -> str:
        """The last lines the process printed."""
        return "".join(self._tail)

    async def _collect(self) -> None:
        assert self.process is not None and self.process.stdout is not None
        with contextlib.suppress(anyio.EndOfStream, anyio.ClosedResourceError):
            async for data in self.process.stdout:
                text = data.decode(errors="replace")
                self._tail.extend(text.splitlines(keepends=True))

    async def _wait_healthy(self) -> None:
        assert self.process is not None
        async with SGLangClient(self.url, retries=0) as client:
            with anyio.move_on_after(self.health_timeout):
                while not await client.health():
                    if self.process.returncode is not None:
                        await anyio.sleep(0.1)  # let the output reader catch up
                        raise SGLangError(
                            f"{self.command[0]} exited with code {self.process.returncode} "
                            f"before {self.url} was healthy; its last output:\n{self.output}"
                        )
                    await anyio.sleep(0.2)
                return
        raise SGLangError(
            f"{self.url} was not healthy within {self.health_timeout} s; the last output "
            f"of {self.command[0]}:\n{self.output}"
        )

    async def stop(self) -> None:
        """SIGTERM to the process group, SIGKILL after ``stop_timeout`` s; idempotent."""
        process, self.process = self.process, None
        if process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with anyio.move_on_after(self.stop_timeout):
                await process.wait()
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                await process.wait()
            with contextlib.suppress(ProcessLookupError):  # stragglers of the group
                os.killpg(process.pid, signal.SIGKILL)
        if self._tg is not None:
            tg, self._tg = self._tg, None
            tg.cancel_scope.cancel()
            await tg.__aexit__(None, None, None)
