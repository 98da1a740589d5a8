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
import stat

TREE = [
    "project/.hidden.tmp",
    "project/README.md",
    "project/build.sh",
    "project/data/run.sh.bak",
    "project/notes.tmp.txt",
    "project/scripts/deploy.sh",
    "project/scripts/lib/helpers.sh",
    "project/scripts/lib/old.tmp",
    "project/src/cache.tmp",
    "project/src/main.py",
]
for rel in TREE:
    path = "/app/" + rel
    if rel.endswith(".tmp"):
        if os.path.lexists(path):
            fail(f"{path} still exists")
        continue
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        fail(f"{path} is gone")
    if not stat.S_ISREG(mode):
        fail(f"{path} is no longer a regular file")
    if rel.endswith(".sh") and not mode & stat.S_IXUSR:
        fail(f"{path} is not executable by its owner")
    if not rel.endswith(".sh") and mode & 0o111:
        fail(f"{path} was made executable")

print("PASS")
