"""Producers waiting on a full served Buffer: a put whose client left is withdrawn (its
connection closes, its group never lands), and waiting puts never take the connections
a consumer needs."""

from __future__ import annotations

import socket
from collections.abc import Callable
from pathlib import Path

import anyio
import httpx
import pytest

from agentenv.buffer import Buffer, BufferClient, BufferConfig
from agentenv.buffer._service import BufferServer, decode_batch
from tests.agentenv.buffer._groups import encode_samples, group

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}


def _put_request(gid: str) -> bytes:
    body = encode_samples(group(gid, [1.0]))
    head = (
        f"POST /v1/put_group HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {TOKEN}\r\n"
        f"content-type: application/x-agentenv-samples\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _open_puts(port: int, gids: list[str]) -> list[socket.socket]:
    socks = []
    for gid in gids:
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        s.sendall(_put_request(gid))
        socks.append(s)
    return socks


async def _until(condition: Callable[[], bool]) -> None:
    # The server's own counters, read from its event loop: a condition, not a fixed sleep.
    with anyio.fail_after(60):
        while not condition():  # noqa: ASYNC110 - no event to wait on from outside
            await anyio.sleep(0.01)


async def test_a_waiting_put_whose_client_left_is_withdrawn() -> None:
    cfg = BufferConfig(n_samples_per_prompt=1, capacity=1)
    async with Buffer(cfg) as buffer, BufferServer(buffer, token=TOKEN) as server:
        await buffer.put_group(group("first", [1.0]))  # full now
        socks = _open_puts(server.port, [f"orphan{i}" for i in range(20)])
        await _until(lambda: server._put_requests == 20)
        for s in socks:
            s.close()  # the producers give up
        # Their handlers end and their connections close: no CLOSE-WAIT sockets pile up.
        await _until(lambda: server._put_requests == 0 and server._http.connections == 0)
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, trust_env=False) as c:
            r = await c.post("/v1/get_batch", json={"groups": 1, "timeout": 5})
            assert r.status_code == 200, r.text
            await anyio.wait_all_tasks_blocked()  # an orphan still waiting would land now
            stats = (await c.get("/v1/statistics")).json()
        assert (stats["groups_put"], stats["ready"]) == (1, 0), stats


async def test_puts_waiting_on_a_full_buffer_leave_connections_to_consumers() -> None:
    cfg = BufferConfig(n_samples_per_prompt=1, capacity=1)
    async with (
        Buffer(cfg) as buffer,
        BufferServer(buffer, token=TOKEN, max_connections=8) as server,
    ):
        assert server.max_put_requests == 4
        await buffer.put_group(group("first", [1.0]))
        socks = _open_puts(server.port, [f"p{i}" for i in range(8)])  # live producers
        try:
            await _until(lambda: server._put_requests == 4)
            async with httpx.AsyncClient(base_url=server.url, headers=AUTH, trust_env=False) as c:
                assert (await c.get("/v1/statistics")).status_code == 200
                r = await c.post("/v1/get_batch", json={"groups": 1, "timeout": 5})
                assert r.status_code == 200, r.text
                batch = decode_batch(r.content)
                r = await c.post("/v1/ack", json={"batch": batch.id, "step": 1})
                assert r.status_code == 204, r.text
        finally:
            for s in socks:
                s.close()


async def test_the_client_retries_a_put_the_server_was_too_busy_for() -> None:
    cfg = BufferConfig(n_samples_per_prompt=1, capacity=1, rollout_batch_size=1)
    async with (
        Buffer(cfg) as buffer,
        BufferServer(buffer, token=TOKEN, max_put_requests=1) as server,
        BufferClient(server.url, token=TOKEN) as a,
        BufferClient(server.url, token=TOKEN) as b,
    ):
        await buffer.put_group(group("first", [1.0]))
        async with anyio.create_task_group() as tg:
            tg.start_soon(a.put_group, group("a", [1.0]))
            await _until(lambda: server._put_requests == 1)
            tg.start_soon(b.put_group, group("b", [1.0]))  # 503 PutsBusy: retried
            got = []
            for _ in range(3):
                batch = await buffer.get_batch(1, timeout=10)
                got.append(batch.groups[0].group_id)
                await buffer.ack(batch)
        assert sorted(got) == ["a", "b", "first"]


async def test_a_put_cancelled_once_admitted_completes_as_a_whole(tmp_path: Path) -> None:
    path = tmp_path / "buf"
    scope = anyio.CancelScope()

    async def put_b() -> None:
        with scope:
            await buffer.put_group(group("b", [1.0]))

    async with Buffer(BufferConfig(n_samples_per_prompt=1), path=path) as buffer:
        # The lock holds the store: the commit waits for it.
        async with anyio.create_task_group() as tg, buffer._lock:
            tg.start_soon(buffer.put_group, group("a", [1.0]))  # commits: first writer
            tg.start_soon(put_b)  # joins the commit under way
            await anyio.wait_all_tasks_blocked()
            assert buffer._filling == 2
            scope.cancel()  # its samples are being written: it finishes
        assert (await buffer.statistics()).ready == 2
    async with Buffer(BufferConfig(n_samples_per_prompt=1), path=path) as buffer:
        assert (await buffer.statistics()).ready == 2  # what is ready is what is stored
