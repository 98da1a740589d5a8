"""Grades a Python solution inside the sandbox, out of the solution's reach.

Two roles in one stdlib-only file:

* the grader (``python3 -I -S _grader.py``): reads the tests, a setup prelude, the entry
  point and a per-run nonce from standard input (never from disk), makes itself
  non-dumpable, and runs the tests against a proxy of the solution's function: each call's
  arguments go to the solution's process and its return value comes back as a canonical
  plain value (exact types, no subclasses), so the comparisons run here, on values the
  solution cannot make lie. The verdict, every test's result in it, is the last line of its
  standard output, tagged with the nonce.
* the solution's process, forked from the grader before it reads anything: runs the
  solution file as a module and answers calls; its own output goes to pipes the grader
  drops.

So every hack of the solution (exiting, always-equal objects, patched ``assert``, fake
verdicts, reading the grader's stack) stays inside its process or never reaches the
verdict: docs/sandboxes.md lists them.
"""

from __future__ import annotations

import os
import select
import sys
import time

# Importing typing, contextlib or json would cost this short-lived process ~15 ms.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

MAX_DEPTH = 100
MAX_MESSAGE = 64 << 20  # bytes of one encoded message
MAX_REASON = 500  # characters of the verdict's reason
MAX_TEST_REASON = 200  # characters of one test's reason (the verdict line holds them all)
MAX_TEST_NAME = 100


class Unrepresentable(TypeError):
    """The value is not a plain value (another type, a subclass, too deep), or the bytes
    are not an encoded value."""


# The canonical encoding, a small tagged format parsed without eval, pickle or marshal (so
# bytes from the solution's process cannot run code here), and without json, whose
# import costs this short-lived process ~8 ms:
#   N | T | F | i<hex>; | f<float.hex>; | c<hex>;<hex>; | s<n>:<utf-8> | b<n>:<bytes>
#   | l<n>:items | t<n>:items | S<n>:items (set) | Z<n>:items (frozenset) | d<n>:k v k v...
_SEQUENCES: dict[type, bytes] = {list: b"l", tuple: b"t", set: b"S", frozenset: b"Z"}
_COLLECTIONS: dict[bytes, type] = {tag: t for t, tag in _SEQUENCES.items()}


def dumps(value: object) -> bytes:
    """``value`` encoded; exact types only (no subclasses, no other types)."""
    out = bytearray()
    _encode(value, out, 0)
    return bytes(out)


def _encode(v: Any, out: bytearray, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise Unrepresentable("value nested too deeply")
    t = type(v)
    if v is None:
        out += b"N"
    elif t is bool:
        out += b"T" if v else b"F"
    elif t is int:
        out += b"i%x;" % v  # hex: no limit on the number of digits
    elif t is float:
        out += b"f" + float.hex(v).encode() + b";"
    elif t is complex:
        out += b"c" + float.hex(v.real).encode() + b";" + float.hex(v.imag).encode() + b";"
    elif t is str:
        raw = v.encode("utf-8", "surrogatepass")
        out += b"s%d:" % len(raw) + raw
    elif t is bytes:
        out += b"b%d:" % len(v) + v
    elif t in _SEQUENCES:
        out += _SEQUENCES[t] + b"%d:" % len(v)
        for x in v:
            _encode(x, out, depth + 1)
    elif t is dict:
        out += b"d%d:" % len(v)
        for k, x in v.items():
            _encode(k, out, depth + 1)
            _encode(x, out, depth + 1)
    else:
        raise Unrepresentable(f"a {t.__module__}.{t.__qualname__} is not a plain value")


def loads(data: bytes) -> object:
    """Inverse of :func:`dumps`; :class:`Unrepresentable` for anything malformed."""
    try:
        value, end = _decode(data, 0, 0)
    except (ValueError, IndexError, TypeError, UnicodeDecodeError, RecursionError) as e:
        raise Unrepresentable(f"malformed value: {e}") from None
    if end != len(data):
        raise Unrepresentable("trailing bytes after the value")
    return value


def _count(data: bytes, pos: int) -> tuple[int, int]:
    colon = data.index(b":", pos)
    n = int(data[pos:colon])
    if n < 0:
        raise ValueError("negative length")
    return n, colon + 1


def _decode(data: bytes, pos: int, depth: int) -> tuple[object, int]:
    if depth > MAX_DEPTH:
        raise ValueError("nested too deeply")
    tag = data[pos : pos + 1]
    pos += 1
    if tag == b"N":
        return None, pos
    if tag in (b"T", b"F"):
        return tag == b"T", pos
    if tag in (b"i", b"f"):
        end = data.index(b";", pos)
        text = data[pos:end].decode("ascii")
        return (int(text, 16) if tag == b"i" else float.fromhex(text)), end + 1
    if tag == b"c":
        mid = data.index(b";", pos)
        end = data.index(b";", mid + 1)
        real = float.fromhex(data[pos:mid].decode("ascii"))
        return complex(real, float.fromhex(data[mid + 1 : end].decode("ascii"))), end + 1
    if tag in (b"s", b"b"):
        n, pos = _count(data, pos)
        raw = data[pos : pos + n]
        if len(raw) != n:
            raise ValueError("truncated string")
        return (raw.decode("utf-8", "surrogatepass") if tag == b"s" else raw), pos + n
    if tag in (b"l", b"t", b"S", b"Z", b"d"):
        n, pos = _count(data, pos)
        if n > len(data):
            raise ValueError("impossible length")
        items = []
        for _ in range(2 * n if tag == b"d" else n):
            item, pos = _decode(data, pos, depth + 1)
            items.append(item)
        if tag == b"d":
            return dict(zip(items[::2], items[1::2], strict=True)), pos
        return _COLLECTIONS[tag](items), pos
    raise ValueError(f"unknown tag {tag!r}")


def send(fd: int, data: bytes) -> None:
    """One message, :func:`dumps` encoded: its length in decimal, a newline, the bytes."""
    frame = b"%d\n" % len(data) + data
    while frame:
        frame = frame[os.write(fd, frame) :]


class Channel:
    """Reads length-prefixed messages from ``fd`` (at most :data:`MAX_MESSAGE` bytes)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buf = b""

    def message(self) -> object | None:
        """The next message, or None when the writer is gone; blocking."""
        while True:
            got = self.take()
            if got is not None:
                return got[0]
            data = os.read(self.fd, 1 << 16)
            if not data:
                return None
            self.buf += data

    def take(self) -> tuple[object] | None:
        """A complete message from the buffer, if there is one."""
        head, newline, rest = self.buf.partition(b"\n")
        if not newline:
            if len(self.buf) > 20:
                raise Unrepresentable("malformed frame")
            return None
        n = int(head)
        if not 0 <= n <= MAX_MESSAGE:
            raise Unrepresentable("message too large")
        if len(rest) < n:
            return None
        self.buf = rest[n:]
        return (loads(rest[:n]),)


# -- the solution's side --------------------------------------------------------------


def serve(path: str, entry_point: str, channel: Channel, wfd: int) -> None:
    namespace: dict[str, object] = {"__name__": "solution", "__file__": path}
    try:
        with open(path) as f:
            code = compile(f.read(), path, "exec")
        exec(code, namespace)
        fn = namespace[entry_point]
        if not callable(fn):
            raise TypeError(f"{entry_point} is not a function")
        send(wfd, dumps({"ready": True}))
    except BaseException as e:
        send(wfd, dumps({"error": _describe(e)}))
        return
    while True:
        args = channel.message()
        if args is None:
            return
        try:
            if type(args) is not list:
                raise TypeError("bad call")
            reply: dict[str, object] = {"ok": fn(*args)}
            data = dumps(reply)  # may raise Unrepresentable for a lying return value
        except BaseException as e:
            data = dumps({"error": _describe(e)})
        send(wfd, data)


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
                channel = Channel(to_r)
                go = channel.message()
                if isinstance(go, dict):
                    serve(go["solution"], go["entry_point"], channel, from_w)
            except BaseException:
                code = 1
            os._exit(code)
        self.pid = pid
        for fd in (to_r, from_w, out_w, err_w):
            os.close(fd)
        self.w = to_w
        self.r = from_r
        self.replies = Channel(from_r)
        # Set when a call ended without its answer (out of time, the process gone,
        # garbage): the answer may still come, so no later call may read the channel.
        self.broken: str | None = None
        self.deadline = time.monotonic() + 3600
        self.poll = select.poll()
        self.poll.register(self.r, select.POLLIN)
        self.noise = {out_r, err_r}  # the solution's output: drained and dropped
        for fd in self.noise:
            os.set_blocking(fd, False)
            self.poll.register(fd, select.POLLIN)

    def load(self, path: str, entry_point: str, deadline: float) -> None:
        self.deadline = deadline
        self._send({"solution": path, "entry_point": entry_point})
        hello = self._reply()
        if "error" in hello:
            raise SolutionError(f"the solution failed to load: {hello['error']}")

    def _send(self, message: object) -> None:
        try:
            send(self.w, dumps(message))
        except OSError:
            raise self._break("the solution's process ended") from None

    def _break(self, reason: str) -> SolutionError:
        self.broken = reason
        return SolutionError(reason)

    def _reply(self) -> dict[Any, object]:
        while True:
            try:
                got = self.replies.take()
            except (Unrepresentable, ValueError):
                raise self._break("the solution's process sent garbage") from None
            if got is not None:
                break
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise self._break("the solution ran out of time")
            for fd, _ in self.poll.poll(left * 1000):
                if fd in self.noise:
                    try:
                        if not os.read(fd, 1 << 16):
                            self.poll.unregister(fd)
                    except BlockingIOError:
                        pass
                    continue
                data = os.read(fd, 1 << 16)
                if not data:
                    raise self._break("the solution's process ended")
                self.replies.buf += data
        reply = got[0]
        if type(reply) is not dict:
            raise self._break("malformed reply")
        return reply

    def __call__(self, *args: object) -> object:
        if self.broken is not None:
            raise SolutionError(self.broken)
        try:
            self._send(list(args))
        except Unrepresentable as e:
            raise SolutionError(
                f"the test passed an argument the sandbox cannot send: {e}"
            ) from None
        reply = self._reply()
        if "ok" not in reply:
            raise SolutionError(f"the solution raised {reply.get('error')}")
        return reply["ok"]

    def close(self) -> None:
        try:  # noqa: SIM105 - contextlib is not imported here
            os.killpg(self.pid, 9)
        except OSError:
            pass
        os.waitpid(self.pid, 0)


Outcome = tuple[str, bool, str]  # a test's name, whether it passed, why (or "passed")


def grade(remote: Remote, spec: dict[str, Any]) -> tuple[bool, str, list[Outcome]]:
    """The verdict: whether every test passed, why not, and each test's outcome (the tests
    as :func:`sandboxes.check_python` takes them)."""
    deadline = time.monotonic() + float(spec.get("timeout_s", 10))
    namespace: dict[str, object] = {"__name__": "grader"}
    source = spec["tests"]
    try:
        try:
            remote.load(spec["solution"], spec["entry_point"], deadline)
            exec(compile(spec.get("setup", ""), "setup", "exec"), namespace)
            code = compile(source, "tests", "exec")
        except SolutionError as e:
            return False, str(e)[:MAX_REASON], []
        except Exception as e:
            return False, _describe(e), []
        namespace[spec["entry_point"]] = remote
        namespace["candidate"] = remote
        ok, why = run_test(lambda: exec(code, namespace), source)
        functions = [
            (name, fn)
            for name, fn in list(namespace.items())
            if name.startswith("test")
            and getattr(getattr(fn, "__code__", None), "co_filename", None) == "tests"
        ]
        check = spec.get("check")
        check_fn = namespace.get(check) if check else None
        if not ok or (check_fn is None and not functions):
            if ok and check:
                ok = False
                why = (
                    f"the tests define no function {check!r} and no test* functions: define "
                    "one, or pass check=None when the tests are top-level asserts only"
                )
            results: list[Outcome] = [("tests", ok, why)]
        else:
            results = []
            if check_fn is not None:
                results.append((str(check), *run_test(lambda: check_fn(remote), source)))  # type: ignore[operator]
            for name, fn in functions:
                results.append((name[:MAX_TEST_NAME], *run_test(fn, source)))
    finally:
        remote.close()
    failed = [r for r in results if not r[1]]
    if not failed:
        return True, "all tests passed", results
    if len(results) == 1:
        return False, failed[0][2], results
    name, _, why = failed[0]
    summary = f"{len(failed)} of {len(results)} tests failed; {name}: {why}"
    return False, summary[:MAX_REASON], results


def run_test(test: Any, source: str) -> tuple[bool, str]:
    """Call ``test``: whether it passed, and why not (the failing line of ``source``)."""
    try:
        test()
        return True, "passed"
    except AssertionError as e:
        import traceback  # only on failure: it costs a few ms to import

        frames = [f for f in traceback.extract_tb(e.__traceback__) if f.filename == "tests"]
        if not frames:
            return False, "a test failed"
        lineno = frames[-1].lineno or 0
        lines = source.splitlines()
        text = lines[lineno - 1].strip() if 0 < lineno <= len(lines) else ""
        return False, f"a test failed (line {lineno}: {text})"[:MAX_TEST_REASON]
    except SolutionError as e:
        return False, str(e)[:MAX_TEST_REASON]
    except Exception as e:
        return False, _describe(e)[:MAX_TEST_REASON]


def main() -> None:
    remote = Remote()  # before the tests are read: see Remote
    spec = loads(sys.stdin.buffer.read())
    assert isinstance(spec, dict)
    # Non-dumpable: neither ptrace nor /proc/<pid>/{mem,environ,fd} for the solution's
    # process, which runs as the same user. Switching the effective gid to the real one
    # (Docker starts the grader with the two apart) is a credential change, which makes
    # the process non-dumpable; elsewhere prctl does it (importing ctypes costs ~3 ms).
    if os.getgid() != os.getegid():
        os.setegid(os.getgid())
    else:
        try:
            import ctypes

            ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE = 4
        except (OSError, AttributeError):
            pass
    nonce = spec.pop("nonce")
    passed, reason, results = grade(remote, spec)
    tests = [list(r) for r in results]
    verdict = dumps({"nonce": nonce, "passed": passed, "reason": reason, "tests": tests}).hex()
    sys.stdout.write("\n" + verdict + "\n")  # one ASCII line, last
    sys.stdout.flush()


if __name__ == "__main__":
    main()
