"""Grades a Python solution inside the sandbox, out of the solution's reach.

Two roles in one stdlib-only file:

* the grader (``python3 -I -S _grader.py``): reads the tests, a setup prelude, the entry
  point and a per-run nonce from standard input (they never touch the disk), makes itself
  non-dumpable (so the solution, running as the same user, can neither read its memory
  nor its ``/proc`` entries), starts the solution in a *separate process* and runs the
  tests against a proxy: each call's arguments go to the solution process and its return
  value comes back as a canonical plain value (``None``, bool, int, float, str, bytes,
  list, tuple, dict, set, frozenset, complex -- exact types, no subclasses), so the
  comparisons run here, on values the solution cannot make lie. The verdict is the last
  line of the grader's standard output, tagged with the nonce; the solution's own output
  goes to pipes the grader reads and drops.
* the solution's process, forked from the grader before it reads anything: runs the
  solution file as a module and answers calls.

A solution that exits, kills its process, returns an always-equal object, patches
builtins or ``assert``, prints fake verdicts or reads the grader's stack therefore fails:
every one of those stays inside the solution's process or never reaches the verdict.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import sys
import time
from typing import Any

MAX_DEPTH = 64
MAX_ITEMS = 1_000_000


class Unrepresentable(TypeError):
    """The value is not a plain value (another type, a subclass, too deep)."""


def encode(value: object, depth: int = 0) -> object:
    """``value`` as JSON, exact types only."""
    if depth > MAX_DEPTH:
        raise Unrepresentable("value nested too deeply")
    t = type(value)
    if value is None or t is bool or t is str:
        return value
    if t is int:
        return {"i": str(value)}
    if t is float:
        return {"f": float.hex(value)}  # type: ignore[arg-type]
    if t is complex:
        return {"c": [float.hex(value.real), float.hex(value.imag)]}  # type: ignore[attr-defined]
    if t is bytes:
        return {"b": value.decode("latin-1")}  # type: ignore[attr-defined]
    if t is list:
        return [encode(v, depth + 1) for v in value]  # type: ignore[attr-defined]
    if t is tuple:
        return {"t": [encode(v, depth + 1) for v in value]}  # type: ignore[attr-defined]
    if t is dict:
        return {"d": [[encode(k, depth + 1), encode(v, depth + 1)] for k, v in value.items()]}  # type: ignore[attr-defined]
    if t is set or t is frozenset:
        return {"set" if t is set else "fs": [encode(v, depth + 1) for v in value]}  # type: ignore[attr-defined]
    raise Unrepresentable(f"a {t.__module__}.{t.__qualname__} is not a plain value")


def decode(data: object) -> object:
    if data is None or type(data) in (bool, str):
        return data
    if type(data) is list:
        return [decode(v) for v in data]
    if type(data) is dict and len(data) == 1:
        ((tag, v),) = data.items()
        if tag == "i":
            return int(v)
        if tag == "f":
            return float.fromhex(v)
        if tag == "c":
            return complex(float.fromhex(v[0]), float.fromhex(v[1]))
        if tag == "b":
            return v.encode("latin-1")
        if tag == "t":
            return tuple(decode(x) for x in v)
        if tag == "d":
            return {decode(k): decode(x) for k, x in v}
        if tag == "set":
            return {decode(x) for x in v}
        if tag == "fs":
            return frozenset(decode(x) for x in v)
    raise Unrepresentable(f"bad encoded value {str(data)[:80]!r}")


# -- the solution's side --------------------------------------------------------------


def serve(path: str, entry_point: str, reader: object, wfd: int) -> None:
    writer = os.fdopen(wfd, "w", buffering=1)
    namespace: dict[str, object] = {"__name__": "solution", "__file__": path}
    try:
        with open(path) as f:
            code = compile(f.read(), path, "exec")
        exec(code, namespace)
        fn = namespace[entry_point]
        if not callable(fn):
            raise TypeError(f"{entry_point} is not a function")
        writer.write(json.dumps({"ready": True}) + "\n")
    except BaseException as e:
        writer.write(json.dumps({"error": _describe(e)}) + "\n")
        return
    for line in reader:  # type: ignore[attr-defined]
        try:
            args = decode(json.loads(line))
            assert isinstance(args, list)
            out = json.dumps({"ok": encode(fn(*args))})
        except BaseException as e:
            out = json.dumps({"error": _describe(e)})
        writer.write(out + "\n")


def _describe(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"[:500]


# -- the grader's side ----------------------------------------------------------------


class SolutionError(Exception):
    """The solution raised, died, or returned something that is not a plain value."""


class Remote:
    """The solution process, called like the entry point.

    Forked before the grader reads its standard input, so the solution's process never
    held the tests, not even in copied memory; it waits for the file and entry point to
    load, then serves calls."""

    def __init__(self) -> None:
        to_r, to_w = os.pipe()
        from_r, from_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the solution's process
            code = 0
            try:
                os.setsid()
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.dup2(out_w, 1)
                os.dup2(err_w, 2)
                for fd in (to_w, from_r, out_r, err_r, out_w, err_w, devnull):
                    os.close(fd)
                reader = os.fdopen(to_r, "r")
                go = json.loads(reader.readline() or "null")
                if isinstance(go, dict):
                    serve(go["solution"], go["entry_point"], reader, from_w)
            except BaseException:
                code = 1
            os._exit(code)
        self.pid = pid
        for fd in (to_r, from_w, out_w, err_w):
            os.close(fd)
        self.w = os.fdopen(to_w, "w", buffering=1)
        self.r = from_r
        self.buf = b""
        self.deadline = time.monotonic() + 3600
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.r, selectors.EVENT_READ, "reply")
        for fd in (out_r, err_r):  # the solution's output: drained and dropped
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, "noise")

    def load(self, path: str, entry_point: str, deadline: float) -> None:
        self.deadline = deadline
        self._send({"solution": path, "entry_point": entry_point})
        hello = self._reply()
        if "error" in hello:
            raise SolutionError(f"the solution failed to load: {hello['error']}")

    def _send(self, message: object) -> None:
        try:
            self.w.write(json.dumps(message) + "\n")
        except (BrokenPipeError, OSError):
            raise SolutionError("the solution's process ended") from None

    def _reply(self) -> dict[str, object]:
        while b"\n" not in self.buf:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise SolutionError("the solution ran out of time")
            for key, _ in self.sel.select(left):
                data = os.read(key.fd, 1 << 16) if key.data == "reply" else b""
                if key.data == "noise":
                    try:
                        if not os.read(key.fd, 1 << 16):
                            self.sel.unregister(key.fd)
                    except BlockingIOError:
                        pass
                    continue
                if not data:
                    raise SolutionError("the solution's process ended")
                self.buf += data
                if len(self.buf) > 64 << 20:
                    raise SolutionError("the solution's answer is too large")
        line, _, self.buf = self.buf.partition(b"\n")
        reply = json.loads(line)
        if not isinstance(reply, dict):
            raise SolutionError("malformed reply")
        return reply

    def __call__(self, *args: object) -> object:
        self._send(encode(list(args)))
        reply = self._reply()
        if "ok" not in reply:
            raise SolutionError(f"the solution raised {reply.get('error')}")
        return decode(reply["ok"])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.killpg(self.pid, 9)
        os.waitpid(self.pid, 0)


def grade(remote: Remote, spec: dict[str, Any]) -> tuple[bool, str]:
    deadline = time.monotonic() + float(spec.get("timeout_s", 10))
    namespace: dict[str, object] = {"__name__": "grader"}
    try:
        remote.load(spec["solution"], spec["entry_point"], deadline)
        exec(compile(spec.get("setup", ""), "setup", "exec"), namespace)
        namespace[spec["entry_point"]] = remote
        namespace["candidate"] = remote
        exec(compile(spec["tests"], "tests", "exec"), namespace)
        check = spec.get("check")
        if check:
            check_fn = namespace[check]
            check_fn(remote)  # type: ignore[operator]
        return True, "all tests passed"
    except AssertionError as e:
        import traceback  # only on failure: it costs a few ms to import

        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "tests"]
        if not frames:
            return False, "a test failed"
        lineno = frames[-1].lineno or 0
        lines = spec["tests"].splitlines()
        text = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
        return False, f"a test failed (line {lineno}: {text})"[:500]
    except SolutionError as e:
        return False, str(e)[:500]
    except Exception as e:
        return False, _describe(e)
    finally:
        remote.close()


def main() -> None:
    remote = Remote()  # before the tests are read: see Remote
    spec = json.loads(sys.stdin.buffer.read())
    try:  # neither ptrace nor /proc/<pid>/{mem,environ,fd} for processes of our user
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
    except (OSError, AttributeError):
        pass
    nonce = spec.pop("nonce")
    passed, reason = grade(remote, spec)
    sys.stdout.write("\n" + json.dumps({"nonce": nonce, "passed": passed, "reason": reason}) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
