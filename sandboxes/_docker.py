"""The Docker backend: a warm pool of locked-down containers, one worker in each.

A job is one line to the container's worker (:mod:`sandboxes._worker`) and one line back,
so it costs a fork, not a container. The worker is the main process of a ``docker run -i
--rm``, reading jobs from that command's stdin: a container never outlives the process
that started it. Every Docker call is a ``docker`` subprocess, so none blocks the event
loop. The lock-down and the default image (a tiny root file system made here and ``docker
import``-ed, the host's ``/usr`` mounted read-only): docs/sandboxes.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Coroutine
from typing import Any

from sandboxes._protocol import (
    GRACE_S,
    JOB_UID,
    LINE_LIMIT,
    WORKER,
    failed,
    job_line,
    read_message,
    run_command,
    tar_bytes,
    to_result,
)
from sandboxes._types import Job, Limits, Result, SandboxError, SandboxUnavailable

__all__ = ["DockerBackend", "docker_available", "ensure_image"]

IMAGE = "agentenv-sandbox:2"
LABEL = "agentenv.sandbox"
# Memory and pids the worker, init and sleep need beside the job's own.
_WORKER_MB = 48
_WORKER_PIDS = 8
_START_HINT = (
    "start one with `dockerd --bridge=none --iptables=false &` as root (`make test` does), "
    "or use backend='bwrap'"
)


async def docker_available(docker: str = "docker", limit_s: float = 10.0) -> str | None:
    """None if a Docker daemon answers, else why not."""
    try:
        await run_command(docker, "version", "--format", "{{.Server.Version}}", limit_s=limit_s)
    except SandboxError as e:
        return str(e)
    return None


async def ensure_image(docker: str = "docker") -> None:
    """Make the default image unless it exists."""
    with contextlib.suppress(SandboxError):
        await run_command(docker, "image", "inspect", IMAGE, limit_s=30)
        return
    await run_command(docker, "import", "-", IMAGE, stdin=_rootfs(), limit_s=120)


def _rootfs() -> bytes:
    """A root file system of links and mount points (the host's /usr is mounted in)."""
    # /sbin stays a directory: Docker mounts its init at /sbin/docker-init.
    dirs = ("usr", "etc", "proc", "sys", "dev", "work", "opt", "opt/agentenv", "run", "sbin")
    links = ("bin", "lib", "lib64", "lib32", "libx32")
    passwd = b"root:x:0:0:root:/root:/bin/sh\nsandbox:x:1000:1000:sandbox:/work:/bin/sh\n"
    return tar_bytes(
        [
            *((d, 0o755, None) for d in dirs),
            ("tmp", 0o1777, None),
            *((name, 0o644, f"usr/{name}") for name in links),
            ("etc/passwd", 0o644, passwd),
            ("etc/group", 0o644, b"root:x:0:\nsandbox:x:1000:\n"),
        ]
    )


class _Container:
    """One warm container and the worker process attached to it."""

    def __init__(self, backend: DockerBackend, limits: Limits) -> None:
        self.backend = backend
        self.shape = limits.shape()
        self.limits = limits
        self.name = f"agentenv-sandbox-{uuid.uuid4().hex[:12]}"
        self.proc: asyncio.subprocess.Process | None = None
        self._drain: asyncio.Future[None] | None = None

    async def start(self) -> None:
        b = self.backend
        cpus, memory_mb, pids, tmpfs_mb = self.shape
        mem = memory_mb + _WORKER_MB
        args = [
            b.docker, "run", "-i", "--rm", "--name", self.name,
            "--label", f"{LABEL}={b.pool_id}",
            "--init", "--network", "none", "--read-only", "--user", "0:0",
            "--cap-drop", "ALL", "--cap-add", "SETUID", "--cap-add", "SETGID",
            "--cap-add", "KILL", "--security-opt", "no-new-privileges",
            "--memory", f"{mem}m", "--memory-swap", f"{mem}m",
            "--pids-limit", str(pids + _WORKER_PIDS), "--cpus", f"{cpus:g}",
            "--tmpfs", f"/tmp:size={tmpfs_mb}m,uid={JOB_UID},gid={JOB_UID},mode=1777",
            "--tmpfs", f"/work:size={tmpfs_mb}m,uid={JOB_UID},gid={JOB_UID},mode=0755",
            "--shm-size", f"{min(tmpfs_mb, 64)}m",
            "-v", f"{WORKER}:/opt/agentenv/worker.py:ro",
        ]  # fmt: skip
        if b.image == IMAGE:
            args += ["-v", "/usr:/usr:ro"]
        # The worker is the container's main process (under Docker's init), attached to
        # this process's pipe: if the host side dies, the worker reads end of file, exits,
        # and --rm removes the container -- no container outlives its pool.
        args += [
            b.image, "python3", "-I", "-S", "/opt/agentenv/worker.py",
            "--uid", str(JOB_UID), "--gid", str(JOB_UID),
        ]  # fmt: skip
        self.proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            limit=LINE_LIMIT,
        )
        assert self.proc.stdout is not None
        hello = await read_message(self.proc.stdout, 120)
        if not hello or not hello.get("ready"):
            err = b""
            if self.proc.stderr is not None:
                with contextlib.suppress(TimeoutError):
                    err = await asyncio.wait_for(self.proc.stderr.read(2000), 5)
            await self.kill()
            raise SandboxError(
                f"the sandbox worker did not start in a container of image {b.image!r} "
                f"(it needs python3): {err.decode(errors='replace').strip()}"
            )
        # Docker's own messages after start-up are not needed; keep the pipe from filling.
        self._drain = asyncio.ensure_future(self._discard_stderr())

    async def _discard_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        while await self.proc.stderr.read(1 << 16):
            pass

    async def run(self, job: Job) -> Result:
        """The job's result; a failed one when the container broke (then it is gone)."""
        assert self.proc is not None and self.proc.stdin and self.proc.stdout
        start = time.monotonic()
        try:
            self.proc.stdin.write(job_line(job))
            await self.proc.stdin.drain()
        except (ConnectionError, RuntimeError):
            await self.kill()
            return failed(job, "docker", "the sandbox container died", 0.0, timed_out=False)
        data = await read_message(self.proc.stdout, job.limits.timeout_s + GRACE_S)
        if data is None or "exit_code" not in data:
            late = time.monotonic() - start >= job.limits.timeout_s
            await self.kill()
            return failed(
                job,
                "docker",
                "the sandbox stopped answering; its container was replaced"
                if late
                else "the sandbox container died during the job; it was replaced",
                time.monotonic() - start,
                timed_out=late,
            )
        return to_result(data, job, "docker")

    async def wait_ready(self) -> bool:
        """Wait for the worker's clean-up after a job; False (and gone) if it hangs."""
        assert self.proc is not None and self.proc.stdout
        ready = await read_message(self.proc.stdout, 30)
        if not ready or not ready.get("ready"):
            await self.kill()
            return False
        return True

    async def kill(self) -> None:
        if self.proc is not None and self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(SandboxError):
            await run_command(self.backend.docker, "rm", "-f", self.name, limit_s=60)
        if self.proc is not None:
            await self.proc.wait()
        if self._drain is not None:
            self._drain.cancel()


class DockerBackend:
    """Runs jobs in a warm pool of at most ``size`` containers.

    Containers are made for a shape of limits (CPU, memory, pids, tmpfs size); a job
    with other such limits gets a container of its own shape (replacing an idle one when
    the pool is full). Timeouts, open files and output caps apply per job in any
    container.
    """

    name = "docker"

    def __init__(self, *, size: int = 2, image: str | None = None, docker: str = "docker") -> None:
        if size < 1:
            raise SandboxError(f"size must be at least 1, got {size}")
        self.size = size
        self.image = image or IMAGE
        self.docker = docker
        self.pool_id = uuid.uuid4().hex[:12]
        self._idle: list[_Container] = []
        self._count = 0  # containers alive or starting
        self._slots = asyncio.Semaphore(size)
        self._changed = asyncio.Condition()
        self._closed = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def start(self, warm: Limits | None = None) -> None:
        """Check the daemon, build the default image if needed, start the warm pool."""
        problem = await docker_available(self.docker)
        if problem is not None:
            raise SandboxUnavailable(f"no Docker daemon answers ({problem}); {_START_HINT}")
        if self.image == IMAGE:
            await ensure_image(self.docker)
        limits = warm or Limits()
        containers = [_Container(self, limits) for _ in range(self.size)]
        self._count += len(containers)
        results = await asyncio.gather(*(c.start() for c in containers), return_exceptions=True)
        for c, r in zip(containers, results, strict=True):
            if isinstance(r, BaseException):
                self._count -= 1
            else:
                self._idle.append(c)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors and not self._idle:
            raise errors[0]

    async def run(self, job: Job) -> Result:
        if self._closed:
            raise SandboxError("the sandbox pool is closed")
        async with self._slots:
            container = await self._take(job.limits)
            try:
                result = await container.run(job)
            except BaseException:  # cancelled mid-job: the container's state is unknown
                self._spawn(self._discard(container))
                raise
            if container.proc is not None and container.proc.returncode is None:
                self._spawn(self._back_after_cleanup(container))
            else:
                await self._gone()
            return result

    async def _discard(self, container: _Container) -> None:
        await container.kill()
        await self._gone()

    async def _take(self, limits: Limits) -> _Container:
        shape = limits.shape()
        async with self._changed:
            # A container still cleaning up after its last job is neither idle nor free.
            while self._count >= self.size and not self._idle:
                await self._changed.wait()
            for i, c in enumerate(self._idle):
                if c.shape == shape:
                    return self._idle.pop(i)
            if self._count >= self.size:
                # Full of other shapes: replace the longest idle one.
                old = self._idle.pop(0)
                self._count -= 1
                self._spawn(old.kill())
            self._count += 1
        container = _Container(self, limits)
        try:
            await container.start()
        except BaseException:
            await self._gone()
            raise
        return container

    async def _gone(self) -> None:
        """A container left the pool: room for a new one."""
        async with self._changed:
            self._count -= 1
            self._changed.notify()

    async def _back_after_cleanup(self, container: _Container) -> None:
        if await container.wait_ready() and not self._closed:
            async with self._changed:
                self._idle.append(container)
                self._changed.notify()
        else:
            await self._discard(container)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        """Remove every container of this pool."""
        self._closed = True
        if self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        idle, self._idle = self._idle, []
        await asyncio.gather(*(c.kill() for c in idle), return_exceptions=True)
        # Containers a cancelled job left behind, found by this pool's label.
        with contextlib.suppress(SandboxError):
            ids = (
                await run_command(
                    self.docker, "ps", "-aq", "--filter", f"label={LABEL}={self.pool_id}"
                )
            ).split()
            if ids:
                await run_command(self.docker, "rm", "-f", *ids, limit_s=60)
