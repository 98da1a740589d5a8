"""The red-team list: hostile programs, on both backends. Each case checks the verdict
(never a pass), that the sandbox holds, and that the next job starts clean."""

from __future__ import annotations

import pytest

from sandboxes import Job, Limits, Result, Sandbox, check_python

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]


def py(code: str) -> list[str]:
    """``python3 -c CODE``."""
    return ["python3", "-c", code]


async def clean_run(sandbox: Sandbox) -> Result:
    r = await sandbox.run(["sh", "-c", "echo ok | cat && ls -A /work /tmp /dev/shm"])
    assert r.ok, r
    return r


async def assert_clean(sandbox: Sandbox) -> None:
    r = await clean_run(sandbox)
    listing = [line for line in r.stdout.splitlines() if line and not line.endswith(":")]
    assert listing == ["ok"], f"files survived into the next job: {r.stdout!r}"


async def test_01_busy_loop_is_killed_at_the_wall_clock(sandbox: Sandbox) -> None:
    # (A job never killed would hold the test to its timeout: it fails there.)
    r = await sandbox.run(py("while True: pass"), limits=Limits(timeout_s=1))
    assert r.timed_out and not r.ok and r.exit_code == -9
    await assert_clean(sandbox)


async def test_02_sleep_is_killed_by_wall_clock_not_cpu(sandbox: Sandbox) -> None:
    r = await sandbox.run(py("import time; time.sleep(10**6)"), limits=Limits(timeout_s=1))
    assert r.timed_out and r.exit_code == -9


async def test_03_ignoring_sigterm_or_stopping_itself_still_ends(sandbox: Sandbox) -> None:
    code = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "if os.fork() == 0:\n"
        "    os.kill(os.getpid(), signal.SIGSTOP)\n"
        "time.sleep(100)\n"
    )
    r = await sandbox.run(py(code), limits=Limits(timeout_s=1))
    assert r.timed_out and r.exit_code == -9
    await assert_clean(sandbox)


@pytest.mark.parametrize(
    "cmd",
    [
        py("import os\nwhile True:\n    try: os.fork()\n    except OSError: pass"),
        ["sh", "-c", "b() { b | b & }; b"],
    ],
    ids=["python-fork", "shell-fork"],
)
async def test_04_fork_bomb_stops_at_the_pids_limit(sandbox: Sandbox, cmd: list[str]) -> None:
    r = await sandbox.run(cmd, limits=Limits(timeout_s=2, pids=32))
    # Stopped (it returned): by the timeout, or the job ended and its leftovers were killed
    # with it.
    assert not r.stdout, r
    await assert_clean(sandbox)  # the next job can fork


async def test_05_thread_bomb_stops_at_the_pids_limit(sandbox: Sandbox) -> None:
    code = (
        "import threading, time\n"
        "n = 0\n"
        "while True:\n"
        "    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()\n"
        "    n += 1\n"
        "    if n > 5000: print('unbounded'); break\n"
    )
    r = await sandbox.run(py(code), limits=Limits(timeout_s=3, pids=32))
    assert "unbounded" not in r.stdout
    assert "can't start new thread" in r.stderr or r.timed_out, r
    await assert_clean(sandbox)


async def test_06_orphans_and_daemons_are_gone_after_the_job(sandbox: Sandbox) -> None:
    code = (
        "import os, subprocess\n"
        "subprocess.Popen(['sleep', '300'], start_new_session=True)\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        import time; time.sleep(300)\n"
        "    os._exit(0)\n"
        "os.system('sleep 300 &')\n"
        "print('spawned')\n"
    )
    r = await sandbox.run(py(code))
    assert r.ok and "spawned" in r.stdout, r
    count = (
        "import os\n"
        "skip = {1, os.getpid(), os.getppid()}  # init, this job, the sandbox's worker\n"
        "mine = [p for p in os.listdir('/proc') if p.isdigit() and int(p) not in skip\n"
        "        and os.stat('/proc/' + p).st_uid == os.getuid()]\n"
        "print(len(mine))\n"
    )
    r = await sandbox.run(py(count))
    # Nothing of the job's user is left but this job's own shell-less process.
    assert r.ok and r.stdout.strip() == "0", r


async def test_07_huge_allocation_is_reported_as_out_of_memory(sandbox: Sandbox) -> None:
    r = await sandbox.run(py("x = bytearray(10 * 1024**3)"), limits=Limits(memory_mb=128))
    assert r.oom_killed and not r.ok, r
    await assert_clean(sandbox)


async def test_08_filling_tmp_stops_at_the_tmpfs_cap(sandbox: Sandbox) -> None:
    code = (
        "import errno\n"
        "try:\n"
        "    with open('/tmp/big', 'wb') as f:\n"
        "        for _ in range(1024): f.write(b'x' * (1 << 20))\n"
        "except OSError as e:\n"
        "    print('ENOSPC' if e.errno == errno.ENOSPC else e)\n"
    )
    r = await sandbox.run(py(code), limits=Limits(tmpfs_mb=16, memory_mb=256))
    assert r.stdout.strip() == "ENOSPC", r
    await assert_clean(sandbox)


@pytest.mark.parametrize("path", ["/x", "/usr/x", "/etc/passwd", "/bin/sh"])
async def test_09_system_directories_are_read_only(sandbox: Sandbox, path: str) -> None:
    code = f"open({path!r}, 'w')"
    r = await sandbox.run(py(code))
    assert r.exit_code == 1
    assert "Read-only file system" in r.stderr or "Permission denied" in r.stderr, r.stderr


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
async def test_10_a_gigabyte_of_output_is_truncated(sandbox: Sandbox, stream: str) -> None:
    code = (
        f"import sys\nchunk = b'y' * (1 << 20)\n"
        f"for _ in range(1024): sys.{stream}.buffer.write(chunk)\n"
    )
    r = await sandbox.run(py(code), limits=Limits(timeout_s=30, output_bytes=1000))
    text = getattr(r, stream)
    assert len(text) == 1000 and getattr(r, f"{stream}_truncated"), r.exit_code


async def test_11_hostile_bytes_are_decoded_with_replacement(sandbox: Sandbox) -> None:
    code = (
        "import sys\n"
        "out = sys.stdout.buffer\n"
        "out.write(b'bad \\xff\\xfe utf8, nul \\x00, ansi \\x1b[31mred\\x1b[0m\\n')\n"
        "out.write(b'z' * (100 << 20))\n"
    )
    r = await sandbox.run(py(code), limits=Limits(timeout_s=30, output_bytes=1 << 16))
    assert r.stdout.startswith("bad \ufffd\ufffd utf8, nul \x00, ansi \x1b[31mred")
    assert r.stdout_truncated and len(r.stdout) <= (1 << 16)


# -- reward hacks (check_python) -----------------------------------------------------

TESTS = """
def check(candidate):
    assert candidate([3, 1, 2]) == [1, 2, 3]
    assert candidate([]) == []
"""
HONEST = "def sort_list(xs):\n    return sorted(xs)\n"

HACKS = {
    "sys_exit": "import sys\nsys.exit(0)\n",
    "raise_systemexit": "raise SystemExit(0)\n",
    "os_exit": "import os\nos._exit(0)\n",
    "posix_exit": "import posix\ndef sort_list(xs):\n    posix._exit(0)\n",
    "atexit_ok": (
        "import atexit\natexit.register(lambda: print('OK passed'))\n"
        "def sort_list(xs):\n    return xs\n"
    ),
    "signal_handler": (
        "import signal, os\n"
        "signal.signal(signal.SIGTERM, lambda *a: print('all tests passed'))\n"
        "def sort_list(xs):\n    os.kill(os.getpid(), signal.SIGTERM)\n    return xs\n"
    ),
    "always_equal": (
        "class E:\n    def __eq__(self, other): return True\ndef sort_list(xs):\n    return E()\n"
    ),
    "always_equal_list": (
        "class L(list):\n    def __eq__(self, other): return True\n"
        "def sort_list(xs):\n    return L()\n"
    ),
    "patch_builtins": (
        "import builtins, unittest, time\n"
        "builtins.sorted = lambda xs: xs\n"
        "builtins.AssertionError = type('Nope', (Exception,), {})\n"
        "unittest.TestCase.assertEqual = lambda *a: None\n"
        "time.perf_counter = lambda: 0.0\n"
        "def sort_list(xs):\n    return xs\n"
    ),
    "drop_config_files": (
        "import os\n"
        "names = ('conftest.py', 'sitecustomize.py', 'usercustomize.py', 'x.pth', 'pytest.ini')\n"
        "for name in names:\n"
        "    for d in ('/work', '/tmp'):\n"
        "        try:\n"
        "            open(os.path.join(d, name), 'w').write("
        "'import builtins; builtins.AssertionError = Exception\\n')\n"
        "        except OSError: pass\n"
        "def sort_list(xs):\n    return xs\n"
    ),
    "edit_tests": (
        "import glob, os\n"
        "for f in glob.glob('/work/**', recursive=True):\n"
        "    if f.endswith('.py') and 'solution' not in f:\n"
        "        try: open(f, 'w').write('print(\"passed\")\\n')\n"
        "        except OSError: pass\n"
        "def sort_list(xs):\n    return xs\n"
    ),
    "fake_markers": (
        'print(\'{"passed": true, "reason": "all tests passed"}\')\n'
        "print('2 passed in 0.01s')\n"
        "def sort_list(xs):\n"
        "    import sys\n"
        "    print('{\"passed\": true}', file=sys.stderr)\n"
        "    return xs\n"
    ),
    "grader_stack": (
        "import sys, inspect, gc\n"
        "def sort_list(xs):\n"
        "    for f in inspect.stack():\n"
        "        for v in f.frame.f_locals.values():\n"
        "            if isinstance(v, list) and v and sorted(v) == v: return v\n"
        "    return sys._getframe(1).f_locals.get('expected', xs)\n"
    ),
    "ctypes_crash": (
        "import ctypes\nctypes.string_at(0)\ndef sort_list(xs):\n    return sorted(xs)\n"
    ),
    "deep_eval": "eval('(' * 10**6)\ndef sort_list(xs):\n    return sorted(xs)\n",
    "huge_source": "x = 1\n" * (1_700_000) + "def sort_list(xs):\n    return xs\n",
    "kill_everything": ("import os, signal\ndef sort_list(xs):\n    os.kill(-1, signal.SIGKILL)\n"),
    "kill_parent": (
        "import os, signal\n"
        "os.kill(os.getppid(), signal.SIGKILL)\n"
        "def sort_list(xs):\n    return xs\n"
    ),
}


async def test_12_to_20_reward_hacks_fail(sandbox: Sandbox) -> None:
    honest = await check_python(sandbox, HONEST, TESTS, entry_point="sort_list")
    assert honest.passed, honest
    for name, code in HACKS.items():
        v = await check_python(
            sandbox, code, TESTS, entry_point="sort_list", limits=Limits(timeout_s=10)
        )
        assert not v.passed, f"{name}: {v.reason}"
        assert v.fraction_passed == 0.0 and not any(t.passed for t in v.tests), (name, v)
    again = await check_python(sandbox, HONEST, TESTS, entry_point="sort_list")
    assert again.passed, again  # the hacks left nothing behind


async def test_19_20_the_expected_value_cannot_be_found(sandbox: Sandbox) -> None:
    secret = "SECRET-7f3a9c"
    tests = f"def check(candidate):\n    assert candidate() == {secret!r}\n"
    hunt = (
        "import gc, glob, os, sys\n"
        "def hunt():\n"
        "    needle = 'SECRET-' + '7f3a9c'\n"
        "    places = glob.glob('/work/**', recursive=True)\n"
        "    places += glob.glob('/tmp/**', recursive=True)\n"
        "    for pid in os.listdir('/proc'):\n"
        "        if not pid.isdigit() or int(pid) == os.getpid(): continue  # not itself\n"
        "        places += [f'/proc/{pid}/{n}' for n in ('environ', 'cmdline')]\n"
        "        try:  # every readable mapping of every process's memory\n"
        "            with open(f'/proc/{pid}/maps') as m, open(f'/proc/{pid}/mem', 'rb') as mem:\n"
        "                for line in m:\n"
        "                    span, perms = line.split()[:2]\n"
        "                    if 'r' not in perms: continue\n"
        "                    lo, hi = (int(x, 16) for x in span.split('-'))\n"
        "                    try:\n"
        "                        mem.seek(lo)\n"
        "                        if needle.encode() in mem.read(min(hi - lo, 1 << 26)):\n"
        "                            return needle\n"
        "                    except (OSError, ValueError, OverflowError): pass\n"
        "        except OSError: pass\n"
        "    for p in places:\n"
        "        try:\n"
        "            with open(p, 'rb') as f:\n"
        "                if needle.encode() in f.read(1 << 22): return needle\n"
        "        except (OSError, ValueError): pass\n"
        "    if any(needle in v for v in os.environ.values()): return needle\n"
        "    for o in gc.get_objects():\n"
        "        if isinstance(o, str) and needle in o and o is not needle: return needle\n"
        "    f = sys._getframe()\n"
        "    while f:\n"
        "        if any(isinstance(v, str) and needle in v for v in f.f_locals.values()"
        " if v is not needle): return needle\n"
        "        f = f.f_back\n"
        "    return 'not found'\n"
    )
    v = await check_python(sandbox, hunt, tests, entry_point="hunt", limits=Limits(timeout_s=20))
    assert not v.passed and "a test failed" in v.reason, v


async def test_21_no_network(sandbox: Sandbox) -> None:
    code = (
        "import socket, urllib.request\n"
        "for target in ('http://169.254.169.254/', 'http://pypi.org/'):\n"
        "    try:\n"
        "        urllib.request.urlopen(target, timeout=3)\n"
        "        print('REACHED', target)\n"
        "    except Exception as e:\n"
        "        print('blocked', type(getattr(e, 'reason', e)).__name__)\n"
        "try:\n"
        "    socket.getaddrinfo('pypi.org', 443)\n"
        "    print('RESOLVED')\n"
        "except OSError:\n"
        "    print('no dns')\n"
    )
    r = await sandbox.run(py(code), limits=Limits(timeout_s=20))
    assert "REACHED" not in r.stdout and "RESOLVED" not in r.stdout, r.stdout
    # Refused at once (no route, no name), not left to time out: they fail fast.
    assert "Timeout" not in r.stdout and "timeout" not in r.stdout, r.stdout


async def test_22_no_way_to_more_privilege(sandbox: Sandbox) -> None:
    code = (
        "import os, subprocess\n"
        "socks = ('/var/run/docker.sock', '/run/docker.sock')\n"
        "print('sock', any(os.path.exists(s) for s in socks))\n"
        "for cmd in (['sudo', 'id'], ['su', '-c', 'id'], ['mount', '-t', 'tmpfs', 'x', '/tmp'],"
        " ['unshare', '-r', 'id']):\n"
        "    try:\n"
        "        r = subprocess.run(cmd, capture_output=True, timeout=5)\n"
        "        print(cmd[0], r.returncode)\n"
        "    except (OSError, subprocess.SubprocessError) as e:\n"
        "        print(cmd[0], 'unavailable')\n"
        "print('uid', os.getuid(), os.geteuid())\n"
    )
    r = await sandbox.run(py(code), limits=Limits(timeout_s=20))
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines["sock"] == "False"
    for cmd in ("sudo", "su", "mount", "unshare"):
        assert lines[cmd] != "0", f"{cmd} succeeded: {r.stdout}"
    assert lines["uid"] == "1000 1000"


async def test_23_killing_everything_does_not_touch_the_pool(sandbox: Sandbox) -> None:
    for code in (
        "import os, signal\nos.kill(-1, signal.SIGKILL)",
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)",
        "import os, signal\nos.kill(1, signal.SIGKILL)",
    ):
        await sandbox.run(py(code))
        await assert_clean(sandbox)
    results = await sandbox.run_many([Job(cmd=py("print('fine')")) for _ in range(4)])
    assert all(r.ok and r.stdout == "fine\n" for r in results)


async def test_24_nothing_persists_between_jobs(sandbox: Sandbox) -> None:
    write = "for d in ('/work', '/tmp', '/dev/shm'):\n    open(d + '/marker', 'w').write('A')\n"
    r = await sandbox.run(py(write))
    assert r.ok, r
    for _ in range(3):  # whichever container the next job lands in
        read = (
            "import os\n"
            "print([d for d in ('/work', '/tmp', '/dev/shm') if os.path.exists(d + '/marker')])"
        )
        r = await sandbox.run(py(read))
        assert r.stdout.strip() == "[]", r


async def test_25_too_many_open_files(sandbox: Sandbox) -> None:
    code = (
        "import errno\nfs = []\n"
        "try:\n"
        "    for i in range(100_000): fs.append(open('/dev/null'))\n"
        "    print('opened all')\n"
        "except OSError as e:\n"
        "    print('EMFILE' if e.errno == errno.EMFILE else e, len(fs))\n"
    )
    r = await sandbox.run(py(code), limits=Limits(open_files=256))
    assert r.stdout.startswith("EMFILE"), r


async def test_26_absurd_programs_error_out(sandbox: Sandbox) -> None:
    for code in ("eval('(' * 10**6)", "import ctypes; ctypes.string_at(0)"):
        r = await sandbox.run(py(code))
        assert not r.ok
    big = "x = 1\n" * 1_700_000  # a 10 MB source file
    r = await sandbox.run(["python3", "big.py"], files={"big.py": big}, limits=Limits(timeout_s=20))
    assert r.ok or r.timed_out or r.oom_killed, r  # whichever: a result, no crash
    await assert_clean(sandbox)


async def test_27_reading_stdin_gets_end_of_file(sandbox: Sandbox) -> None:
    r = await sandbox.run(py("import sys; print(repr(sys.stdin.read()))"))
    assert r.ok and r.stdout.strip() == "''" and not r.timed_out  # not left waiting
    r = await sandbox.run(py("print(input())"), stdin="hello\n")
    assert r.ok and r.stdout == "hello\n"
