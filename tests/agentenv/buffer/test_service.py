"""The Buffer as a service: every method through BufferServer + BufferClient, auth, errors,
concurrency, malformed requests."""

from __future__ import annotations

import collections
import socket
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import httpx
import pytest
from anyio.abc import SocketAttribute

from agentenv import ClosedResourceError, ConfigError, Sample, SampleError
from agentenv.buffer import (
    Buffer,
    BufferConfig,
    BufferStoreError,
    RewardStdFilter,
    UnknownBatchError,
)
from agentenv.buffer._service import BufferClient, BufferServer, BufferServiceError
from tests.agentenv.buffer._groups import encode_samples, group

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOKEN = "s3cret-token"


@pytest.fixture(params=["memory", "durable"])
async def served(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[Buffer, BufferServer, BufferClient]]:
    path = tmp_path / "buf" if request.param == "durable" else None
    config = BufferConfig(n_samples_per_prompt=2, rollout_batch_size=2, capacity=64)
    async with (
        Buffer(config, path=path) as buffer,
        BufferServer(buffer, token=TOKEN) as server,
        BufferClient(server.url, token=TOKEN) as client,
    ):
        yield buffer, server, client


async def test_every_method_round_trips(
    served: tuple[Buffer, BufferServer, BufferClient],
) -> None:
    buffer, _, client = served
    a, b, c = group("a", [1, 0]), group("b", [0, 1], failed=[1]), group("c", [1, 1])
    for g in (a, b, c):
        await client.put_group(g)
    await client.put_group(a)  # a retried put is a counted no-op, as in-process
    stats = await client.statistics()
    assert stats == (await buffer.statistics())
    assert (stats.groups_put, stats.duplicate_groups, stats.ready) == (3, 1, 3)
    assert stats.pass_rate == 1.0 and stats.failed_samples_dropped == 1

    assert await client.prompts_to_start(5) == (await buffer.prompts_to_start(5)) == 2
    assert await client.prompts_to_start() == 0
    await client.reserve(3)
    assert (await buffer.statistics()).in_flight == 3
    await client.release(3)
    assert (await buffer.statistics()).in_flight == 0

    await client.set_policy_version(4)
    batch = await client.get_batch()
    assert batch.policy_version == 4
    assert [g.group_id for g in batch.groups] == ["a", "b"]
    assert batch.groups[0].samples == tuple(a)  # bit-exact, ids and log-probs included
    assert batch.groups[1].samples == (b[0],)  # the failed sample is not handed out
    assert [g.seq for g in batch.groups] == [1, 2] and batch.groups[0].task_id == "a"

    await client.release_batch(batch)
    again = await client.get_batch(2, policy_version=5)
    assert [g.group_id for g in again.groups] == ["a", "b"] and again.id != batch.id
    await client.ack(again, step=5)
    assert await client.position() == 5 == (await buffer.position())
    last = await client.get_batch(1)
    await client.ack(last.id, step=6)
    assert await client.recycled() == []
    assert (await client.statistics()).consumed == 3

    if buffer.path is None:
        with pytest.raises(ConfigError, match="durable"):
            await client.rewind(5)
    else:
        assert await client.rewind(5) == 1
        assert [g.group_id for g in (await client.get_batch(1)).groups] == ["c"]


async def test_staleness_and_recycling_through_the_service() -> None:
    cfg = BufferConfig(n_samples_per_prompt=2, max_staleness=1, on_stale="recycle")
    async with (
        Buffer(cfg) as buffer,
        BufferServer(buffer, token=TOKEN) as server,
        BufferClient(server.url, token=TOKEN) as client,
    ):
        await client.put_group(group("old@1", [1, 0], version=0))
        await client.put_group(group("new@1", [1, 0], version=3))
        batch = await client.get_batch(1, policy_version=3)
        assert batch.groups[0].group_id == "new@1" and batch.groups[0].version == 3
        assert await client.recycled() == ["old"]
        assert await client.recycled() == []


async def test_multi_agent_groups_and_filters() -> None:
    cfg = BufferConfig(n_samples_per_prompt=2, filters=[RewardStdFilter()])
    async with (
        Buffer(cfg) as buffer,
        BufferServer(buffer, token=TOKEN) as server,
        BufferClient(server.url, token=TOKEN) as client,
    ):
        await client.put_group(group("g", [1, 0], role="red") + group("g", [0, 1], role="blue"))
        await client.put_group(group("flat", [1, 1]))
        batch = await client.get_batch(2)
        assert sorted(g.role or "" for g in batch.groups) == ["blue", "red"]
        assert (await client.statistics()).dropped == collections.Counter(zero_reward_std=1)


async def test_same_exceptions_are_raised(tmp_path: Path) -> None:
    cfg = BufferConfig(n_samples_per_prompt=2, capacity=4)
    async with Buffer(cfg) as buffer, BufferServer(buffer, token=TOKEN) as server:
        async with BufferClient(server.url, token=TOKEN) as client:
            with pytest.raises(SampleError, match="no group_id"):
                await client.put_group([Sample(prompt_ids=[1], completion_ids=[2], reward=1.0)])
            with pytest.raises(SampleError, match="3 episodes but n_samples_per_prompt is 2"):
                await client.put_group(group("big", [1, 0, 1]))
            with pytest.raises(SampleError, match="at least one sample"):
                await client.put_group([])
            with pytest.raises(SampleError, match="Sample objects"):
                await client.put_group([{"prompt_ids": [1]}])  # type: ignore[list-item]
            with pytest.raises(ConfigError, match="can never fill a capacity of 4"):
                await client.get_batch(5)
            with pytest.raises(UnknownBatchError, match="unknown batch 'nope'") as info:
                await client.ack("nope")
            assert isinstance(info.value, KeyError)
            with pytest.raises(UnknownBatchError):
                await client.release_batch("nope")
            with pytest.raises(TimeoutError, match=r"within 0.05 s"):
                await client.get_batch(1, timeout=0.05)
            assert (await buffer.statistics()).groups_put == 0
            await buffer.aclose()
            with pytest.raises(ClosedResourceError, match="closed"):
                await client.put_group(group("late", [1, 0]))
        with pytest.raises(ClosedResourceError, match="BufferClient is closed"):
            await client.statistics()

    durable = Buffer(BufferConfig(n_samples_per_prompt=4, capacity=10_000), path=tmp_path / "d")
    durable._store._db.execute("PRAGMA max_page_count = 8")  # type: ignore[attr-defined]
    async with (
        durable,
        BufferServer(durable, token=TOKEN) as server,
        BufferClient(server.url, token=TOKEN) as client,
    ):

        async def fill() -> None:
            for i in range(1000):
                await client.put_group(group(f"g{i}", [1, 0, 1, 0], tokens=2000))

        with pytest.raises(BufferStoreError, match="full"):
            await fill()


async def test_wrong_or_missing_token_is_refused_and_nothing_stored() -> None:
    async with (
        Buffer(BufferConfig(n_samples_per_prompt=2)) as buffer,
        BufferServer(buffer, token=TOKEN) as server,
    ):
        body = encode_samples(group("a", [1, 0]))
        async with httpx.AsyncClient(base_url=server.url, trust_env=False) as raw:
            for headers in (
                {},
                {"authorization": "Bearer wrong"},
                {"authorization": f"Basic {TOKEN}"},
                {"authorization": f"Bearer {TOKEN}x"},
                {"authorization": "Bearer"},
            ):
                r = await raw.post("/v1/put_group", content=body, headers=headers)
                assert r.status_code == 401, headers
                assert r.json()["error"]["type"] == "AuthenticationError"
                assert r.headers["www-authenticate"].startswith("Bearer")
            r = await raw.get("/v1/statistics")
            assert r.status_code == 401
            # A large body with a bad token is refused unread (and the answer still arrives).
            big = encode_samples(group("big", [1, 0], tokens=400_000))
            r = await raw.post("/v1/put_group", content=big, headers={"authorization": "x"})
            assert r.status_code == 401
            r = await raw.get("/no/such/path")
            assert r.status_code == 401  # nothing is revealed before authentication
        async with BufferClient(server.url, token="not-the-token") as client:
            with pytest.raises(BufferServiceError, match="401") as info:
                await client.put_group(group("b", [1, 0]))
            assert info.value.status == 401
        assert (await buffer.statistics()).groups_put == 0
        assert (await buffer.statistics()).ready == 0


def test_tokens_and_urls_are_checked() -> None:
    buffer = Buffer()
    for bad in ("", " padded ", "two words", "line\nbreak"):
        with pytest.raises(ConfigError, match="token"):
            BufferServer(buffer, token=bad)
        with pytest.raises(ConfigError, match="token"):
            BufferClient("http://127.0.0.1:1", token=bad)
    with pytest.raises(ConfigError, match="http://"):
        BufferClient("127.0.0.1:8000", token=TOKEN)


async def test_unreachable_server_names_the_url() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, never listening: connections are refused
        async with BufferClient(f"http://127.0.0.1:{port}", token=TOKEN) as client:
            with pytest.raises(BufferServiceError, match=f"127.0.0.1:{port}.*buffer serve"):
                await client.statistics()


async def test_concurrent_puts_share_requests_and_keep_their_own_errors(
    served: tuple[Buffer, BufferServer, BufferClient],
) -> None:
    _, _, client = served
    requests: list[int] = []
    send = client._put_groups

    async def counting(blobs: list[bytes]) -> list[BaseException | None]:
        requests.append(len(blobs))
        return await send(blobs)

    client._put_groups = counting  # type: ignore[method-assign]
    await client.put_group(group("dup", [1, 0]))
    outcome: dict[str, str] = {}

    async def put(name: str, samples: list[Sample]) -> None:
        try:
            await client.put_group(samples)
            outcome[name] = "ok"
        except SampleError as e:
            outcome[name] = f"SampleError: {e}"

    async with anyio.create_task_group() as tg:
        for i in range(30):
            tg.start_soon(put, f"g{i}", group(f"g{i}", [1, 0]))
        tg.start_soon(put, "too-big", group("too-big", [1, 0, 1]))  # 3 episodes, n is 2
        tg.start_soon(put, "dup", group("dup", [1, 0]))  # a retry: a no-op, no error
    assert outcome.pop("too-big").startswith("SampleError: group 'too-big' has 3 episodes")
    assert outcome == {**{f"g{i}": "ok" for i in range(30)}, "dup": "ok"}
    assert sum(requests) == 33 and len(requests) < 10  # many groups per request
    stats = await client.statistics()
    assert stats.groups_put == 31 and stats.duplicate_groups == 1 and stats.ready == 31


async def test_a_cancelled_put_that_was_not_sent_is_withdrawn(
    served: tuple[Buffer, BufferServer, BufferClient],
) -> None:
    from agentenv.buffer._service import _PUTS_IN_FLIGHT

    _, _, client = served
    release = anyio.Event()
    send = client._put_groups

    async def slow(blobs: list[bytes]) -> list[BaseException | None]:
        await release.wait()
        return await send(blobs)

    client._put_groups = slow  # type: ignore[method-assign]
    sent = [f"sent{i}" for i in range(_PUTS_IN_FLIGHT)]
    async with anyio.create_task_group() as tg:
        for name in sent:  # every request slot in flight, held
            tg.start_soon(client.put_group, group(name, [1, 0]))
        await anyio.wait_all_tasks_blocked()
        with anyio.move_on_after(0.05):
            await client.put_group(group("withdrawn", [1, 0]))  # queued behind them
        release.set()
    batch = await client.get_batch(_PUTS_IN_FLIGHT, timeout=5)
    assert sorted(g.group_id for g in batch.groups) == sent
    assert (await client.statistics()).groups_put == _PUTS_IN_FLIGHT


async def test_concurrent_producers_and_a_consumer() -> None:
    n_producers, per_producer, batch_groups = 8, 12, 4
    cfg = BufferConfig(n_samples_per_prompt=4, capacity=8)  # small: producers must wait
    async with (
        Buffer(cfg) as buffer,
        BufferServer(buffer, token=TOKEN) as server,
        BufferClient(server.url, token=TOKEN) as client,
    ):
        seen: list[str] = []

        async def produce(p: int) -> None:
            for i in range(per_producer):
                await client.put_group(group(f"p{p}-{i}", [1, 0, 0, 1], tokens=50))

        async def consume() -> None:
            for step in range(n_producers * per_producer // batch_groups):
                batch = await client.get_batch(batch_groups, timeout=30)
                seen.extend(g.group_id for g in batch.groups)
                await client.ack(batch, step=step)

        async with anyio.create_task_group() as tg:
            for p in range(n_producers):
                tg.start_soon(produce, p)
            tg.start_soon(consume)
        assert sorted(seen) == sorted(
            f"p{p}-{i}" for p in range(n_producers) for i in range(per_producer)
        )
        for p in range(n_producers):  # each producer's groups arrive in its order
            mine = [int(g.split("-")[1]) for g in seen if g.startswith(f"p{p}-")]
            assert mine == sorted(mine)
        stats = await client.statistics()
        assert stats.consumed == n_producers * per_producer and stats.ready == 0


async def test_large_groups_and_the_body_limit() -> None:
    cfg = BufferConfig(n_samples_per_prompt=32)
    async with (
        Buffer(cfg) as buffer,
        BufferServer(buffer, token=TOKEN, max_body_bytes=8 * 1024 * 1024) as server,
        BufferClient(server.url, token=TOKEN) as client,
    ):
        big = group("big", [float(i % 2) for i in range(32)], tokens=16_000)  # ~7 MB
        await client.put_group(big)
        batch = await client.get_batch(1)
        assert batch.groups[0].samples == tuple(big)
        too_big = group("huge", [float(i % 2) for i in range(32)], tokens=24_000)  # ~10 MB
        with pytest.raises(BufferServiceError, match="413") as info:
            await client.put_group(too_big)
        assert "8388608" in str(info.value)
        await client.put_group(group("after", [1, 0]))  # the server lives on
        assert (await buffer.statistics()).groups_put == 2


async def test_malformed_requests_are_400_and_the_server_survives() -> None:
    async with (
        Buffer(BufferConfig(n_samples_per_prompt=2)) as buffer,
        BufferServer(buffer, token=TOKEN) as server,
    ):
        auth = {"authorization": f"Bearer {TOKEN}"}
        good = encode_samples(group("a", [1, 0]))
        async with httpx.AsyncClient(base_url=server.url, headers=auth, trust_env=False) as raw:
            cases: list[tuple[str, str, bytes, int, str]] = [
                ("POST", "/v1/put_group", b"\xff" * 50, 400, "SampleError"),
                ("POST", "/v1/put_group", good[:-3], 400, "SampleError"),
                ("POST", "/v1/put_group", good + b"\x00", 400, "SampleError"),
                ("POST", "/v1/get_batch", b"{not json", 400, "BadRequest"),
                ("POST", "/v1/get_batch", b'{"groups": "2"}', 400, "BadRequest"),
                ("POST", "/v1/get_batch", b'{"surprise": 1}', 400, "BadRequest"),
                ("POST", "/v1/get_batch", b"[1, 2]", 400, "BadRequest"),
                ("POST", "/v1/ack", b'{"step": 1}', 400, "BadRequest"),
                ("GET", "/v1/prompts_to_start?groups=-1", b"", 400, "BadRequest"),
                ("GET", "/v1/nope", b"", 404, "NotFound"),
                ("GET", "/v1/put_group", b"", 405, "MethodNotAllowed"),
            ]
            for method, path, body, status, kind in cases:
                r = await raw.request(method, path, content=body)
                assert (r.status_code, r.json()["error"]["type"]) == (status, kind), (path, body)
                assert r.json()["error"]["message"]
            # A corrupted ids section: the mask's bytes must be 0 or 1.
            bad_mask = bytearray(good)
            bad_mask[-1 - 6 * 8] = 7
            r = await raw.post("/v1/put_group", content=bytes(bad_mask))
            assert r.status_code == 400 and "loss_mask" in r.json()["error"]["message"]

            async def chunks() -> AsyncIterator[bytes]:
                yield good[:10]
                yield good[10:]

            r = await raw.post("/v1/put_group", content=chunks())  # chunked upload
            assert r.status_code == 411
            assert "Content-Length" in r.json()["error"]["message"]
        async with BufferClient(server.url, token=TOKEN) as client:
            await client.put_group(group("a", [1, 0]))
            assert (await client.get_batch(1)).groups[0].group_id == "a"
        assert (await buffer.statistics()).groups_put == 1


async def test_server_binds_loopback_by_default() -> None:
    async with Buffer() as buffer, BufferServer(buffer, token=TOKEN) as server:
        assert server.url == f"http://127.0.0.1:{server.port}"
        assert server._http._listener is not None
        assert server._http._listener.extra(SocketAttribute.local_address)[0] == "127.0.0.1"


async def test_a_waiting_get_batch_is_not_lost_when_its_client_leaves() -> None:
    async with (
        Buffer(BufferConfig(n_samples_per_prompt=2)) as buffer,
        BufferServer(buffer, token=TOKEN) as server,
    ):
        async with BufferClient(server.url, token=TOKEN) as leaver:
            with anyio.move_on_after(0.2):
                await leaver.get_batch(1)  # waits: nothing ready; then the client leaves
        with anyio.fail_after(60):  # until the server notices the closed connection
            while server._http._polls:  # noqa: ASYNC110 - polls a private set
                await anyio.sleep(0.005)
        async with BufferClient(server.url, token=TOKEN) as client:
            await client.put_group(group("a", [1, 0]))
            batch = await client.get_batch(1, timeout=5)
            assert batch.groups[0].group_id == "a"
            assert (await buffer.statistics()).handed == 1  # only this batch is out


async def test_shutdown_answers_waiting_requests() -> None:
    async with Buffer(BufferConfig(n_samples_per_prompt=2)) as buffer:
        server = BufferServer(buffer, token=TOKEN)
        async with server, BufferClient(server.url, token=TOKEN) as client:
            errors: list[BaseException] = []

            async def wait_for_batch() -> None:
                try:
                    await client.get_batch(1)
                except ClosedResourceError as e:
                    errors.append(e)

            async with anyio.create_task_group() as tg:
                tg.start_soon(wait_for_batch)
                with anyio.fail_after(60):  # until the request is waiting in the server
                    while not server._http._polls:  # noqa: ASYNC110 - polls a private set
                        await anyio.sleep(0.005)
                await server.aclose()
            assert len(errors) == 1 and "shutting down" in str(errors[0])
            assert (await buffer.statistics()).handed == 0
