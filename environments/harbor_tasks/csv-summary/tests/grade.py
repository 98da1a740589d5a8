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


import csv
import os
import shutil
import tempfile

tmp = tempfile.mkdtemp(dir="/tmp")
os.chmod(tmp, 0o755)
for name in ("hidden.csv", "tiny.csv"):
    path = os.path.join(tmp, name)
    shutil.copy(f"/tests/{name}", path)
    os.chmod(path, 0o644)
    want = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            want[row["region"]] = want.get(row["region"], 0.0) + float(row["amount"])
    status, out = as_agent("python3", "/app/summarize.py", path)
    try:
        got = json.loads(out)
    except ValueError:
        fail(f"summarize.py {name} printed no JSON (exit status {status}): {out[:200]!r}")
    if not isinstance(got, dict) or set(got) != set(want):
        fail(
            f"summarize.py {name}: regions {sorted(got) if isinstance(got, dict) else got}, want {sorted(want)}"
        )
    for region, total in want.items():
        value = got[region]
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or abs(value - round(total, 2)) > 0.006
        ):
            fail(f"summarize.py {name}: {region} is {value!r}, want {round(total, 2)}")

print("PASS")
