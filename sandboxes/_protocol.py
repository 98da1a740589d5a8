"""The host's side of the worker protocol: one JSON line per job and per result."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import tarfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sandboxes._types import Job, Result, SandboxError

WORKER = Path(__file__).with_name("_worker.py")
# Job lines carry the files, result lines the output (JSON escapes can make it 6x larger).
LINE_LIMIT = 1 << 30
GRACE_S = 5.0  # how long past a job's timeout the host waits for the worker's answer
JOB_UID = 1000  # the user jobs run as, in every backend


def job_line(job: Job, **extra: Any) -> bytes:
    wire = job.wire()
    wire.update(extra)
    return (json.dumps(wire) + "\n").encode()


def decode(raw: str) -> str:
    """Bytes the worker passed as latin-1 text, read as UTF-8 (bad bytes replaced)."""
    return raw.encode("latin-1").decode("utf-8", errors="replace")


def to_result(data: dict[str, Any], job: Job, backend: str) -> Result:
    return Result(
        exit_code=int(data["exit_code"]),
        stdout=decode(data["stdout"]),
        stderr=decode(data["stderr"]),
        stdout_truncated=bool(data["stdout_truncated"]),
        stderr_truncated=bool(data["stderr_truncated"]),
        timed_out=bool(data["timed_out"]),
        oom_killed=bool(data["oom_killed"]),
        duration_s=float(data["duration_s"]),
        backend=backend,
        id=job.id,
        error=data.get("error"),
    )


def failed(job: Job, backend: str, error: str, duration_s: float, *, timed_out: bool) -> Result:
    """The result of a job whose sandbox broke down (never a pass)."""
    return Result(
        exit_code=-9,
        stdout="",
        stderr="",
        stdout_truncated=False,
        stderr_truncated=False,
        timed_out=timed_out,
        oom_killed=False,
        duration_s=duration_s,
        backend=backend,
        id=job.id,
        error=error,
    )


async def read_message(stream: asyncio.StreamReader, wait_s: float) -> dict[str, Any] | None:
    """The worker's next line as a dict; None when the stream ended or timed out."""
    try:
        line = await asyncio.wait_for(stream.readline(), wait_s)
    except (TimeoutError, asyncio.LimitOverrunError, ValueError):
        return None
    if not line:
        return None
    try:
        data = json.loads(line)
    except ValueError:
        return None
    return data if isinstance(data, dict) else None


async def run_command(*args: str, limit_s: float = 60.0, stdin: bytes | None = None) -> str:
    """Run a host command (docker CLI); its stdout, or :class:`SandboxError` with stderr."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError:
        raise SandboxError(f"{args[0]!r} is not installed") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(stdin), limit_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise SandboxError(f"{' '.join(args[:3])} … did not finish within {limit_s:g} s") from None
    if proc.returncode != 0:
        message = err.decode(errors="replace").strip() or f"exit status {proc.returncode}"
        raise SandboxError(f"{' '.join(args[:3])} … failed: {message}")
    return out.decode(errors="replace")


def tar_bytes(entries: Iterable[tuple[str, int, bytes | str | None]]) -> bytes:
    """A tar archive of ``(name, mode, content)`` entries, in order: bytes content is a
    file, a str a symbolic link to it, None a directory."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, mode, content in entries:
            info = tarfile.TarInfo(name)
            info.mode = mode
            if isinstance(content, str):
                info.type, info.linkname = tarfile.SYMTYPE, content
            elif content is None:
                info.type = tarfile.DIRTYPE
            else:
                info.size = len(content)
            tar.addfile(info, io.BytesIO(content) if isinstance(content, bytes) else None)
    return buf.getvalue()


def cpu_count() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
