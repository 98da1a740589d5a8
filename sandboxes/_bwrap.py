"""The bubblewrap backend, for machines without Docker: one namespace per job.

Fresh namespaces per job (docs/sandboxes.md); the same worker as in Docker runs the one
job and exits, and the namespace dies with every process left in it. Where cgroups are
writable (root), each job runs in its own pids and memory groups (:mod:`sandboxes._cgroup`):
a real process cap and an OOM-killed job over its memory. Elsewhere the limits are rlimits:
memory is an address-space cap (a job over it fails its allocations; ``oom_killed``
reports it) and processes are capped per user. ``cpus`` is not enforced.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import shutil
import signal
import time
import warnings

from sandboxes._cgroup import JobCgroup, cgroups_available
from sandboxes._protocol import (
    GRACE_S,
    JOB_UID,
    LINE_LIMIT,
    WORKER,
    failed,
    job_line,
    read_message,
    to_result,
)
from sandboxes._types import Job, Result, SandboxError, SandboxUnavailable

__all__ = ["BwrapBackend"]


class BwrapBackend:
    """Runs each job in a new bubblewrap namespace; at most ``size`` at once."""

    name = "bwrap"

    def __init__(self, *, size: int = 2, bwrap: str = "bwrap") -> None:
        if size < 1:
            raise SandboxError(f"size must be at least 1, got {size}")
        self.size = size
        self.bwrap = bwrap
        self._slots = asyncio.Semaphore(size)
        self._closed = False
        self._cgroups = False

    async def start(self, warm: object = None) -> None:
        path = shutil.which(self.bwrap)
        if path is None:
            raise SandboxUnavailable(
                "bubblewrap is not installed (Debian: `apt-get install bubblewrap`)"
            )
        self.bwrap = path
        self._cgroups = cgroups_available()
        if not self._cgroups and os.geteuid() == 0:
            warnings.warn(
                "no writable cgroup v1 pids/memory hierarchy: bubblewrap jobs run by root are "
                "bounded by rlimits only, which do not cap root's processes",
                RuntimeWarning,
                stacklevel=2,
            )
        probe = await self.run(Job(cmd=["true"]))
        if probe.exit_code != 0 or probe.error:
            raise SandboxUnavailable(
                f"bubblewrap cannot create a sandbox here: {probe.error or probe.stderr.strip()}"
            )

    def _argv(self, job: Job) -> list[str]:
        tmpfs = str(job.limits.tmpfs_mb << 20)
        return [
            self.bwrap, "--unshare-all", "--unshare-user", "--die-with-parent", "--new-session",
            "--ro-bind", "/usr", "/usr",
            "--symlink", "usr/bin", "/bin", "--symlink", "usr/lib", "/lib",
            "--symlink", "usr/lib64", "/lib64", "--symlink", "usr/sbin", "/sbin",
            "--proc", "/proc", "--dev", "/dev",
            "--size", tmpfs, "--tmpfs", "/tmp", "--size", tmpfs, "--tmpfs", "/work",
            "--ro-bind", str(WORKER), "/opt/agentenv/worker.py", "--dir", "/etc",
            "--remount-ro", "/", "--disable-userns",
            "--chdir", "/work", "--clearenv", "--setenv", "PATH", "/usr/bin:/bin",
            "--uid", str(JOB_UID), "--gid", str(JOB_UID),
            "python3", "-I", "-S", "/opt/agentenv/worker.py", "--once",
        ]  # fmt: skip

    async def run(self, job: Job) -> Result:
        if self._closed:
            raise SandboxError("the sandbox is closed")
        async with self._slots:
            return await self._run(job)

    async def _run(self, job: Job) -> Result:
        start = time.monotonic()
        argv = self._argv(job)
        group = None
        if self._cgroups:
            # The namespace's init, bubblewrap and the worker beside the job's own.
            group = JobCgroup(pids=job.limits.pids + 4, memory_mb=job.limits.memory_mb + 32)
            # A shell joins the groups, then becomes bubblewrap: nothing escapes them.
            join = 'for f in "$1" "$2"; do echo $$ > "$f" || exit 125; done; shift 2; exec "$@"'
            argv = ["/bin/sh", "-c", join, "sh", *group.procs_files, *argv]
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                limit=LINE_LIMIT,
                start_new_session=True,
            )
        except BaseException:
            if group is not None:
                await asyncio.to_thread(group.remove)
            raise
        assert proc.stdin and proc.stdout and proc.stderr
        try:
            hello = await read_message(proc.stdout, 30)
            if hello is None:
                err = (await proc.stderr.read(4096)).decode(errors="replace").strip()
                return failed(job, self.name, f"bubblewrap failed: {err}", 0.0, timed_out=False)
            limits_by_rlimit = group is None
            proc.stdin.write(
                job_line(job, rlimit_memory=limits_by_rlimit, rlimit_pids=limits_by_rlimit)
            )
            with contextlib.suppress(ConnectionError):
                await proc.stdin.drain()
            data = await read_message(proc.stdout, job.limits.timeout_s + GRACE_S)
            oom = group is not None and group.oom_kills() > 0
            if data is None or "exit_code" not in data:
                late = time.monotonic() - start >= job.limits.timeout_s
                # The job killed its own worker (same uid) or hung it: never a pass.
                return failed(
                    job,
                    self.name,
                    "out of memory"
                    if oom
                    else "the sandbox stopped answering"
                    if late
                    else "the job killed its sandbox",
                    time.monotonic() - start,
                    timed_out=late,
                )
            result = to_result(data, job, self.name)
            return dataclasses.replace(result, oom_killed=True) if oom else result
        finally:
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            if group is not None:
                await asyncio.to_thread(group.remove)

    async def aclose(self) -> None:
        self._closed = True
