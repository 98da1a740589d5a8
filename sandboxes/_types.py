"""The sandbox's public records: limits, a job, and its result."""

from __future__ import annotations

import dataclasses
import math
import os
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["Job", "Limits", "Result", "SandboxError", "SandboxUnavailable"]


class SandboxError(Exception):
    """Bad input to the sandbox (limits, files, command), or a backend failure."""


class SandboxUnavailable(SandboxError):
    """The requested backend cannot run here (no Docker daemon, no bubblewrap)."""


# Bounds that catch absurd values early with a message instead of a confusing failure
# deep in Docker or the kernel.
_BOUNDS: dict[str, tuple[float, float]] = {
    "timeout_s": (0.01, 3600.0),
    "cpus": (0.01, 256.0),
    "memory_mb": (16, 1024 * 1024),
    "pids": (8, 65536),
    "open_files": (16, 1024 * 1024),
    "output_bytes": (0, 1 << 30),
    "tmpfs_mb": (1, 64 * 1024),
}


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    """What one job may use.

    Args:
        timeout_s: wall-clock limit; the job's processes are killed (SIGKILL) when it passes.
        cpus: CPU share (cores) of the job's container.
        memory_mb: memory (RSS + page cache) of the job; exceeding it OOM-kills the job.
        pids: processes and threads the job may have at once (fork bombs stop here).
        open_files: open file descriptors per process (RLIMIT_NOFILE).
        output_bytes: bytes of stdout and of stderr kept each; the rest is dropped and
            ``stdout_truncated`` / ``stderr_truncated`` say so.
        tmpfs_mb: size of the writable ``/tmp`` and of the working directory each.
    """

    timeout_s: float = 10.0
    cpus: float = 1.0
    memory_mb: int = 512
    pids: int = 64
    open_files: int = 256
    output_bytes: int = 1 << 20
    tmpfs_mb: int = 64

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise SandboxError(f"{field.name} must be a number, got {value!r}")
            if field.type == "int" and not isinstance(value, int):
                raise SandboxError(f"{field.name} must be an integer, got {value!r}")
            lo, hi = _BOUNDS[field.name]
            if not math.isfinite(value) or not lo <= value <= hi:
                raise SandboxError(f"{field.name} must be between {lo:g} and {hi:g}, got {value!r}")

    def shape(self) -> tuple[float, int, int, int]:
        """The limits a container is created with (the rest are applied per job)."""
        return (self.cpus, self.memory_mb, self.pids, self.tmpfs_mb)

    def to_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


_MAX_FILES_BYTES = 256 << 20


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One command to run in a clean sandbox.

    Args:
        cmd: the program and its arguments (no shell: use ``["sh", "-c", ...]`` for one).
        files: name -> content, written into the working directory (``/work``) before the
            command starts. Names are relative paths without ``..``.
        stdin: bytes fed to the command's standard input (empty: end of file at once).
        limits: the job's limits (defaults: :class:`Limits`).
        id: the caller's id, copied into the result.
        separate_real_gid: Docker: run with a real group id apart from the effective one,
            so that a process of the job can make itself non-dumpable (its memory and
            ``/proc`` entries closed to the job's other processes) with
            ``os.setegid(os.getgid())``. :func:`~sandboxes.check_python`'s grader does.
    """

    cmd: Sequence[str]
    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    stdin: str | bytes = b""
    limits: Limits = dataclasses.field(default_factory=Limits)
    id: str | None = None
    separate_real_gid: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.cmd, str | bytes) or not isinstance(self.cmd, Sequence):
            raise SandboxError(f"cmd must be a list of strings, got {type(self.cmd).__name__}")
        if not self.cmd:
            raise SandboxError("cmd must name a program")
        for arg in self.cmd:
            if not isinstance(arg, str):
                raise SandboxError(f"cmd must be a list of strings, got {arg!r}")
            if "\x00" in arg:
                raise SandboxError("cmd arguments cannot contain NUL bytes")
        if not isinstance(self.files, Mapping):
            raise SandboxError(f"files must map names to contents, got {type(self.files).__name__}")
        total = 0
        for name, content in self.files.items():
            check_file_name(name)
            if not isinstance(content, str | bytes):
                raise SandboxError(f"file {name!r}: content must be str or bytes")
            total += len(content)
        cap = min(_MAX_FILES_BYTES, self.limits.tmpfs_mb << 20)
        if total > cap:
            raise SandboxError(
                f"files add up to {total} bytes, more than the {cap} bytes the working "
                "directory holds (raise limits.tmpfs_mb)"
            )
        if not isinstance(self.stdin, str | bytes):
            raise SandboxError(f"stdin must be str or bytes, got {type(self.stdin).__name__}")
        if not isinstance(self.limits, Limits):
            raise SandboxError(f"limits must be a Limits, got {type(self.limits).__name__}")

    def wire(self) -> dict[str, Any]:
        """The job as the in-sandbox worker reads it (JSON; bytes as latin-1 text)."""
        return {
            "cmd": list(self.cmd),
            "files": {n: _latin1(c) for n, c in self.files.items()},
            "stdin": _latin1(self.stdin),
            "timeout_s": self.limits.timeout_s,
            "open_files": self.limits.open_files,
            "output_bytes": self.limits.output_bytes,
            "memory_mb": self.limits.memory_mb,
            "pids": self.limits.pids,
            "real_gid": 1001 if self.separate_real_gid else None,
        }


def _latin1(data: str | bytes) -> str:
    raw = data.encode() if isinstance(data, str) else data
    return raw.decode("latin-1")


def check_file_name(name: object) -> str:
    """``name`` if it is a safe relative path inside the working directory."""
    if not isinstance(name, str) or not name:
        raise SandboxError(f"file names must be non-empty strings, got {name!r}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise SandboxError(f"file name {name!r} is not valid UTF-8") from None
    norm = posixpath.normpath(name)
    if (
        "\x00" in name
        or os.path.isabs(name)
        or norm.startswith("..")
        or norm in (".", "")
        or name.endswith("/")
    ):
        raise SandboxError(f"file name {name!r} must be a relative path inside the work dir")
    return norm


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Result:
    """What became of a job.

    ``exit_code`` is the command's exit status, or ``-N`` when signal N killed it (a
    timeout reports ``-9`` with ``timed_out``). ``error`` is set when the sandbox itself
    could not run the job (the command does not exist, the container died): then the
    job did not run to an end of its own.
    """

    exit_code: int
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    timed_out: bool
    oom_killed: bool
    duration_s: float
    backend: str
    id: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        """Exited 0 on its own (no timeout, no OOM kill, no sandbox error)."""
        return self.exit_code == 0 and not self.timed_out and not self.oom_killed and not self.error

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
