"""Grades the task; prints what failed. Exit status 0 only when everything passed."""

import json
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


CASES = [[1, 2, 3, 4], [7], [2.5, 3.5], [10, -10, 30], list(range(1, 101))]
code = "import json, stats; print(json.dumps([[stats.mean(x), stats.spread(x)] for x in %r]))"
status, out = as_agent(
    "python3", "-I", "-c", "import sys; sys.path.insert(0, '/app'); " + code % CASES
)
try:
    got = json.loads(out.strip().splitlines()[-1])
except (ValueError, IndexError):
    fail(f"stats.py did not load or run (exit status {status})")
want = [[sum(x) / len(x), max(x) - min(x)] for x in CASES]
if got != want:
    fail(f"got {got}, want {want}")

print("PASS")
