"""The Data Buffer: groups, policies, filters, staleness, backpressure, batches, durability."""

from __future__ import annotations

import dataclasses
import functools
import math
import sqlite3
from collections.abc import Sequence
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from agentenv import ConfigError, Sample, SampleError, Status
from agentenv.buffer import (
    Buffer,
    BufferConfig,
    BufferStoreError,
    FilterResult,
    RewardStdFilter,
    UnknownBatchError,
)
from tests.agentenv.buffer._groups import group

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def test_put_get_ack_and_statistics() -> None:
    async with Buffer(BufferConfig(n_samples_per_prompt=2, rollout_batch_size=2)) as b:
        await b.put_group(group("a", [1, 0]))
        await b.put_group(group("b", [0, 1]))
        await b.put_group(group("c", [1, 1]))
        batch = await b.get_batch()
        assert [g.group_id for g in batch.groups] == ["a", "b"]
        assert [s.reward for s in batch.samples] == [1, 0, 0, 1]
        await b.ack(batch, step=1)
        st = await b.statistics()
        assert (st.groups_put, st.samples_put, st.kept, st.ready, st.consumed) == (3, 6, 3, 1, 2)
        with pytest.raises(UnknownBatchError, match="unknown batch"):
            await b.ack(batch, step=1)
        with pytest.raises(UnknownBatchError):
            await b.ack("nope")


async def test_failed_samples_policy() -> None:
    cfg = BufferConfig(n_samples_per_prompt=4, min_group_size=3)
    async with Buffer(cfg) as b:
        await b.put_group(group("one_failed", [1, 0, 1, 0], failed=[2]))
        await b.put_group(group("two_failed", [1, 0, 1, 0], failed=[0, 1]))
        batch = await b.get_batch(1)
        assert len(batch.groups[0].samples) == 3
        assert all(s.status is not Status.FAILED for s in batch.samples)
        st = await b.statistics()
        assert st.dropped == {"too_small": 1} and st.failed_samples_dropped == 3
    async with Buffer(BufferConfig(n_samples_per_prompt=4, on_failed="drop_group")) as b:
        await b.put_group(group("x", [1, 0, 1, 0], failed=[3]))
        assert (await b.statistics()).dropped == {"failed_sample": 1}


async def test_multi_agent_groups_by_role() -> None:
    async with Buffer(BufferConfig(n_samples_per_prompt=2)) as b:
        samples = group("g", [1, 0], role="red") + group("g", [0, 1], role="blue")
        await b.put_group(samples)
        batch = await b.get_batch(2)
        assert sorted(g.role for g in batch.groups) == ["blue", "red"]
        assert all(len(g.samples) == 2 for g in batch.groups)


async def test_filters_count_reasons() -> None:
    async def no_long(samples: Sequence[Sample]) -> FilterResult:
        return FilterResult(all(len(s.completion_ids) < 10 for s in samples), "too_long")

    def never_negative(samples: Sequence[Sample]) -> bool:
        return all(s.reward >= 0 for s in samples)

    cfg = BufferConfig(n_samples_per_prompt=2, filters=[RewardStdFilter(), no_long, never_negative])
    async with Buffer(cfg) as b:
        await b.put_group(group("flat", [1, 1]))
        await b.put_group(group("long", [1, 0], tokens=20))
        await b.put_group(group("neg", [-1, 0]))
        await b.put_group(group("ok", [1, 0]))
        st = await b.statistics()
        assert st.dropped == {"zero_reward_std": 1, "too_long": 1, "never_negative": 1}
        assert st.kept == 1 and math.isclose(st.pass_rate, 0.25)
        # Over-sampling: 4 kept groups wanted, 1 ready, pass rate 1/4 -> 12 more prompts.
        assert (await b.prompts_to_start(4)) == 12
        await b.reserve(8)
        assert (await b.prompts_to_start(4)) == 4  # 8 in flight are expected to yield 2


async def test_staleness_drop_and_recycle() -> None:
    cfg = BufferConfig(n_samples_per_prompt=2, max_staleness=1, on_stale="recycle")
    async with Buffer(cfg) as b:
        await b.put_group(group("old@r", [1, 0], version=0))
        await b.put_group(group("new@r", [1, 0], version=2))
        batch = await b.get_batch(1, policy_version=2)
        assert batch.groups[0].group_id == "new@r"
        assert (await b.recycled()) == ["old"] and (await b.recycled()) == []
        await b.put_group(group("older@r", [1, 0], version=0))  # stale on arrival
        st = await b.statistics()
        assert st.recycled == 2 and st.ready == 0
    cfg = BufferConfig(n_samples_per_prompt=2, max_staleness=0)
    async with Buffer(cfg) as b:
        await b.set_policy_version(3)
        await b.put_group(group("s", [1, 0], version=2))
        assert (await b.statistics()).stale_dropped == 1
        with pytest.raises(SampleError, match="integer versions"):
            await b.put_group(
                [
                    *group("v", [1])[:0],
                    Sample(
                        prompt_ids=[1],
                        completion_ids=[2],
                        reward=1.0,
                        group_id="v",
                        weight_versions=["scripted"],
                    ),
                ]
            )


async def test_admission_control_bounds_started_rollouts() -> None:
    cfg = BufferConfig(n_samples_per_prompt=1, max_staleness=1, rollout_batch_size=2)
    async with Buffer(cfg) as b:
        await b.set_policy_version(0)
        await b.reserve(4)  # (1 + 1) * 2 = 4 groups may be alive
        with anyio.move_on_after(0.2) as scope:
            await b.reserve(1)
        assert scope.cancelled_caught
        for name in "abcd":
            await b.put_group(group(name, [1]))
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.reserve, 1)
            await anyio.wait_all_tasks_blocked()
            assert (await b.statistics()).in_flight == 0  # still waiting: 4 ready
            await b.get_batch(2)  # the trainer took a batch: room for two more
        assert (await b.statistics()).in_flight == 1
        # The same after a resume at a later version: the bound is on what is alive.
        await b.set_policy_version(50)
        await b.reserve(1)
        with anyio.move_on_after(0.2) as scope:
            await b.reserve(1)
        assert scope.cancelled_caught


async def test_admission_lets_dropped_groups_free_their_room_and_never_starves() -> None:
    cfg = BufferConfig(
        n_samples_per_prompt=1, max_staleness=0, rollout_batch_size=2,
        filters=[lambda samples: samples[0].reward > 0],
    )  # fmt: skip
    async with Buffer(cfg) as b:
        await b.reserve(2)
        await b.put_group(group("a", [0]))  # dropped by the filter: frees its room
        await b.put_group(group("b", [1]))
        with anyio.fail_after(60):  # (a bound against a hang, not a timing)
            await b.reserve(1)
        assert (await b.statistics()).in_flight == 1
    async with Buffer(cfg) as b:
        with anyio.fail_after(60):
            await b.reserve(5)  # more than the bound, but nothing is alive: it starts


async def test_backpressure_put_waits_when_full() -> None:
    async with Buffer(BufferConfig(n_samples_per_prompt=1, capacity=2)) as b:
        await b.put_group(group("a", [1]))
        await b.put_group(group("b", [1]))
        done = []

        async def put_third() -> None:
            await b.put_group(group("c", [1]))
            done.append(True)

        async with anyio.create_task_group() as tg:
            tg.start_soon(put_third)
            await anyio.wait_all_tasks_blocked()
            assert not done and (await b.statistics()).ready == 2
            await b.get_batch(1)
        assert done == [True] and (await b.statistics()).ready == 2


async def test_get_batch_waits_and_times_out() -> None:
    async with Buffer(BufferConfig(n_samples_per_prompt=1)) as b:
        with pytest.raises(TimeoutError):
            await b.get_batch(1, timeout=0.1)
        async with anyio.create_task_group() as tg:
            tg.start_soon(b.put_group, group("late", [1]))
            batch = await b.get_batch(1, timeout=5)
        assert batch.groups[0].group_id == "late"


async def test_duplicate_put_is_a_counted_no_op(tmp_path: Path) -> None:
    for path in (None, tmp_path / "buf"):
        async with Buffer(BufferConfig(n_samples_per_prompt=2), path=path) as b:
            await b.put_group(group("a", [1, 0]))
            await b.put_group(group("a", [1, 0]))
            st = await b.statistics()
            assert (st.groups_put, st.duplicate_groups, st.ready) == (1, 1, 1)


def test_the_buffer_knows_nothing_of_the_trainers_optimizer_steps() -> None:
    fields = {f.name for f in dataclasses.fields(BufferConfig)}
    assert not fields & {"global_batch_size", "num_steps_per_rollout"}


async def test_bad_input() -> None:
    async with Buffer(BufferConfig(n_samples_per_prompt=2)) as b:
        with pytest.raises(SampleError, match="Sample objects"):
            await b.put_group([{"prompt_ids": [1]}])  # type: ignore[list-item]
        with pytest.raises(SampleError, match="3 episodes but n_samples_per_prompt is 2"):
            await b.put_group(group("big", [1, 0, 1]))
        with pytest.raises(SampleError, match="one group"):
            await b.put_group(group("x", [1]) + group("y", [0]))
        with pytest.raises(SampleError, match="no group_id"):
            await b.put_group([Sample(prompt_ids=[1], completion_ids=[2], reward=1.0)])
        with pytest.raises(SampleError, match="at least one"):
            await b.put_group([])
        assert (await b.statistics()).groups_put == 0
    with pytest.raises(SampleError, match="finite"):
        Sample(prompt_ids=[1], completion_ids=[2], reward=float("nan"))
    with pytest.raises(SampleError, match="aligned"):
        Sample(prompt_ids=[1], completion_ids=[2], reward=1.0, loss_mask=[1, 1])


async def test_closed_buffer_raises() -> None:
    from agentenv import ClosedResourceError

    b = Buffer()
    await b.aclose()
    with pytest.raises(ClosedResourceError):
        await b.put_group(group("a", [1]))


# -- durability ------------------------------------------------------------------------------
async def test_durable_restart_redelivers_unacked_and_keeps_acked(tmp_path: Path) -> None:
    path = tmp_path / "buf"
    cfg = BufferConfig(n_samples_per_prompt=2)
    async with Buffer(cfg, path=path) as b:
        for name in "abcd":
            await b.put_group(group(name, [1, 0]))
        first = await b.get_batch(1)
        await b.ack(first, step=1)
        second = await b.get_batch(1)  # handed out, never acknowledged
        assert second.groups[0].group_id == "b"
    async with Buffer(cfg, path=path) as b:
        assert (await b.position()) == 1
        batch = await b.get_batch(3)
        assert [g.group_id for g in batch.groups] == ["b", "c", "d"]
        assert batch.samples[0] == group("b", [1, 0])[0]  # exact round trip through disk
        await b.ack(batch, step=2)
    async with Buffer(cfg, path=path) as b:
        assert (await b.statistics()).ready == 0 and (await b.position()) == 2
        # The trainer resumes from its step-1 checkpoint: step 2 was never committed.
        assert await b.rewind(1) == 3
        again = await b.get_batch(3)
        assert [g.group_id for g in again.groups] == ["b", "c", "d"]


async def test_foreign_or_corrupt_file_is_refused_untouched(tmp_path: Path) -> None:
    junk = tmp_path / "junk"
    junk.mkdir()
    (junk / "buffer.sqlite").write_bytes(b"not a database at all" * 100)
    before = (junk / "buffer.sqlite").read_bytes()
    with pytest.raises(ConfigError, match="not an agentenv buffer"):
        Buffer(path=junk)
    assert (junk / "buffer.sqlite").read_bytes() == before

    foreign = tmp_path / "foreign"
    foreign.mkdir()
    db = sqlite3.connect(foreign / "buffer.sqlite")
    db.execute("CREATE TABLE users (name TEXT)")
    db.execute("INSERT INTO users VALUES ('alice')")
    db.commit()
    db.close()
    before = (foreign / "buffer.sqlite").read_bytes()
    with pytest.raises(ConfigError, match="not an agentenv buffer"):
        Buffer(path=foreign)
    assert (foreign / "buffer.sqlite").read_bytes() == before

    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        Buffer(path=a_file)


async def test_disk_full_fails_the_put_and_writes_nothing_partial(tmp_path: Path) -> None:
    path = tmp_path / "buf"
    cfg = BufferConfig(n_samples_per_prompt=4, capacity=10_000)
    b = Buffer(cfg, path=path)
    b._store._db.execute("PRAGMA max_page_count = 60")  # type: ignore[attr-defined]
    stored = 0

    async def fill() -> None:
        nonlocal stored
        for i in range(10_000):
            await b.put_group(group(f"g{i}", [1, 0, 1, 0], tokens=400))
            stored += 1

    with pytest.raises(BufferStoreError, match="full"):
        await fill()
    await b.aclose()
    db = sqlite3.connect(path / "buffer.sqlite")
    counts = db.execute("SELECT seq, COUNT(*) FROM samples GROUP BY seq").fetchall()
    db.close()
    assert len(counts) == stored and all(n == 4 for _, n in counts)
    async with Buffer(cfg, path=path) as b:
        assert (await b.statistics()).ready == stored


async def test_log_write_failure_fails_the_put_and_writes_nothing_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills up halfway through appending a commit's samples to the log."""
    import errno
    import os

    from agentenv.buffer import _store

    path = tmp_path / "buf"
    cfg = BufferConfig(n_samples_per_prompt=2)
    async with Buffer(cfg, path=path) as b:
        await b.put_group(group("kept", [1, 0], tokens=300))
        size = (path / "samples.log").stat().st_size
        real_pwrite = os.pwrite

        def half(fd: int, buffers: list[bytes], offset: int) -> int:
            data = b"".join(buffers)
            return real_pwrite(fd, data[: len(data) // 2], offset)

        def full(fd: int, data: bytes, offset: int) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(_store.os, "pwritev", half)
        monkeypatch.setattr(_store.os, "pwrite", full)
        with pytest.raises(BufferStoreError, match="No space left on device"):
            await b.put_group(group("lost", [1, 0], tokens=300))
        monkeypatch.undo()
        assert (path / "samples.log").stat().st_size == size  # the half-written part is gone
        await b.put_group(group("after", [0, 1], tokens=300))  # the Buffer goes on
    async with Buffer(cfg, path=path) as b:
        batch = await b.get_batch(2)
        assert [g.group_id for g in batch.groups] == ["kept", "after"]
        assert batch.samples == [
            *group("kept", [1, 0], tokens=300),
            *group("after", [0, 1], tokens=300),
        ]


async def test_log_damage_is_repaired_or_refused(tmp_path: Path) -> None:
    path = tmp_path / "buf"
    cfg = BufferConfig(n_samples_per_prompt=2)
    async with Buffer(cfg, path=path) as b:
        await b.put_group(group("a", [1, 0]))
    log = path / "samples.log"
    good = log.read_bytes()
    # A put that crashed after appending, before committing: its bytes are cut off.
    log.write_bytes(good + b"half of a sample")
    async with Buffer(cfg, path=path) as b:
        assert (await b.statistics()).ready == 1
    assert log.read_bytes() == good
    # A log shorter than its index, or none at all: refused, nothing changed.
    log.write_bytes(good[:-10])
    with pytest.raises(ConfigError, match="truncated or replaced"):
        Buffer(cfg, path=path)
    assert log.read_bytes() == good[:-10]
    log.unlink()
    with pytest.raises(ConfigError, match=r"samples\.log.*missing"):
        Buffer(cfg, path=path)
    # A log without its index is not ours to overwrite.
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "samples.log").write_bytes(b"someone else's data")
    with pytest.raises(ConfigError, match="without its index"):
        Buffer(cfg, path=stray)
    assert (stray / "samples.log").read_bytes() == b"someone else's data"


async def test_rollout_runner_writes_into_the_buffer(smollm2) -> None:  # type: ignore[no-untyped-def]
    from agentenv import RolloutConfig, ScriptedModel, run_rollouts
    from environments.arithmetic import ArithmeticEnv

    env = ArithmeticEnv()
    tasks = env.tasks("test")[:6]
    model = ScriptedModel(smollm2, lambda ctx: "42")
    async with Buffer(BufferConfig(n_samples_per_prompt=3)) as b:
        await run_rollouts(
            env,
            tasks,
            model,
            tokenizer=smollm2,
            sink=b,
            config=RolloutConfig(n_samples_per_prompt=3),
        )
        batch = await b.get_batch(6)
        assert {g.task_id for g in batch.groups} == {t.id for t in tasks}
        assert all(len(g.samples) == 3 for g in batch.groups)
        assert all(s.id and s.episode is not None for s in batch.samples)


async def test_release_batch_puts_groups_back_in_order() -> None:
    async with Buffer(BufferConfig(n_samples_per_prompt=1)) as b:
        for name in "abc":
            await b.put_group(group(name, [1]))
        first = await b.get_batch(2)
        await b.release_batch(first)
        with pytest.raises(UnknownBatchError):
            await b.release_batch(first)
        again = await b.get_batch(3)
        assert [g.group_id for g in again.groups] == ["a", "b", "c"]
        await b.ack(again, step=7)
        assert (await b.position()) == 7
        with pytest.raises(ConfigError, match="durable"):
            await b.rewind(3)


async def test_cancelling_the_committing_put_does_not_fail_the_others(tmp_path: Path) -> None:
    async with Buffer(BufferConfig(n_samples_per_prompt=1), path=tmp_path / "buf") as b:
        done: list[str] = []
        scope = anyio.CancelScope()

        async def put_a() -> None:
            with scope:
                await b.put_group(group("a", [1]))  # becomes the committer

        async def put_b() -> None:
            await b.put_group(group("b", [1]))  # waits for a's commit round
            done.append("b")

        async with anyio.create_task_group() as tg:
            tg.start_soon(put_a)
            await anyio.lowlevel.checkpoint()
            tg.start_soon(put_b)
            await anyio.lowlevel.checkpoint()
            scope.cancel()
        assert done == ["b"]
        # The commit had begun when a was cancelled: it completed, for both groups.
        assert (await b.statistics()).ready == 2


async def test_a_bad_put_fails_alone_in_its_group_commit(tmp_path: Path) -> None:
    """Puts and an acknowledgement share one transaction; a put whose sample ids belong to
    another group fails, the others in the same commit are stored."""
    cfg = BufferConfig(n_samples_per_prompt=2)
    async with Buffer(cfg, path=tmp_path / "buf") as b:
        await b.put_group(group("a", [1, 0]))
        batch = await b.get_batch(1)
        thief = [  # one id of group "a", one new: not a retry of "a"
            Sample(prompt_ids=[1], completion_ids=[2], reward=0.0, group_id="b", id=i)
            for i in (group("a", [1])[0].id, "b/new")
        ]
        errors: list[BaseException] = []

        async def put(samples: list[Sample]) -> None:
            try:
                await b.put_group(samples)
            except ConfigError as e:
                errors.append(e)

        async with anyio.create_task_group() as tg:  # all four reach the same commit
            tg.start_soon(put, group("c", [1, 0]))
            tg.start_soon(put, thief)
            tg.start_soon(put, group("d", [0, 1]))
            tg.start_soon(functools.partial(b.ack, batch, step=0))
        assert len(errors) == 1 and "already stored under another group" in str(errors[0])
        assert await b.position() == 0
    async with Buffer(cfg, path=tmp_path / "buf") as b:
        batch = await b.get_batch(2)
        assert sorted(g.group_id for g in batch.groups) == ["c", "d"]


# -- capacity under concurrency ------------------------------------------------------------
@pytest.mark.parametrize("durability", [None, "power", "process"])
async def test_capacity_bounds_200_concurrent_puts(tmp_path: Path, durability: str | None) -> None:
    cfg = BufferConfig(n_samples_per_prompt=2, capacity=8, durability=durability or "power")
    path = tmp_path / "buf" if durability else None
    async with Buffer(cfg, path=path) as b:
        left: list[int] = []
        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(b.put_group, group(f"g{i}", [1, 0]))
            with anyio.fail_after(30):
                for _ in range(200 // 8):
                    # Returns once 8 are ready; none beyond them may be then.
                    batch = await b.get_batch(8)
                    left.append((await b.statistics()).ready)
                    await b.ack(batch)
        assert left == [0] * 25
        st = await b.statistics()
        assert (st.groups_put, st.consumed, st.ready) == (200, 200, 0)


async def test_capacity_holds_while_an_async_filter_runs() -> None:
    gate = anyio.Event()
    filtering = 0

    async def gated(samples: Sequence[Sample]) -> bool:
        nonlocal filtering
        filtering += 1
        await gate.wait()
        return True

    cfg = BufferConfig(n_samples_per_prompt=2, capacity=4, filters=[gated])
    async with Buffer(cfg) as b, anyio.create_task_group() as tg:
        for i in range(50):
            tg.start_soon(b.put_group, group(f"g{i}", [1, 0]))
        await anyio.wait_all_tasks_blocked()
        assert filtering == 4  # only the puts that fit went on to the filter
        gate.set()
        await anyio.wait_all_tasks_blocked()
        assert (await b.statistics()).ready == 4 and filtering == 4
        tg.cancel_scope.cancel()


# -- counts -----------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", [-1, -5, 1.5, True, "2"])
async def test_reserve_and_release_refuse_bad_counts(bad: object) -> None:
    async with Buffer() as b:
        await b.reserve(2)
        for method in (b.reserve, b.release):
            with pytest.raises(
                ConfigError, match=rf"{method.__name__} takes a number of prompts >= 0, got {bad!r}"
            ):
                await method(bad)  # type: ignore[arg-type]
        assert (await b.statistics()).in_flight == 2


async def test_reserve_refuses_more_than_its_bound_and_release_more_than_reserved() -> None:
    async with Buffer(BufferConfig(capacity=8)) as b:
        for huge in (9, 10**9, 2**70):
            with pytest.raises(ConfigError, match=rf"reserve\({huge}\).*at most 8"):
                await b.reserve(huge)
        await b.reserve(8)
        with pytest.raises(ConfigError, match=r"release\(9\).*reserved and not yet put \(8\)"):
            await b.release(9)
        await b.release(8)
        assert (await b.statistics()).in_flight == 0
    cfg = BufferConfig(n_samples_per_prompt=1, capacity=4, max_staleness=2, rollout_batch_size=4)
    async with Buffer(cfg) as b:
        await b.reserve(12)  # (2 + 1) * 4: a bound above the capacity
        with pytest.raises(ConfigError, match=r"at most 12"):
            await b.reserve(13)


async def test_get_batch_refuses_a_bad_timeout_or_lease() -> None:
    async with Buffer(BufferConfig(rollout_batch_size=1)) as b:
        for bad in (math.nan, -1.0, "5"):
            with pytest.raises(
                ConfigError, match=rf"timeout must be a number of seconds >= 0.*{bad!r}"
            ):
                await b.get_batch(timeout=bad)  # type: ignore[arg-type]
        for bad in (math.nan, math.inf, 0.0, -1.0):
            with pytest.raises(ConfigError, match=rf"lease_s must be a finite number.*{bad!r}"):
                await b.get_batch(lease_s=bad)
        with pytest.raises(ConfigError, match="a step must be an int"):
            await b.ack("x", step=2**64)


# -- one process per directory ---------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[3]


def _append(path: Path, data: bytes) -> None:
    with path.open("ab") as f:
        f.write(data)


HOLDER = """
import sys, anyio
from agentenv.buffer import Buffer

async def main():
    async with Buffer(path=sys.argv[1]):
        print("open", flush=True)
        await anyio.sleep_forever()

anyio.run(main)
"""


async def test_a_second_process_cannot_open_the_directory(tmp_path: Path) -> None:
    import os
    import sys

    from agentenv.buffer import BufferLockedError

    path = tmp_path / "buf"
    async with await anyio.open_process(
        [sys.executable, "-c", HOLDER, str(path)], env=dict(os.environ, PYTHONPATH=str(ROOT))
    ) as holder:
        assert holder.stdout is not None
        with anyio.fail_after(60):
            line = await BufferedByteReceiveStream(holder.stdout).receive_until(b"\n", 64)
        assert line == b"open"
        with pytest.raises(BufferLockedError, match=rf"open in process {holder.pid}\b") as info:
            Buffer(path=path)
        assert "agentenv buffer serve" in str(info.value)
        assert "one process per Buffer directory" in str(info.value)
        holder.kill()  # SIGKILL: the kernel drops the lock with the process
        await holder.wait()
    async with Buffer(path=path) as b:
        await b.put_group(group("a", [1]))
        # Not even a second Buffer in this process: its truncation would be the same harm.
        with pytest.raises(BufferLockedError, match=rf"open in process {os.getpid()}\b"):
            Buffer(path=path)
    async with Buffer(path=path) as b:  # closing released it
        assert (await b.statistics()).ready == 1


async def test_removing_the_lock_file_does_not_let_a_second_process_in(tmp_path: Path) -> None:
    import os
    import sys

    path = tmp_path / "buf"
    async with await anyio.open_process(
        [sys.executable, "-c", HOLDER, str(path)], env=dict(os.environ, PYTHONPATH=str(ROOT))
    ) as holder:
        assert holder.stdout is not None
        with anyio.fail_after(60):
            line = await BufferedByteReceiveStream(holder.stdout).receive_until(b"\n", 64)
        assert line == b"open"
        (path / "buffer.lock").unlink()  # a user tidying up: the lock must not depend on it
        with anyio.fail_after(60):
            second = await anyio.run_process(
                [sys.executable, "-c", OPENER, str(path)],
                env=dict(os.environ, PYTHONPATH=str(ROOT)),
                check=False,
            )
        holder.kill()
        await holder.wait()
    assert second.stdout.decode().strip() == "BufferLockedError", second.stderr.decode()


OPENER = """
import sys
from agentenv.buffer import Buffer, BufferLockedError

try:
    Buffer(path=sys.argv[1])
    print("opened")
except BufferLockedError:
    print("BufferLockedError")
"""


async def test_a_second_opener_cannot_cut_off_an_unindexed_put(tmp_path: Path) -> None:
    from agentenv.buffer import BufferLockedError

    path = tmp_path / "buf"
    async with Buffer(path=path) as b:
        await b.put_group(group("a", [1]))
        size = (path / "samples.log").stat().st_size
        # A put written to the log but not yet indexed (the moment a second opener used to
        # cut it off): bytes past the index.
        _append(path / "samples.log", b"x" * 100)
        with pytest.raises(BufferLockedError):
            Buffer(path=path)
        assert (path / "samples.log").stat().st_size == size + 100


async def test_a_creation_killed_at_any_point_leaves_a_directory_that_opens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kill -9 while a durable Buffer creates its directory: before the index is renamed
    into place (a half-made index beside it), or between the index and the log. Each
    leaves a directory that opens as a new, empty Buffer."""
    import os

    from agentenv.buffer import _store

    cfg = BufferConfig(n_samples_per_prompt=2, rollout_batch_size=1)
    killed = tmp_path / "before_rename"

    def killed_before_rename(src: object, dst: object) -> None:
        raise KeyboardInterrupt  # the process dies here, its temporary index left behind

    monkeypatch.setattr(_store.os, "replace", killed_before_rename)
    with pytest.raises(KeyboardInterrupt):
        Buffer(cfg, path=killed)
    monkeypatch.undo()
    assert (killed / "buffer.sqlite.new").exists() and not (killed / "buffer.sqlite").exists()
    between = tmp_path / "between"
    async with Buffer(cfg, path=between) as b:
        await b.put_group(group("a", [0.0, 1.0]))
    os.remove(between / "samples.log")  # as if killed before the log was created...
    with sqlite3.connect(between / "buffer.sqlite") as db:  # ...so nothing was indexed
        db.execute("DELETE FROM samples")
        db.execute("DELETE FROM groups")
    for path in (killed, between):
        async with Buffer(cfg, path=path) as b:
            assert (await b.statistics()).ready == 0
            await b.put_group(group("b", [0.0, 1.0]))
            batch = await b.get_batch()
            assert [s.group_id for s in batch.samples] == ["b", "b"]
        assert not list(path.glob("buffer.sqlite.new*"))
