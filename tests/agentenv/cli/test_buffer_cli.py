"""``agentenv buffer serve|stats|export`` on real durable Buffers."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import anyio
import pytest

from agentenv import Sample, Status
from agentenv.buffer import Buffer, BufferConfig, RewardStdFilter
from agentenv.buffer._service import BufferClient
from agentenv.cli import main

ROOT = Path(__file__).resolve().parents[3]
GROUP_FIELDS = ("group_seq", "group_state", "group_step", "group_reason")


def group(
    gid: str, rewards: Sequence[float], *, version: int, failed: bool = False
) -> list[Sample]:
    out = [
        Sample(
            prompt_ids=[1, 2, 3],
            completion_ids=[10 + i, 11, 12],
            reward=r,
            loss_mask=[1, 0, 1],
            rollout_logprobs=[-0.1 * (i + 1), 0.0, -1 / 3],
            group_id=gid,
            id=f"{gid}/{i}",
            task_id=gid,
            episode=i,
            weight_versions=[str(version)],
            metadata={"k": i, "text": "ü"},
        )
        for i, r in enumerate(rewards)
    ]
    if failed:
        out.append(
            Sample(
                prompt_ids=[1],
                completion_ids=[],
                reward=0.0,
                group_id=gid,
                id=f"{gid}/x",
                episode=len(rewards),
                status=Status.FAILED,
                reason="boom",
                error_type="ValueError",
            )
        )
    return out


GROUPS = {
    "a": group("a", [1.0, 0.0, 0.5], version=0, failed=True),
    "b": group("b", [0.0, 1.0, 1.0, 0.0], version=1),
    "flat": group("flat", [1.0, 1.0, 1.0, 1.0], version=1),  # dropped by the filter
    "c": group("c", [0.25, 0.75, 0.0, 1.0], version=2),
    "d": group("d", [1.0, 0.0, 0.0, 0.0], version=2),
}


async def _fill(path: Path) -> None:
    cfg = BufferConfig(n_samples_per_prompt=4, filters=[RewardStdFilter()])
    async with Buffer(cfg, path=path) as buffer:
        for samples in GROUPS.values():
            await buffer.put_group(samples)
        first = await buffer.get_batch(2)  # a, b
        await buffer.ack(first, step=3)


@pytest.fixture
def buffer_dir(tmp_path: Path) -> Path:
    path = tmp_path / "buf"
    anyio.run(_fill, path)
    return path


def _snapshot(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_stats_counts_everything_read_only(
    buffer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _snapshot(buffer_dir)
    assert main(["buffer", "stats", str(buffer_dir), "--json"]) == 0
    out = capsys.readouterr().out
    assert _snapshot(buffer_dir) == before  # not a byte changed, no file added
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["groups"] == {"ready": 2, "consumed": 2, "dropped": 1, "stale": 0}
    assert summary["reasons"] == {"dropped": {"zero_reward_std": 1}}
    assert summary["samples"] == 20
    assert summary["samples_by_status"] == {"completed": 19, "failed": 1}
    assert summary["last_step"] == 3
    assert summary["weight_versions"]["min"] == 0 and summary["weight_versions"]["max"] == 2
    # Consumed by step 3: a (version 0) lags 3 steps, b (version 1) lags 2.
    assert summary["staleness"]["counts"] == {"2": 1, "3": 1}
    hist = summary["reward"]["histogram"]
    assert sum(hist["counts"]) == 19 and len(hist["bins"]) == len(hist["counts"]) + 1
    assert hist["bins"][0] == 0.0 and hist["bins"][-1] == 1.0
    assert hist["counts"][0] == 7 and hist["counts"][-1] == 9  # rewards 0.0 and 1.0
    text = out.split("{", 1)[0]
    for expected in ("ready 2", "consumed 2", "zero_reward_std 1", "failed 1", "█"):
        assert expected in text
    # Pointing at the file itself works too.
    assert main(["buffer", "stats", str(buffer_dir / "buffer.sqlite")]) == 0


def test_stats_reads_a_live_buffer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    async def live() -> None:
        async with Buffer(BufferConfig(n_samples_per_prompt=4), path=tmp_path / "live") as b:
            await b.put_group(GROUPS["b"])
            assert main(["buffer", "stats", str(tmp_path / "live"), "--json"]) == 0
            await b.put_group(GROUPS["c"])  # the Buffer still works alongside the reader

    anyio.run(live)
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["groups"]["ready"] == 1 and summary["samples"] == 4


def test_stats_refuses_what_is_not_a_buffer(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "text.sqlite").write_text("hello")
    foreign = tmp_path / "foreign.sqlite"
    db = sqlite3.connect(foreign)
    db.execute("CREATE TABLE users (name TEXT)")
    db.commit()
    db.close()
    for path, message in [
        (tmp_path / "missing", "does not exist"),
        (tmp_path / "empty", "has no buffer.sqlite"),
        (tmp_path / "text.sqlite", "not a SQLite file"),
        (foreign, "cannot be read as an agentenv buffer"),
    ]:
        assert main(["buffer", "stats", str(path)]) == 2
        err = capsys.readouterr().err
        assert message in err and str(path) in err


def _read_jsonl(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def _sample(row: dict[str, object]) -> Sample:
    return Sample.from_dict({k: v for k, v in row.items() if k not in GROUP_FIELDS})


def test_export_jsonl_is_exact_and_filters_by_state(
    buffer_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["buffer", "export", str(buffer_dir), "--format", "jsonl"]) == 0
    rows = _read_jsonl(capsys.readouterr().out)
    assert len(rows) == 20
    assert [_sample(r) for r in rows] == [s for g in GROUPS.values() for s in g]
    assert rows[0]["group_state"] == "consumed" and rows[0]["group_step"] == 3
    flat = [r for r in rows if r["group_id"] == "flat"]
    assert {(r["group_state"], r["group_reason"]) for r in flat} == {("dropped", "zero_reward_std")}

    out = tmp_path / "ready.jsonl"
    argv = ["buffer", "export", str(buffer_dir), "--format", "jsonl", "--state", "ready"]
    assert main([*argv, "--out", str(out)]) == 0
    assert "exported 8 samples" in capsys.readouterr().out
    ready = _read_jsonl(out.read_text())
    assert {r["group_id"] for r in ready} == {"c", "d"}
    assert [_sample(r) for r in ready] == GROUPS["c"] + GROUPS["d"]
    argv[-1] = "consumed"
    assert main(argv) == 0
    consumed = _read_jsonl(capsys.readouterr().out)
    assert {r["group_id"] for r in consumed} == {"a", "b"} and len(consumed) == 8


def test_export_parquet(buffer_dir: Path, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    out = tmp_path / "samples.parquet"
    argv = ["buffer", "export", str(buffer_dir), "--format", "parquet", "--out", str(out)]
    assert main(argv) == 0
    table = pq.read_table(out)
    assert table.num_rows == 20
    assert table.column_names[:3] == ["prompt_ids", "completion_ids", "reward"]
    rows = table.to_pylist()
    for row in rows:
        row["metadata"] = json.loads(row["metadata"])
    assert [_sample(r) for r in rows] == [s for g in GROUPS.values() for s in g]
    assert not list(tmp_path.glob("*.partial"))
    assert main(["buffer", "export", str(buffer_dir), "--format", "parquet"]) == 2


def _serve(tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentenv",
            "buffer",
            "serve",
            "--path",
            str(tmp_path / "served"),
            *extra,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.timeout(60)
def test_serve_refuses_a_missing_or_empty_token_file(tmp_path: Path) -> None:
    (tmp_path / "empty").write_text("\n")
    for name, message in [("missing", "does not exist"), ("empty", "is empty")]:
        proc = _serve(tmp_path, "--token-file", str(tmp_path / name))
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 2 and message in err and "secrets.token_urlsafe" in err
    assert not (tmp_path / "served").exists()  # nothing created


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text("tok-" + "x" * 20 + "\n")
    path.chmod(0o600)
    return path


@pytest.mark.timeout(60)
def test_serve_until_signalled(tmp_path: Path, token_file: Path) -> None:
    proc = _serve(tmp_path, "--token-file", str(token_file), "--n-samples-per-prompt", "4")
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert "serving" in line, line + (proc.stderr.read() if proc.stderr else "")
        url = line.split(" at ")[1].split()[0]
        assert url.startswith("http://127.0.0.1:")

        async def use() -> None:
            async with BufferClient(url, token="tok-" + "x" * 20) as client:
                await client.put_group(GROUPS["b"])
                batch = await client.get_batch(1)
                await client.ack(batch, step=1)
                await client.put_group(GROUPS["c"])

        anyio.run(use)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0 and "SIGTERM: stopping" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    db = sqlite3.connect(tmp_path / "served" / "buffer.sqlite")
    states = dict(db.execute("SELECT group_id, state FROM groups").fetchall())
    db.close()
    assert states == {"b": "consumed", "c": "ready"}


@pytest.mark.timeout(60)
def test_a_second_serve_of_one_directory_is_refused_naming_the_first(
    tmp_path: Path, token_file: Path
) -> None:
    first = _serve(tmp_path, "--token-file", str(token_file), "--lease-s", "5")
    try:
        assert first.stdout is not None
        assert "serving" in first.stdout.readline()
        second = _serve(tmp_path, "--token-file", str(token_file))
        _, err = second.communicate(timeout=30)
        assert second.returncode == 2, err
        assert f"open in process {first.pid}" in err and "one process per Buffer" in err
    finally:
        first.terminate()
        first.communicate(timeout=30)
    for flag, bad in [("--lease-s", "nan"), ("--lease-s", "0"), ("--max-body-mb", "1")]:
        proc = _serve(tmp_path, "--token-file", str(token_file), flag, bad)
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 2 and f"{flag}: " in err, err
