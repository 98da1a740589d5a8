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


import collections

counts = collections.Counter(line.split()[0] for line in open("/tests/access.log") if line.strip())
want = [f"{n} {ip}" for ip, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:3]]
try:
    got = [" ".join(line.split()) for line in open("/app/top_ips.txt") if line.strip()]
except OSError as e:
    fail(f"no /app/top_ips.txt: {e}")
if got != want:
    fail(f"top_ips.txt has {got}, want {want}")

print("PASS")
