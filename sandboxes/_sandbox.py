"""``Sandbox``: the one object users hold -- a backend, its pool, and the job API."""

from __future__ import annotations

import asyncio
import logging
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Literal

from sandboxes._bwrap import BwrapBackend
from sandboxes._docker import DockerBackend, docker_available
from sandboxes._protocol import cpu_count
from sandboxes._types import Job, Limits, Result, SandboxError

__all__ = ["Sandbox"]

log = logging.getLogger("sandboxes")

BackendName = Literal["auto", "docker", "bwrap"]


class Sandbox:
    """Runs untrusted commands in isolation, many at once (used as the package docstring
    shows: ``async with Sandbox() as sandbox: await sandbox.run(...)``).

    Args:
        backend: ``"docker"`` (a warm pool of containers), ``"bwrap"`` (bubblewrap, one
            namespace per job) or ``"auto"``: Docker when a daemon answers, else bubblewrap
            with a warning.
        size: jobs running at once (Docker: warm containers). Default: the CPU count.
        limits: the default limits of a job (each job may give its own).
        image: Docker only: an image of your own (it must have ``python3``); default: a
            minimal image built locally on first use, with the host's ``/usr`` read-only.
    """

    def __init__(
        self,
        backend: BackendName = "auto",
        *,
        size: int | None = None,
        limits: Limits | None = None,
        image: str | None = None,
    ) -> None:
        if backend not in ("auto", "docker", "bwrap"):
            raise SandboxError(f"backend must be 'auto', 'docker' or 'bwrap', got {backend!r}")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise SandboxError(f"size must be a positive integer, got {size!r}")
        if image is not None and backend == "bwrap":
            raise SandboxError("image= is for the docker backend")
        self.requested = backend
        self.size = size or max(1, cpu_count())
        self.limits = limits or Limits()
        self.image = image
        self._backend: DockerBackend | BwrapBackend | None = None
        self._starting = asyncio.Lock()

    @property
    def backend(self) -> str:
        """The backend in use (after :meth:`start`)."""
        if self._backend is None:
            raise SandboxError("the sandbox is not started: use `async with Sandbox() as s:`")
        return self._backend.name

    async def start(self) -> Sandbox:
        """Pick and start the backend (warm containers for Docker). Concurrent callers
        (the first jobs of a lazily started sandbox) share one start."""
        async with self._starting:
            if self._backend is None:
                await self._start()
        return self

    async def _start(self) -> None:
        name = self.requested
        if name == "auto":
            problem = await docker_available()
            if problem is None:
                name = "docker"
            else:
                name = "bwrap"
                warnings.warn(
                    f"no Docker daemon answers ({problem}); running sandboxes with bubblewrap, "
                    "whose limits are rlimits rather than cgroups",
                    RuntimeWarning,
                    stacklevel=2,
                )
        backend = (
            DockerBackend(size=self.size, image=self.image)
            if name == "docker"
            else BwrapBackend(size=self.size)
        )
        await backend.start(self.limits)
        self._backend = backend
        log.info("sandbox backend %s, %d at once", name, self.size)

    async def __aenter__(self) -> Sandbox:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every container of this sandbox."""
        if self._backend is not None:
            backend, self._backend = self._backend, None
            await backend.aclose()

    async def run(
        self,
        cmd: Sequence[str] | Job,
        *,
        files: Mapping[str, str | bytes] | None = None,
        stdin: str | bytes = b"",
        limits: Limits | None = None,
        id: str | None = None,
    ) -> Result:
        """Run one command (or a prepared :class:`Job`) in a clean sandbox."""
        job = (
            cmd
            if isinstance(cmd, Job)
            else Job(cmd=cmd, files=files or {}, stdin=stdin, limits=limits or self.limits, id=id)
        )
        if self._backend is None:
            await self.start()
        assert self._backend is not None
        return await self._backend.run(job)

    async def run_many(self, jobs: Iterable[Job]) -> list[Result]:
        """Run every job (``size`` at a time); results in the jobs' order."""
        return list(await asyncio.gather(*(self.run(j) for j in jobs)))
