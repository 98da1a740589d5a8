"""A long-lived container whose commands share one file system: an agent's machine.

One ``docker run`` kept for an episode, locked down like the pool's containers but with
the image's own file system writable, as a task image expects (docs/sandboxes.md). Its
process 1 is a shell looping on ``sleep``: the kernel delivers no signal to a namespace's
init from inside it, so :meth:`Container.kill_all` (``kill -9 -1`` as root) ends everything
a command left running while the container stays, and the shell reaps the orphans.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

from sandboxes._docker import IMAGE, LABEL, docker_available, ensure_image
from sandboxes._protocol import run_command, tar_bytes
from sandboxes._types import Limits, Result, SandboxError, SandboxUnavailable

__all__ = ["SANDBOX_IMAGE", "Container", "build_image"]

SANDBOX_IMAGE = IMAGE
"""The locally built default image (``FROM`` it in a Dockerfile: it has no ``/usr`` of its
own; a :class:`Container` of an image built on it mounts the host's ``/usr`` read-only)."""

# What root inside needs to act as root on the image's files (a test script reading the
# agent's files, chown-ing, killing): Docker's defaults minus raw sockets, device nodes,
# chroot, file capabilities and audit.
_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "SETUID", "SETGID")
_INIT = "while :; do sleep 5; done"
_GRACE_S = 10.0  # how long past a command's limit the host waits before killing its client


async def build_image(context: str | Path, tag: str, *, timeout_s: float = 600.0) -> str:
    """Build ``context``'s Dockerfile as ``tag`` unless an image of that tag exists.

    Returns ``tag``. The default sandbox image (:data:`SANDBOX_IMAGE`) is made first, so a
    Dockerfile may start ``FROM`` it with no registry. A failed build raises
    :class:`SandboxError` with the builder's last output lines.
    """
    problem = await docker_available()
    if problem is not None:
        raise SandboxUnavailable(f"no Docker daemon answers ({problem})")
    with contextlib.suppress(SandboxError):
        await run_command("docker", "image", "inspect", tag, limit_s=30)
        return tag
    await ensure_image()
    try:
        await run_command("docker", "build", "-q", "-t", tag, str(context), limit_s=timeout_s)
    except SandboxError as e:
        text = str(e)
        lines = [ln for ln in text.splitlines() if ln.strip() and "DEPRECATED" not in ln]
        raise SandboxError(
            f"docker build of {str(context)!r} failed: {' | '.join(lines[-6:])[-1500:]}"
        ) from None
    return tag


class Container:
    """One locked-down container for the length of an episode.

    ::

        async with Container("my-task:1", limits=Limits(memory_mb=512)) as box:
            r = await box.exec(["bash", "-c", "echo hi > /app/x && cat /app/x"])

    Args:
        image: a local image (it needs ``sleep`` and whatever the commands run).
        limits: ``memory_mb``, ``cpus``, ``pids`` and ``tmpfs_mb`` (``/tmp``) of the
            container; ``timeout_s`` and ``output_bytes`` are each command's defaults.
        user: who commands run as by default (``"1000:1000"``: not root).
        workdir: the directory commands start in (default: the image's).
        host_usr: mount the host's ``/usr`` read-only (for images built on
            :data:`SANDBOX_IMAGE`, which have none).
    """

    def __init__(
        self,
        image: str,
        *,
        limits: Limits | None = None,
        user: str = "1000:1000",
        workdir: str | None = None,
        host_usr: bool = False,
    ) -> None:
        self.image = image
        self.limits = limits or Limits()
        self.user = user
        self.workdir = workdir
        self.host_usr = host_usr
        self.name = f"agentenv-box-{uuid.uuid4().hex[:12]}"
        self.started = False

    async def start(self) -> Container:
        """Start the container (no network, limits applied)."""
        lim = self.limits
        args = [
            "docker", "run", "-d", "--rm", "--name", self.name, "--label", f"{LABEL}=box",
            "--network", "none", "--cap-drop", "ALL",
            *(a for cap in _CAPS for a in ("--cap-add", cap)),
            "--security-opt", "no-new-privileges",
            "--memory", f"{lim.memory_mb}m", "--memory-swap", f"{lim.memory_mb}m",
            "--pids-limit", str(lim.pids), "--cpus", f"{lim.cpus:g}",
            "--tmpfs", f"/tmp:size={lim.tmpfs_mb}m,mode=1777",
            "--ulimit", f"nofile={lim.open_files}:{lim.open_files}", "--ulimit", "core=0",
        ]  # fmt: skip
        if self.host_usr:
            args += ["-v", "/usr:/usr:ro"]
        # Process 1 (see the module docstring) is a shell, not a plain ``sleep``, which
        # would leave the orphans handed to it as zombies filling the pids limit.
        args += ["--entrypoint", "sh", self.image, "-c", _INIT]
        try:
            await run_command(*args, limit_s=120)
        except BaseException:
            # Cancelled or failed half-way: a container may exist; never leave it running.
            await asyncio.shield(self._remove())
            raise
        self.started = True
        return self

    async def _remove(self) -> None:
        with contextlib.suppress(SandboxError):
            await run_command("docker", "rm", "-f", self.name, limit_s=60)

    async def __aenter__(self) -> Container:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Remove the container and everything in it."""
        if self.started:
            self.started = False
            await self._remove()

    async def exec(
        self,
        cmd: Sequence[str],
        *,
        user: str | None = None,
        workdir: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
        output_bytes: int | None = None,
    ) -> Result:
        """Run ``cmd`` in the container; its processes are killed after ``timeout_s``.

        The limit is kept inside the container (coreutils ``timeout``, which kills the
        command's whole process group), so what the command started dies with it.
        """
        if not self.started:
            raise SandboxError("the container is not started: use `async with Container(...)`")
        limit = self.limits.timeout_s if timeout_s is None else timeout_s
        cap = self.limits.output_bytes if output_bytes is None else output_bytes
        args = ["docker", "exec", "-u", user or self.user]
        wd = workdir or self.workdir
        if wd:
            args += ["-w", wd]
        for key, value in (env or {}).items():
            args += ["-e", f"{key}={value}"]
        args += [self.name, "timeout", "-s", "KILL", f"{limit:g}", *cmd]
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None and proc.stderr is not None
        reads = asyncio.gather(_read_capped(proc.stdout, cap), _read_capped(proc.stderr, cap))
        error = None
        try:
            (out, out_cut), (err, err_cut) = await asyncio.wait_for(reads, limit + _GRACE_S)
            code = await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            out, out_cut, err, err_cut = b"", False, b"", False
            code, error = -9, "the container stopped answering"
        duration = time.monotonic() - start
        # ``timeout -s KILL`` exits 137 (128 + 9) when it killed the command.
        timed_out = code == 137 and duration >= limit
        if code == 137 and not timed_out:
            oom = await self._oom_killed()
        else:
            oom = False
        return Result(
            exit_code=-9 if (timed_out or code == 137) else code,
            stdout=out.decode(errors="replace"),
            stderr=err.decode(errors="replace"),
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
            timed_out=timed_out or error == "the container stopped answering",
            oom_killed=oom,
            duration_s=duration,
            backend="docker",
            error=error,
        )

    async def _oom_killed(self) -> bool:
        with contextlib.suppress(SandboxError):
            out = await run_command(
                "docker", "inspect", "-f", "{{.State.OOMKilled}}", self.name, limit_s=30
            )
            return out.strip() == "true"
        return False

    async def kill_all(self) -> None:
        """Kill every process in the container but its init (as root: what any user left)."""
        # Twice: a process forking while the first sweep ran has a child the second finds.
        script = "kill -9 -1 2>/dev/null; kill -9 -1 2>/dev/null; true"
        with contextlib.suppress(SandboxError):
            await run_command("docker", "exec", "-u", "0", self.name, "sh", "-c", script)

    async def put(self, trees: Mapping[str, Mapping[str, bytes]], *, mode: int = 0o755) -> None:
        """Make each directory of ``trees`` afresh (whatever was there, and a symbolic link
        on its path, is removed) holding its files (relative name -> content), owned by
        root and not writable by others: two Docker calls for all of them."""
        for directory in trees:
            if not directory.startswith("/") or directory.rstrip("/") in ("", "/"):
                raise SandboxError(f"directories must be absolute paths below /, got {directory!r}")
        script = (
            'for d; do p="$d"; while [ "$p" != / ]; do [ -L "$p" ] && rm -f -- "$p"; '
            'p=$(dirname -- "$p"); done; rm -rf -- "$d" && mkdir -p -m 755 -- "$d" || exit 1; done'
        )
        dirs = [d.rstrip("/") for d in trees]
        await run_command(
            "docker", "exec", "-u", "0", self.name, "sh", "-c", script, "sh", *dirs, limit_s=60
        )  # fmt: skip
        entries: dict[str, tuple[str, int, bytes | None]] = {}  # each directory once

        def add_dirs(parts: Sequence[str]) -> None:
            for i in range(1, len(parts) + 1):
                name = "/".join(parts[:i])
                entries.setdefault(name, (name, 0o755, None))

        for directory, files in trees.items():
            base = Path(directory.strip("/")).parts
            add_dirs(base)
            for name, data in sorted(files.items()):
                parts = Path(name).parts
                if not parts or ".." in parts or Path(name).is_absolute():
                    raise SandboxError(f"file name {name!r} must be a relative path")
                add_dirs((*base, *parts[:-1]))
                path = "/".join((*base, *parts))
                entries[path] = (path, mode, data)
        archive = tar_bytes(entries.values())
        await run_command("docker", "cp", "-", f"{self.name}:/", stdin=archive, limit_s=120)

    async def read(self, path: str, *, limit_bytes: int = 1 << 16) -> bytes | None:
        """The first ``limit_bytes`` of the regular file at ``path`` (read as root); None if
        there is no regular file there."""
        script = 'test -f "$1" && ! test -L "$1" && head -c "$2" -- "$1"'
        try:
            out = await run_command(
                "docker", "exec", "-u", "0", self.name, "sh", "-c", script, "sh", path,
                str(limit_bytes), limit_s=60,
            )  # fmt: skip
        except SandboxError:
            return None
        return out.encode()


async def _read_capped(stream: asyncio.StreamReader, cap: int) -> tuple[bytes, bool]:
    """Up to ``cap`` bytes of ``stream`` (the rest is read and dropped) and whether any was."""
    kept = bytearray()
    cut = False
    while chunk := await stream.read(1 << 16):
        room = cap - len(kept)
        if len(chunk) > room:
            cut = True
            kept += chunk[: max(room, 0)]
        else:
            kept += chunk
    return bytes(kept), cut
