"""kill -9 ``agentenv train`` (async, one_step_off) at random moments, then run the same
command again: every group committed to the run's Buffer is still there, none is played
again, none trained twice, none lost, and ``SAVE/batches.jsonl`` is the saved model's
lineage -- a step redone after a resume trains the groups it trained before."""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.test_loop import GoodTokensEnv, tiny_llama
from trainer.run._producer import TaskStream

ROOT = Path(__file__).resolve().parents[2]
STEPS = 8
BATCH = 2  # prompts a step (and a round), 2 episodes each

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _command(model: Path, save: Path, schedule: str) -> list[str]:
    return [
        sys.executable, "-m", "agentenv", "train",
        "--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint", str(model),
        "--num-rollout", str(STEPS), "--rollout-batch-size", str(BATCH),
        "--n-samples-per-prompt", "2", "--rollout-max-response-len", "8", "--n-eval", "0",
        "--schedule", schedule, "--save-interval", "1", "--save", str(save), "--json",
    ]  # fmt: skip


def _lines(path: Path) -> list[dict[str, Any]]:
    """The whole lines of a JSONL file (a line a kill cut short is not one)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines(keepends=True):
        if line.endswith("\n"):
            out.append(json.loads(line))
    return out


def _groups(save: Path) -> dict[str, tuple[str, int | None]]:
    """The groups committed to the run's Buffer: group id -> (state, step), read-only."""
    db_path = save / "buffer" / "buffer.sqlite"
    if not db_path.exists():
        return {}
    db = sqlite3.connect(f"{db_path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        rows = db.execute("SELECT group_id, state, step FROM groups").fetchall()
    except sqlite3.OperationalError:  # the index is being created
        return {}
    finally:
        db.close()
    return {g: (state, step) for g, state, step in rows}


def _trained(lines: list[dict[str, Any]]) -> dict[int, list[str]]:
    return {line["step"]: [g["group"] for g in line["groups"]] for line in lines}


def _count(save: Path, kind: str) -> int:
    """The groups committed, or the whole lines of ``SAVE/{kind}.jsonl``."""
    return len(_groups(save)) if kind == "groups" else len(_lines(save / f"{kind}.jsonl"))


def _wait(proc: subprocess.Popen[bytes], count: Callable[[], int], target: int) -> bool:
    """Until ``count()`` reaches ``target`` (True) or the run ends (False): a bounded
    poll of its files."""
    deadline = time.monotonic() + 300
    while proc.poll() is None:
        if count() >= target:
            return True
        assert time.monotonic() < deadline, "the run made no progress in 300 s"
        time.sleep(0.01)
    return False


def _plan(schedule: str, rounds: int) -> list[tuple[int, list[str]]]:
    """The rounds a run that never stopped plays, in order: (seed, task ids). Rounds take
    the next tasks of the stream; their seeds follow the schedule's rule."""
    stream = TaskStream(GoodTokensEnv().tasks(), seed=0, shuffle=True)
    out = []
    for k in range(rounds):
        seed = 7_919 * k if schedule == "async" else k
        out.append((seed, [t.id for t in stream.take(BATCH)]))
    return out


@pytest.mark.parametrize("schedule", ["async", "one_step_off"])
def test_killed_at_random_moments_and_resumed_every_committed_group_trains_once(
    tmp_path: Path, schedule: str
) -> None:
    model = tiny_llama(tmp_path / "tiny")
    save = tmp_path / "run"
    command = _command(model, save, schedule)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rng = random.Random(f"kill {schedule}")
    snapshots: list[tuple[dict[int, list[str]], dict[str, tuple[str, int | None]]]] = []
    checkpoints: list[int] = []  # the step of the checkpoint at each kill
    kills = 0
    while kills < 5:
        proc = subprocess.Popen(
            command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        # A kill point: after some more groups are committed, or a step's batch is
        # recorded (then its checkpoint is written), or a step is reported (the next one
        # is under way) -- its kind and distance from the seeded RNG.
        kind = rng.choice(["groups", "batches", "metrics"])
        more = rng.randint(1, 2)
        count = partial(_count, save, kind)
        killed = _wait(proc, count, count() + more)
        if not killed:  # it finished first
            _, err = proc.communicate()
            assert proc.returncode == 0, err.decode()[-3000:]
            break
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
        kills += 1
        snapshots.append((_trained(_lines(save / "batches.jsonl")), _groups(save)))
        saved = save / "checkpoint" / "checkpoint.json"
        checkpoints.append(json.loads(saved.read_text())["extra"]["step"] if saved.exists() else -1)
    assert kills >= 3, f"the run finished after {kills} kills"
    # The kills landed mid-work: groups committed and not yet trained, steps trained
    # after the checkpoint a resume starts from (what it rewinds).
    assert any(state == "ready" for _, groups in snapshots for state, _ in groups.values())
    assert any(max(t, default=-1) > c for (t, _), c in zip(snapshots, checkpoints, strict=True))
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr.decode()[-3000:]
    assert json.loads(done.stdout.decode().splitlines()[-1])["steps"] == STEPS

    lines = _lines(save / "batches.jsonl")
    trained = _trained(lines)
    final = _groups(save)
    # The record is the saved model's lineage: each step once, in order.
    assert [line["step"] for line in lines] == list(range(STEPS))
    assert [m["step"] for m in _lines(save / "metrics.jsonl")] == list(range(STEPS))
    # None trained twice: no group in two steps; each step a full batch.
    flat = [g for groups in trained.values() for g in groups]
    assert len(flat) == len(set(flat)) == STEPS * BATCH
    # The Buffer agrees: what it holds as consumed is what the lineage trained, by step.
    consumed = {g: step for g, (state, step) in final.items() if state == "consumed"}
    assert consumed == {g: step for step, groups in trained.items() for g in groups}
    for before, committed in snapshots:
        # A step redone after a resume trained the groups it trained before the kill (the
        # lineage names a step's groups; their order in the batch is not part of it).
        for step, groups in before.items():
            assert sorted(trained[step]) == sorted(groups), (step, before, trained)
        # None lost: every group committed before a kill is still there, kept for a
        # step (trained, or still ready) unless the staleness bound dropped it.
        for g in committed:
            assert g in final, g
            assert final[g][0] in ("consumed", "ready", "stale"), (g, final[g])
    # None played again: every group stored is one of the rounds a run that never stopped
    # plays, in its order (a round played again after a resume would be another round, of
    # other seeds and tasks); and the rounds in flight at a kill were finished.
    plan = _plan(schedule, 64)
    names = [{f"{t}@s{seed}" for t in ids} for seed, ids in plan]
    allowed = set().union(*names)
    assert set(final) <= allowed, sorted(set(final) - allowed)
    last = max(i for i, round_ in enumerate(names) if round_ & set(final))
    # async: the rounds admitted at the end may be cut short (at most a staleness bound's
    # worth: 2 batches); one_step_off plays the round of each step and no more.
    complete = last - 2 if schedule == "async" else last + 1
    assert schedule == "async" or last == STEPS - 1
    for round_ in names[:complete]:
        assert round_ <= set(final), (round_, sorted(final))
