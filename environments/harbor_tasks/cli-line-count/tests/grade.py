"""Grades the task; prints what failed. Exit status 0 only when everything passed."""

import subprocess
import sys

AGENT = ["setpriv", "--reuid=1000", "--regid=1000", "--clear-groups"]


def as_agent(*cmd, stdin=None, timeout=20):
    """Run cmd as the agent's user (never in this process); (exit status, stdout)."""
    try:
        p = subprocess.run(
            [*AGENT, *cmd],
            input=stdin,
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd="/app",
            env={"PATH": "/usr/bin:/bin", "HOME": "/tmp"},
        )
    except subprocess.TimeoutExpired:
        return -9, ""
    return p.returncode, p.stdout


def fail(why):
    print("FAIL:", why)
    sys.exit(1)


import os
import tempfile

CASES = {
    "three.txt": "a b\nc\nd e f\n",
    "open.txt": "x\ny",
    "empty.txt": "",
    "blank.txt": "\n\n",
    "words.txt": "  one two\tthree\n\nfour  \n",
}
tmp = tempfile.mkdtemp(dir="/tmp")
os.chmod(tmp, 0o755)
for name, text in CASES.items():
    path = os.path.join(tmp, name)
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, 0o644)
    want_lines = len(text.splitlines())
    want_words = len(text.split())
    status, out = as_agent("python3", "/app/wc.py", "-l", path)
    if out.strip() != str(want_lines):
        fail(f"wc.py -l {name} printed {out.strip()!r}, want {want_lines}")
    status, out = as_agent("python3", "/app/wc.py", path)
    if out.strip() != str(want_words):
        fail(f"wc.py {name} printed {out.strip()!r}, want {want_words}")

print("PASS")
