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


import configparser

cfg = configparser.ConfigParser()
try:
    with open("/app/server.ini") as f:
        cfg.read_file(f)
except (OSError, configparser.Error) as e:
    fail(f"server.ini does not parse: {e}")
want = {
    ("server", "host"): "127.0.0.1",
    ("server", "port"): "8080",
    ("server", "debug"): "false",
    ("server", "workers"): "4",
    ("database", "url"): "sqlite:////app/data.db",
    ("database", "pool_size"): "20",
    ("database", "timeout"): "30",
}
for (section, key), value in want.items():
    got = cfg.get(section, key, fallback=None)
    if got != value:
        fail(f"[{section}] {key} is {got!r}, want {value!r}")
if sorted(cfg.sections()) != ["database", "server"]:
    fail(f"sections changed: {cfg.sections()}")

print("PASS")
