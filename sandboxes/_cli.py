"""``agentenv sandbox exec`` and ``agentenv sandbox batch`` (an ``agentenv`` plug-in).

``exec`` runs one command and prints its result record as one JSON object; ``batch``
runs a JSONL file of jobs on the pool and prints one result per line, in input order, as
soon as each is known. Exit status: 0 when every job ran (whatever its own exit code), 1
when a job line was malformed, 2 for bad arguments or a sandbox that cannot start.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from sandboxes._protocol import failed
from sandboxes._sandbox import Sandbox
from sandboxes._types import Job, Limits, SandboxError

__all__ = ["add_parser"]

_MAX_FILE = 256 << 20


def add_parser(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "sandbox",
        help="run untrusted commands in a sandbox",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = parser.add_subparsers(dest="sandbox_command", required=True, metavar="ACTION")
    ex = actions.add_parser(
        "exec",
        help="run one command; print its result as JSON",
        usage="agentenv sandbox exec [options] -- CMD [ARG ...]",
    )
    _common(ex)
    ex.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="put the host file PATH into the job's working directory as NAME",
    )
    ex.add_argument("--stdin", metavar="PATH", help="feed this file to the command's stdin")
    ex.add_argument("cmd", nargs=argparse.REMAINDER, help="the command, after --")
    ex.set_defaults(handler=_exec)
    batch = actions.add_parser("batch", help="run a JSONL file of jobs; one result per line")
    _common(batch)
    batch.add_argument("jobs", help='JSONL: {"id", "files": {name: text}, "cmd": [...], ...}')
    batch.add_argument(
        "--concurrency", type=int, metavar="N", help="jobs at once (default: CPU count)"
    )
    batch.set_defaults(handler=_batch)


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        choices=["auto", "docker", "bwrap"],
        default="auto",
        help="auto: docker when a daemon answers, else bwrap",
    )
    # In a batch, a job's "timeout" and "memory" fields override these.
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="a job's wall-clock seconds (10)",
    )
    parser.add_argument(
        "--memory", type=int, default=512, metavar="MB", help="a job's memory in MB (512)"
    )


def _fail(message: str) -> int:
    print(f"agentenv sandbox: error: {message}", file=sys.stderr)
    return 2


def _read(path: str, what: str) -> bytes:
    p = Path(path)
    try:
        size = p.stat().st_size
        if size > _MAX_FILE:
            raise SandboxError(f"{what} {path!r} is {size} bytes; the limit is {_MAX_FILE}")
        return p.read_bytes()
    except OSError as e:
        raise SandboxError(f"cannot read {what} {path!r}: {e.strerror}") from None


def _exec(args: argparse.Namespace) -> int:
    cmd = list(args.cmd)
    if cmd[:1] == ["--"]:
        cmd = cmd[1:]
    if not cmd:
        return _fail("no command given: agentenv sandbox exec [options] -- CMD [ARG ...]")
    try:
        files: dict[str, str | bytes] = {}
        for spec in args.file:
            name, sep, path = spec.partition("=")
            if not sep or not name or not path:
                raise SandboxError(f"--file takes NAME=PATH, got {spec!r}")
            files[name] = _read(path, "file")
        stdin = _read(args.stdin, "stdin file") if args.stdin else b""
        limits = Limits(timeout_s=args.timeout, memory_mb=args.memory)
        job = Job(cmd=cmd, files=files, stdin=stdin, limits=limits)
    except SandboxError as e:
        return _fail(str(e))

    async def go() -> dict[str, Any]:
        async with Sandbox(args.backend, size=1, limits=limits) as sandbox:
            return (await sandbox.run(job)).to_dict()

    try:
        result = asyncio.run(go())
    except SandboxError as e:
        return _fail(str(e))
    print(json.dumps(result))
    return 0


def _job(line: str, number: int, defaults: Limits) -> Job:
    try:
        data = json.loads(line)
    except ValueError as e:
        raise SandboxError(f"line {number}: not JSON ({e})") from None
    if not isinstance(data, dict):
        raise SandboxError(f"line {number}: a job must be a JSON object")
    unknown = set(data) - {"id", "files", "cmd", "stdin", "timeout", "memory"}
    if unknown:
        raise SandboxError(f"line {number}: unknown job fields {sorted(unknown)}")
    if "cmd" not in data:
        raise SandboxError(f"line {number}: a job needs a cmd")
    limits = dataclasses.replace(
        defaults,
        timeout_s=data.get("timeout", defaults.timeout_s),
        memory_mb=data.get("memory", defaults.memory_mb),
    )
    job_id = data.get("id")
    return Job(
        cmd=data["cmd"],
        files=data.get("files") or {},
        stdin=data.get("stdin") or "",
        limits=limits,
        id=None if job_id is None else str(job_id),
    )


def _batch(args: argparse.Namespace) -> int:
    try:
        defaults = Limits(timeout_s=args.timeout, memory_mb=args.memory)
        if args.concurrency is not None and args.concurrency < 1:
            raise SandboxError(f"--concurrency must be at least 1, got {args.concurrency}")
        lines = Path(args.jobs).read_text().splitlines()
    except OSError as e:
        return _fail(f"cannot read {args.jobs!r}: {e.strerror}")
    except SandboxError as e:
        return _fail(str(e))
    entries: list[Job | dict[str, Any]] = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entries.append(_job(line, number, defaults))
        except SandboxError as e:
            raw_id = None
            with contextlib.suppress(ValueError, AttributeError):
                raw_id = json.loads(line).get("id")
            probe = Job(cmd=["true"], id=None if raw_id is None else str(raw_id))
            entries.append(failed(probe, "none", f"bad job: {e}", 0.0, timed_out=False).to_dict())

    async def go() -> None:
        async with Sandbox(args.backend, size=args.concurrency, limits=defaults) as sandbox:
            tasks = [
                asyncio.ensure_future(sandbox.run(e)) if isinstance(e, Job) else None
                for e in entries
            ]
            for entry, task in zip(entries, tasks, strict=True):  # in input order
                record = entry if task is None else (await task).to_dict()
                print(json.dumps(record), flush=True)

    try:
        asyncio.run(go())
    except SandboxError as e:
        return _fail(str(e))
    return 0 if all(isinstance(e, Job) for e in entries) else 1
