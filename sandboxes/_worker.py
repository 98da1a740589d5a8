"""The job runner inside a sandbox (a container or a bubblewrap namespace).

Started as ``python3 -I -S _worker.py [--uid U --gid G] [--once]``; standard library
only, since it runs on whatever Python the sandbox has. It reads one job per line of
standard input (JSON, bytes as latin-1 text) and answers one result line on standard
output. Per job: the files go into the working directory, the command runs in a session
of its own with rlimits, the job's uid (``--uid``: the worker itself runs as another user
so that a job cannot signal it), a wall-clock deadline and capped output; afterwards every
process of the job's uid is killed and the writable directories are emptied, so nothing
survives into the next job. ``--once``: run one job and exit (bubblewrap, where the whole
namespace is thrown away after it).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from typing import Any

WORK = "/work"
SCRUB = ("/work", "/tmp", "/dev/shm")
DRAIN_AFTER_EXIT_S = 0.05  # output still arriving from leftovers after the command exits
CHUNK = 1 << 16


def _oom_kills() -> int | None:
    """The cgroup's OOM-kill counter (cgroup v1 or v2), None where unreadable."""
    for path, key in (
        ("/sys/fs/cgroup/memory/memory.oom_control", "oom_kill"),
        ("/sys/fs/cgroup/memory.events", "oom_kill"),
    ):
        try:
            with open(path) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == key:
                        return int(value)
        except OSError:
            continue
    return None


def _as_user(uid: int | None, gid: int | None, fn: object) -> None:
    """Run ``fn()`` in a child process that has switched to ``uid``/``gid``."""
    for _ in range(1000):  # a fork bomb's leftovers may hold every pid for a moment
        try:
            pid = os.fork()
            break
        except BlockingIOError:
            time.sleep(0.005)
    else:
        return
    if pid == 0:
        code = 0
        try:
            if gid is not None:
                os.setgroups([])
                os.setgid(gid)
            if uid is not None:
                os.setuid(uid)
            fn()  # type: ignore[operator]
        except BaseException:
            code = 1
        os._exit(code)
    os.waitpid(pid, 0)


def _uid_pids(uid: int) -> list[int]:
    out = []
    me = os.getpid()
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(f"/proc/{name}/status") as f:
                status = f.read()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if fields.get("State", "").strip().startswith("Z"):
            continue  # dead already, waiting to be reaped
        if int(fields.get("Uid", "-1 ").split()[0]) == uid:
            out.append(int(name))
    return out


def _kill_others(uid: int) -> None:
    """As ``uid``: SIGKILL every other process of the user (daemons and orphans
    included) until none is left."""
    for _ in range(200):
        os.kill(-1, signal.SIGKILL)  # never signals the caller itself
        if not _uid_pids(uid):
            return
        time.sleep(0.002)


def _reset(uid: int) -> None:
    """After a job, as its user in one child: kill every other process of the user, then
    empty the writable directories (nothing can write them anymore)."""
    _kill_others(uid)
    _scrub()


def _scrub() -> None:
    """Empty the writable directories (as the job's user, who owns what is in them)."""
    for top in SCRUB:
        try:
            entries = os.listdir(top)
        except OSError:
            continue
        for name in entries:
            _remove(os.path.join(top, name))


def _remove(path: str) -> None:
    try:
        if os.path.isdir(path) and not os.path.islink(path):
            with contextlib.suppress(OSError):  # a job may have left it unreadable
                os.chmod(path, 0o700)
            for name in os.listdir(path):
                _remove(os.path.join(path, name))
            os.rmdir(path)
        else:
            os.unlink(path)
    except OSError:
        pass


def _write_files(files: dict[str, str]) -> None:
    for name, text in files.items():
        path = os.path.join(WORK, name)
        parent = os.path.dirname(path)
        if parent != WORK:
            os.makedirs(parent, exist_ok=True)
        with open(path, "wb") as f:
            f.write(text.encode("latin-1"))


def _limits(job: dict[str, Any]) -> None:
    """In the job's child, before exec: rlimits and OOM priority."""
    nofile = int(job["open_files"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    cpu = int(job["timeout_s"]) + 2  # a backstop; the wall clock is the real limit
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    if job.get("rlimit_memory"):  # where no cgroup bounds memory (bubblewrap)
        mem = int(job["memory_mb"]) << 20
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
    if job.get("rlimit_pids"):
        n = int(job["pids"])
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    try:  # the job, not the worker, is what the OOM killer picks
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def run(job: dict[str, Any], uid: int | None, gid: int | None) -> dict[str, Any]:
    start = time.monotonic()
    deadline = start + float(job["timeout_s"])
    cap = int(job["output_bytes"])
    files = job.get("files") or {}
    oom_before = _oom_kills()

    real_gid = job.get("real_gid")

    def prepare() -> None:
        if uid is not None and gid is not None:
            # As root, before anything of the job runs: drop to the job's user. A real gid
            # apart from the effective one (on request) lets a process of the job make
            # itself non-dumpable with os.setegid(os.getgid()), a credential change.
            os.setgroups([])
            os.setresgid(int(real_gid or gid), gid, gid)
            os.setresuid(uid, uid, uid)
        _write_files(files)
        _limits(job)

    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": WORK,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "PYTHONDONTWRITEBYTECODE": "1",
    }
    try:
        proc = subprocess.Popen(
            job["cmd"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=WORK,
            env=env,
            start_new_session=True,
            preexec_fn=prepare,
            close_fds=True,
        )
    except (OSError, subprocess.SubprocessError) as e:
        missing = isinstance(e, FileNotFoundError) or getattr(e, "errno", None) == errno.ENOENT
        return {
            "exit_code": 127 if missing else 126,
            "stdout": "",
            "stderr": "",
            "stdout_truncated": False,
            "stderr_truncated": False,
            "timed_out": False,
            "oom_killed": False,
            "duration_s": time.monotonic() - start,
            "error": (
                f"command not found: {job['cmd'][0]}"
                if missing
                else f"cannot start {job['cmd'][0]}: {e}"
            ),
        }
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None
    out_fd, err_fd, in_fd = proc.stdout.fileno(), proc.stderr.fileno(), proc.stdin.fileno()
    out = {out_fd: bytearray(), err_fd: bytearray()}
    dropped = {out_fd: False, err_fd: False}
    stdin = job.get("stdin", "").encode("latin-1")
    sel = selectors.DefaultSelector()
    for fd in (out_fd, err_fd):
        os.set_blocking(fd, False)
        sel.register(fd, selectors.EVENT_READ)
    if stdin:
        os.set_blocking(in_fd, False)
        sel.register(in_fd, selectors.EVENT_WRITE)
    else:
        proc.stdin.close()  # end of file at once
    sent = 0
    timed_out = False
    exited_at: float | None = None
    while sel.get_map():
        now = time.monotonic()
        if now >= deadline:
            timed_out = proc.poll() is None
            break
        if exited_at is None and proc.poll() is not None:
            exited_at = now
        if exited_at is not None and now - exited_at > DRAIN_AFTER_EXIT_S:
            break  # a leftover process holds the pipes open; it is killed below
        wait = min(deadline - now, 0.01 if exited_at is None else DRAIN_AFTER_EXIT_S)
        for key, _ in sel.select(wait):
            fd = key.fd
            if fd == in_fd:
                try:
                    sent += os.write(in_fd, stdin[sent : sent + CHUNK])
                except OSError:  # the job closed its stdin
                    sent = len(stdin)
                if sent >= len(stdin):
                    sel.unregister(in_fd)
                    proc.stdin.close()
                continue
            try:
                data = os.read(fd, CHUNK)
            except BlockingIOError:
                continue
            if not data:
                sel.unregister(fd)
                continue
            buf = out[fd]
            room = cap - len(buf)
            if room > 0:
                buf += data[:room]
            if len(data) > room:
                dropped[fd] = True
    sel.close()
    if proc.poll() is None:
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
    code = proc.wait()  # leftovers (daemons, orphans) are killed after the answer
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if not stream.closed:
            stream.close()
    oom_after = _oom_kills()
    oom = oom_before is not None and oom_after is not None and oom_after > oom_before
    if not oom and job.get("rlimit_memory") and code != 0:
        # Without a memory cgroup the address-space limit makes allocations fail: Python
        # dies with MemoryError, other programs with their own message or a signal.
        tail = bytes(out[err_fd][-400:])
        oom = b"MemoryError" in tail or b"Cannot allocate memory" in tail
    return {
        "exit_code": code,
        "stdout": out[out_fd].decode("latin-1"),
        "stderr": out[err_fd].decode("latin-1"),
        "stdout_truncated": dropped[out_fd],
        "stderr_truncated": dropped[err_fd],
        "timed_out": timed_out,
        "oom_killed": oom,
        "duration_s": time.monotonic() - start,
        "error": None,
    }


def _nondumpable() -> None:
    """No ptrace and no /proc/<pid>/{mem,environ,fd} of this process for its own user."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE
    except (OSError, AttributeError):
        pass


def main(argv: list[str]) -> None:
    uid = gid = None
    once = "--once" in argv
    if "--uid" in argv:
        uid = int(argv[argv.index("--uid") + 1])
        gid = int(argv[argv.index("--gid") + 1])
    if uid is None:
        # The job runs as this worker's own user (bubblewrap): without this it could read
        # the job -- a grader's hidden tests included -- from the worker's memory.
        _nondumpable()
    # Protocol output goes to a private copy of stdout; a stray print here cannot break it.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    channel.write(json.dumps({"ready": True, "pid": os.getpid()}) + "\n")
    for line in sys.stdin:
        job = json.loads(line)
        result = run(job, uid, gid)
        channel.write(json.dumps(result) + "\n")
        if once:
            return
        # Clean up after answering: the next job waits for it, the answer does not.
        if uid is not None:
            _as_user(uid, gid, lambda: _reset(uid))
            if _uid_pids(uid):  # only if the reset could not finish (a fork bomb's race)
                _as_user(uid, gid, lambda: _kill_others(uid))
        else:
            _scrub()
        channel.write(json.dumps({"ready": True}) + "\n")


if __name__ == "__main__":
    main(sys.argv[1:])
