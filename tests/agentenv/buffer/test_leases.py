"""Leases: a batch handed out comes back when its consumer stops renewing it; a late ack is
accepted only while nobody else has its groups, so no group is trained by two steps.

The Buffer reads its leases' time from ``anyio.current_time``; here that is a clock that only
the test moves (:class:`Clock`), so a lease runs out when the test says and never because the
machine was busy.
"""

from __future__ import annotations

import collections
import functools
import os
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest
from anyio.streams.buffered import BufferedByteReceiveStream

from agentenv.buffer import Buffer, BufferConfig, LeaseExpiredError, UnknownBatchError
from agentenv.buffer._service import BufferClient, BufferServer
from tests.agentenv.buffer._groups import group

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

TOKEN = "s3cret-token"
ROOT = Path(__file__).resolve().parents[3]
LEASE = 0.2


class Clock:
    """The Buffer's clock, standing still until :meth:`advance` moves it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(autouse=True)
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(anyio, "current_time", c)
    return c


def _seqs(batch: object) -> list[int]:
    return [g.seq for g in batch.groups]  # type: ignore[attr-defined]


async def _filled(path: Path | None = None, n: int = 4) -> Buffer:
    b = Buffer(BufferConfig(n_samples_per_prompt=2), path=path)
    for i in range(n):
        await b.put_group(group(f"g{i}", [1, 0]))
    return b


async def test_an_expired_lease_returns_the_groups_to_the_front(clock: Clock) -> None:
    async with await _filled() as b:
        first = await b.get_batch(2, lease_s=LEASE)
        assert first.lease_s == LEASE and (await b.statistics()).handed == 2
        # A waiting consumer is woken by the expiry (no put happens meanwhile).
        async with anyio.create_task_group() as tg:
            got: list[Any] = []

            async def wait() -> None:
                got.append(await b.get_batch(4))

            tg.start_soon(wait)
            await anyio.wait_all_tasks_blocked()
            assert not got  # two groups are ready, and two are lent
            clock.advance(2 * LEASE)
        second = got[0]
        assert _seqs(second) == [1, 2, 3, 4]  # the expired groups first, in order
        st = await b.statistics()
        assert (st.leases_expired, st.handed, st.ready) == (1, 4, 0)
        # Its groups are someone else's now: the late ack is refused, and says why.
        with pytest.raises(LeaseExpiredError, match=r"lease of batch .* ran out") as info:
            await b.ack(first, step=1)
        assert isinstance(info.value, UnknownBatchError)
        await b.ack(second, step=1)
        assert (await b.statistics()).consumed == 4  # each group once


async def test_a_late_ack_is_accepted_while_nobody_took_the_groups(clock: Clock) -> None:
    async with await _filled() as b:
        batch = await b.get_batch(2, lease_s=LEASE)
        clock.advance(2 * LEASE)
        assert (await b.statistics()).ready == 4  # back in the queue
        await b.ack(batch, step=1)  # ... but nobody took them: the ack stands
        st = await b.statistics()
        assert (st.consumed, st.ready, st.handed) == (2, 2, 0)
        assert _seqs(await b.get_batch(2)) == [3, 4]


async def test_renewal_keeps_a_batch_and_reclaims_an_expired_one(clock: Clock) -> None:
    async with await _filled() as b:
        batch = await b.get_batch(2, lease_s=LEASE)
        for _ in range(4):  # twice the lease, renewed every half of it
            clock.advance(LEASE / 2)
            await b.renew(batch)
        assert (await b.statistics()).leases_expired == 0
        clock.advance(2 * LEASE)
        await b.renew(batch)  # expired, nobody took the groups: it is this consumer's again
        st = await b.statistics()
        assert (st.handed, st.ready, st.leases_expired) == (2, 2, 1)
        other = await b.get_batch(2, lease_s=LEASE)
        assert _seqs(other) == [3, 4]
        clock.advance(2 * LEASE)
        await b.get_batch(2)  # takes `batch`'s groups (expired first, at the front)
        with pytest.raises(LeaseExpiredError):
            await b.renew(batch)
        await b.release_batch(other)  # expired already: a no-op, its groups went back
        with pytest.raises(UnknownBatchError):
            await b.release_batch(other)


async def test_an_ack_in_progress_is_not_expired_under_it(tmp_path: Path, clock: Clock) -> None:
    async with await _filled(tmp_path / "buf") as b:
        batch = await b.get_batch(2, lease_s=LEASE)
        committing, committed, commit = threading.Event(), threading.Event(), b._store.commit

        def slow_commit(*args: Any) -> list[bool]:  # the disk is slow: past the lease
            committing.set()
            committed.wait()
            return commit(*args)

        b._store.commit = slow_commit  # type: ignore[method-assign]
        async with anyio.create_task_group() as tg:
            tg.start_soon(functools.partial(b.ack, batch, step=1))
            await anyio.to_thread.run_sync(committing.wait)
            clock.advance(3 * LEASE)  # the lease runs out while the ack commits ...
            with pytest.raises(TimeoutError):
                await b.get_batch(3, timeout=0.05)
            assert (await b.statistics()).ready == 2  # ... and its groups stay out
            committed.set()
        st = await b.statistics()
        assert (st.consumed, st.handed, st.ready, st.leases_expired) == (2, 0, 2, 0)


async def test_rewind_returns_handed_out_batches(tmp_path: Path) -> None:
    async with await _filled(tmp_path / "buf") as b:
        consumed = await b.get_batch(1)
        await b.ack(consumed, step=1)
        await b.ack(await b.get_batch(1), step=2)
        dead = await b.get_batch(1)  # the trainer that took it died
        assert await b.rewind(1) == 2  # step 2's group and the dead trainer's
        assert _seqs(await b.get_batch(3)) == [2, 3, 4]
        with pytest.raises(UnknownBatchError):
            await b.ack(dead, step=2)


# -- through the service, with a consumer process that dies ------------------------------------
CONSUMER = """
import sys, anyio
from agentenv.buffer._service import BufferClient

async def main():
    async with BufferClient(sys.argv[1], token=sys.argv[2]) as client:
        batch = await client.get_batch(2)
        print(batch.id, *[g.seq for g in batch.groups], flush=True)
        await anyio.sleep_forever()  # a long training step, renewing in the background

anyio.run(main)
"""


class Renewals:
    """Counts the renewals the Buffer received, batch by batch (the clients renew on their
    own time, every third of the lease); :meth:`tick` moves the clock half a lease once each
    named batch was renewed again, so those batches never run out."""

    def __init__(self, buffer: Buffer, clock: Clock) -> None:
        self.seen: collections.Counter[str] = collections.Counter()
        self.clock, self.renew = clock, buffer.renew
        buffer.renew = self._renew  # type: ignore[method-assign]

    async def _renew(self, batch: Any) -> None:
        await self.renew(batch)
        self.seen[batch if isinstance(batch, str) else batch.id] += 1

    async def tick(self, lease: float, *batch_ids: str) -> None:
        before = {b: self.seen[b] for b in batch_ids}
        while any(self.seen[b] == before[b] for b in batch_ids):  # noqa: ASYNC110 - counted
            await anyio.sleep(0.01)  # (the test's timeout bounds the wait)
        self.clock.advance(lease / 2)


async def test_the_batch_of_a_killed_consumer_goes_to_the_next(clock: Clock) -> None:
    lease = 0.3
    async with (
        await _filled() as buffer,
        BufferServer(buffer, token=TOKEN, lease_s=lease) as server,
        BufferClient(server.url, token=TOKEN) as survivor,
    ):
        renewals = Renewals(buffer, clock)
        async with await anyio.open_process(
            [sys.executable, "-c", CONSUMER, server.url, TOKEN],
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
        ) as consumer:
            assert consumer.stdout is not None
            line = await BufferedByteReceiveStream(consumer.stdout).receive_until(b"\n", 4096)
            batch_id, *seqs = line.decode().split()
            assert seqs == ["1", "2"]
            # Alive, it renews: its groups stay its own for several leases.
            other = await survivor.get_batch(2)
            assert _seqs(other) == [3, 4]
            for _ in range(6):
                await renewals.tick(lease, batch_id, other.id)
            with pytest.raises(TimeoutError):
                await survivor.get_batch(2, timeout=0.05)
            assert (await buffer.statistics()).leases_expired == 0
            consumer.kill()  # SIGKILL, by its pid: no goodbye, no more renewals
            await consumer.wait()
        for _ in range(3):  # a lease and a half without its renewals
            await renewals.tick(lease, other.id)
        again = await survivor.get_batch(2)
        assert _seqs(again) == [1, 2]
        # The dead consumer's ack or renewal, were they to come: refused, over the wire too.
        with pytest.raises(LeaseExpiredError, match="handed to another consumer"):
            await survivor.ack(batch_id, step=1)
        with pytest.raises(LeaseExpiredError):
            await survivor.renew(batch_id)
        await survivor.renew(again)
        # The survivor holds two batches through a pause longer than the lease.
        for _ in range(4):
            await renewals.tick(lease, other.id, again.id)
        await survivor.ack(other, step=1)
        await survivor.ack(again, step=2)
        st = await buffer.statistics()
        assert (st.consumed, st.handed, st.leases_expired) == (4, 0, 1)


async def test_get_batch_needs_the_client_entered() -> None:
    from agentenv import ConfigError

    async with await _filled() as buffer, BufferServer(buffer, token=TOKEN) as server:
        client = BufferClient(server.url, token=TOKEN)
        with pytest.raises(ConfigError, match="async with BufferClient"):
            await client.get_batch(1)
        await client.aclose()
        assert (await buffer.statistics()).handed == 0


async def test_served_capacity_bounds_200_concurrent_puts(tmp_path: Path) -> None:
    cfg = BufferConfig(n_samples_per_prompt=2, capacity=8)
    async with (
        Buffer(cfg, path=tmp_path / "buf") as buffer,
        BufferServer(buffer, token=TOKEN) as server,
        BufferClient(server.url, token=TOKEN) as client,
    ):
        left = []
        async with anyio.create_task_group() as tg:
            for i in range(200):
                tg.start_soon(client.put_group, group(f"g{i}", [1, 0]))
            with anyio.fail_after(60):
                for step in range(25):
                    batch = await buffer.get_batch(8)
                    left.append((await buffer.statistics()).ready)
                    await buffer.ack(batch, step=step)
        assert left == [0] * 25
        assert (await buffer.statistics()).consumed == 200
