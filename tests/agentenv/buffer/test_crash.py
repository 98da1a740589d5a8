"""kill -9 a producer/consumer at random moments; nothing acknowledged is lost or repeated."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("crash_worker.py")
ROOT = Path(__file__).resolve().parents[3]
TOTAL = 9000  # groups; divisible by the worker's batch size; more than the killed runs finish


def _spawn(buf: Path, logs: Path) -> subprocess.Popen[bytes]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen(
        [sys.executable, str(WORKER), str(buf), str(logs), str(TOTAL)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_kill_minus_nine_at_random_moments(tmp_path: Path) -> None:
    buf, logs = tmp_path / "buffer", tmp_path / "logs"
    logs.mkdir()
    rng = random.Random(1234)
    kills = 0
    kills_progress: list[int] = []
    while kills < 24:
        proc = _spawn(buf, logs)
        time.sleep(rng.uniform(0.3, 0.8))  # imports take ~0.3 s; then it is mid-work
        if proc.poll() is not None:
            _, err = proc.communicate()
            assert proc.returncode == 0, err.decode()[-2000:]  # it ended, but not by a crash
            break  # it finished before we could kill it
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        kills += 1
        puts = logs / "puts.log"
        kills_progress.append(len(puts.read_text().split("\n")) - 1 if puts.exists() else 0)
    assert kills >= 20, "the worker finished too early to be killed 20 times"
    proc = _spawn(buf, logs)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()[-2000:]

    acked_puts = {int(x) for x in (logs / "puts.log").read_text().split("\n")[:-1]}
    steps = [json.loads(x) for x in (logs / "steps.log").read_text().split("\n")[:-1]]
    db = sqlite3.connect(buf / "buffer.sqlite")
    stored = {g for (g,) in db.execute("SELECT group_id FROM groups")}
    consumed = dict(db.execute("SELECT id, step FROM samples JOIN groups USING (seq)"))
    states = dict(db.execute("SELECT state, COUNT(*) FROM groups GROUP BY state"))
    db.close()

    # No acknowledged put lost: every logged group is stored.
    assert acked_puts == set(range(TOTAL))
    assert {f"task{i}@run" for i in acked_puts} <= stored
    # Every group stored once and, at the end, consumed once.
    assert len(stored) == TOTAL and states == {"consumed": TOTAL}
    # No sample handed to two committed steps: the logged steps are disjoint, and each
    # matches the step the store recorded.
    seen: dict[str, int] = {}
    for entry in steps:
        for sid in entry["ids"]:
            assert sid not in seen, f"{sid} in steps {seen[sid]} and {entry['step']}"
            seen[sid] = entry["step"]
            assert consumed[sid] == entry["step"]
    assert len({e["step"] for e in steps}) == len(steps)
    # The kills landed mid-work: the killed runs together logged only part of the puts.
    assert kills_progress[-1] < TOTAL
