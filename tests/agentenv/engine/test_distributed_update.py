"""SGLang's distributed weight update, served by ``agentenv serve``: a trainer (rank 0 of a
gloo group here) broadcasts buckets that land in the served model; malformed and
ill-fitting buckets are refused with clear messages and without leaving anyone blocked;
the group's life cycle; and interoperation with a group formed the way SGLang and slime
form theirs (torch's own helper, in another process)."""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import anyio
import anyio.abc
import httpx
import pytest
import torch
from torch.distributed import TCPStore  # type: ignore[attr-defined]

from agentenv import SamplingParams
from agentenv.engine import Engine, EngineServer, WeightUpdateGroup
from agentenv.sglang import SGLangClient, SGLangError
from tests.agentenv.engine.sglang_peer import PAYLOAD

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PEER = Path(__file__).with_name("sglang_peer.py")
NORM = "model.norm.weight"
Served = tuple[Engine, SGLangClient, EngineServer]  # the fixture's engine, its client, server


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


async def until(condition: Callable[[], bool]) -> None:
    """Wait for another task or thread to make ``condition`` true (a bounded wait)."""
    with anyio.fail_after(30):
        while not condition():  # noqa: ASYNC110 - polls the server's state
            await anyio.sleep(0.005)


def receiving(server: EngineServer, name: str) -> Callable[[], bool]:
    """Whether ``server`` is receiving a bucket over its group ``name`` (in a thread)."""
    return lambda: name in server._groups and server._groups[name].lock.locked()


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with (
        Engine("smollm2-135m", context_length=256) as engine,
        EngineServer(engine) as server,
        SGLangClient(server.url, retries=0) as client,
    ):
        yield engine, client, server


async def form(client: SGLangClient, name: str = "g") -> WeightUpdateGroup:
    """Rank 0 of a gloo group that the server joins as rank 1, as a trainer forms it."""
    port = free_port()
    join = functools.partial(
        WeightUpdateGroup.join, "127.0.0.1", port, rank=0, world_size=2, name=name,
        backend="gloo", timeout=30,
    )  # fmt: skip
    formed: list[WeightUpdateGroup] = []

    async def own() -> None:
        formed.append(await anyio.to_thread.run_sync(join))

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(own)
            await client.init_weights_update_group(
                "127.0.0.1", port, 1, 2, group_name=name, backend="gloo"
            )
    return formed[0]


async def send(
    client: SGLangClient, group: WeightUpdateGroup, tensors: dict[str, torch.Tensor], **kw: str
) -> tuple[bool, str]:
    """Post one bucket and broadcast it, as a trainer does: (accepted?, the message)."""
    answer: list[tuple[bool, str]] = []

    async def post() -> None:
        try:
            data = await client.update_weights_from_distributed(
                list(tensors),
                [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
                [list(t.shape) for t in tensors.values()],
                group_name=group.name,
                **kw,
            )
            answer.append((True, data["message"]))
        except SGLangError as e:
            answer.append((False, str(e)))

    with anyio.fail_after(30):  # a refusal must not leave the broadcast waiting
        async with anyio.create_task_group() as tg:
            tg.start_soon(post)
            await anyio.to_thread.run_sync(group.broadcast, list(tensors.values()))
    return answer[0]


async def test_a_bucket_broadcast_by_rank_0_lands_in_the_served_model(
    served: Served,
) -> None:
    engine, client, server = served
    model = engine.model
    c = model.config
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    qkv = model.layers[0].qkv.clone()
    embed = model.embed.clone()
    group = await form(client)
    k = torch.randn(kv, c.hidden_size)
    bucket = {
        NORM: torch.full((c.hidden_size,), 0.5),
        "model.layers.0.self_attn.k_proj.weight": k,  # rows of the fused q/k/v weight
        "lm_head.weight": torch.zeros(c.vocab_size, c.hidden_size, dtype=torch.bfloat16),
    }
    names = list(bucket)
    answer: list[str] = []

    async def post() -> None:
        data = await client.update_weights_from_distributed(
            names, ["float32", "float32", "bfloat16"], [list(t.shape) for t in bucket.values()],
            group_name="g", weight_version="7",
        )  # fmt: skip
        answer.append(data["message"])

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            tg.start_soon(post)
            await until(receiving(server, "g"))  # the server waits for the tensors, in a
            assert await client.health()  # thread, and still answers
            await anyio.to_thread.run_sync(group.broadcast, list(bucket.values()))
    assert answer == ["Succeeded to update parameter online from distributed. "
                      "Weight version updated to 7."]  # fmt: skip
    assert torch.equal(model.norm, torch.full((c.hidden_size,), 0.5))
    assert torch.equal(model.layers[0].qkv[q : q + kv], k)
    assert torch.equal(model.layers[0].qkv[:q], qkv[:q])  # q and v keep their values
    assert torch.equal(model.layers[0].qkv[q + kv :], qkv[q + kv :])
    assert torch.equal(model.embed, embed)  # tied: lm_head.weight is taken and ignored
    assert await client.weight_version() == "7"
    c7 = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
    assert c7.weight_version == "7" and len(c7.output_ids) == 2
    group.destroy()


async def test_bad_buckets_are_refused_clearly_and_leave_the_model_whole(
    served: Served,
) -> None:
    engine, client, _ = served
    hidden = engine.model.config.hidden_size
    norm = engine.model.norm.clone()
    with pytest.raises(SGLangError, match=r"group 'g' is not one of this server's weight up"):
        await client.update_weights_from_distributed(
            [NORM], ["float32"], [[hidden]], group_name="g"
        )
    group = await form(client)
    # Malformed: refused at once, nothing is received (a trainer could not send it anyway).
    good = {"names": [NORM], "dtypes": ["float32"], "shapes": [[hidden]], "group_name": "g"}
    cases = [
        ({"names": [NORM, "x"]}, "names, dtypes and shapes must have one entry per tensor, "
                                 "got 2, 1 and 1"),
        ({"dtypes": ["bfloat17"]}, "dtypes[0]: 'bfloat17' is not a torch dtype"),
        ({"shapes": [[-1]]}, "shapes[0] must be a list of non-negative ints, got [-1]"),
        ({"shapes": 5}, "shapes must be a list, got 5"),
        ({"load_format": "flattened_bucket"}, "load_format 'flattened_bucket' is not supported"),
    ]  # fmt: skip
    async with httpx.AsyncClient(base_url=client.url) as http:
        for change, message in cases:
            r = await http.post("/update_weights_from_distributed", json={**good, **change})
            assert r.status_code == 400 and r.json()["success"] is False
            assert message in r.json()["message"], r.json()
    # Well formed but not this model's: received (so the broadcast completes), then refused.
    ok, message = await send(client, group, {NORM: torch.zeros(hidden + 1)}, weight_version="8")
    assert not ok and f"weight {NORM} has shape ({hidden + 1},), the model's is ({hidden},)" in (
        message
    )
    assert "the bucket was received and dropped, the model is unchanged" in message
    ok, message = await send(client, group, {NORM: torch.zeros(hidden), "model.x": torch.ones(3)})
    assert not ok and "the model has no weight 'model.x'" in message
    assert torch.equal(engine.model.norm, norm) and await client.weight_version() == "default"
    # The group is still in step: the next bucket goes through.
    ok, _ = await send(client, group, {NORM: torch.ones(hidden)}, weight_version="9")
    assert ok and torch.equal(engine.model.norm, torch.ones(hidden))
    group.destroy()


async def test_the_group_life_cycle_and_refused_inits(served: Served) -> None:
    engine, client, server = served
    group = await form(client, "g")

    async def init(name: str = "h", rank: int = 1, backend: str = "gloo", **kw: float) -> None:
        await client.init_weights_update_group(
            "127.0.0.1", free_port(), rank, 2, group_name=name, backend=backend, **kw
        )

    for call, message in [
        (init("g"), "group 'g' already exists on this server; destroy it first"),
        (init(backend="nccl"), "backend nccl needs the engine on a CUDA device, this server "
                               "runs on cpu (use backend gloo)"),
        (init(backend="mpi"), "backend must be 'nccl' or 'gloo', got 'mpi'"),
        (init(rank=0), "rank_offset must be in [1, 1] (rank 0 is the trainer"),
    ]:  # fmt: skip
        with pytest.raises(SGLangError, match="Failed to initialize custom process group: ") as e:
            await call
        assert message in str(e.value)
    # Nobody at the rendezvous: a clear error once the timeout passes; meanwhile the server
    # answers other requests.
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:

            async def lonely() -> None:
                with pytest.raises(SGLangError, match=r"rank 0 \(the trainer\) did not join at "
                                                      r"127\.0\.0\.1:\d+ within 1 s"):  # fmt: skip
                    await init(rendezvous_timeout=1)

            tg.start_soon(lonely)
            await until(lambda: "h" in server._forming)  # waiting at the rendezvous...
            assert await client.health()  # ...the server still answers
    # Destroyed, the name is free again.
    await client.destroy_weights_update_group("g")
    group.destroy()
    with pytest.raises(SGLangError, match="The group to be destroyed does not exist: 'g'"):
        await client.destroy_weights_update_group("g")
    group = await form(client, "g")
    hidden = engine.model.config.hidden_size
    ok, _ = await send(client, group, {NORM: torch.full((hidden,), 2.0)})
    assert ok and torch.equal(engine.model.norm, torch.full((hidden,), 2.0))
    group.destroy()


@contextlib.asynccontextmanager
async def slime_trainer(client: SGLangClient) -> AsyncIterator[anyio.abc.Process]:
    """A slime-style trainer in another process (rank 0 of group ``slime``, built with
    torch's own helper; it broadcasts PAYLOAD on a line on stdin), joined by the server."""
    port = free_port()
    command = [sys.executable, str(PEER), "127.0.0.1", str(port), "0", "2", "slime"]
    async with await anyio.open_process(command) as peer:
        with anyio.fail_after(60):
            await client.init_weights_update_group(
                "127.0.0.1", port, 1, 2, group_name="slime", backend="gloo",
                rendezvous_timeout=30,
            )  # fmt: skip
        yield peer


async def test_the_server_joins_a_group_formed_the_sglang_way(
    served: Served,
) -> None:
    """A slime-style trainer: rank 0 built with torch's own helper, in another process."""
    engine, client, _ = served
    async with slime_trainer(client) as peer:
        assert peer.stdin is not None
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:

                async def post() -> None:
                    await client.update_weights_from_distributed(
                        [NORM], ["float32"], [list(PAYLOAD.shape)], group_name="slime",
                        weight_version="3",
                    )  # fmt: skip

                tg.start_soon(post)
                await peer.stdin.send(b"go\n")
            assert await peer.wait() == 0
    assert torch.equal(engine.model.norm, PAYLOAD)
    assert await client.weight_version() == "3"
    await client.destroy_weights_update_group("slime")


async def test_rank_0_broadcasts_to_a_peer_formed_the_sglang_way() -> None:
    """An SGLang-style server: a receiving rank built with torch's own helper."""
    port = free_port()
    command = [sys.executable, str(PEER), "127.0.0.1", str(port), "1", "2", "sglang"]
    out: list[bytes] = []

    async def peer() -> None:
        out.append((await anyio.run_process(command)).stdout)

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            tg.start_soon(peer)
            join = functools.partial(
                WeightUpdateGroup.join, "127.0.0.1", port, rank=0, world_size=2, name="sglang",
                backend="gloo", timeout=30,
            )  # fmt: skip
            group = await anyio.to_thread.run_sync(join)
            await anyio.to_thread.run_sync(group.broadcast, [PAYLOAD.clone()])
    assert torch.tensor(json.loads(out[0])).equal(PAYLOAD)
    group.destroy()


async def test_the_server_fails_a_receive_when_the_trainer_goes_away(
    served: Served,
) -> None:
    """The trainer (rank 0, another process) dies mid-bucket: the server's request fails
    naming it, the model is unchanged, and the server carries on."""
    engine, client, server = served
    before = engine.model.norm.clone()
    async with slime_trainer(client) as peer:
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:

                async def post() -> None:
                    with pytest.raises(SGLangError, match=r"rank 0 \(the trainer\) went away"):
                        await client.update_weights_from_distributed(
                            [NORM], ["float32"], [list(PAYLOAD.shape)], group_name="slime"
                        )

                tg.start_soon(post)
                await until(receiving(server, "slime"))
                peer.kill()  # before it sends anything
    assert torch.equal(engine.model.norm, before)
    assert await client.health()
    await client.destroy_weights_update_group("slime")


class _BlockingGroup:
    """A process group whose broadcasts wait until ``abort`` (as NCCL's do)."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.aborted = threading.Event()

    def broadcast(self, tensors: list[torch.Tensor], options: object) -> _BlockingGroup:
        return self

    def wait(self) -> None:
        self.waiting.set()
        if not self.aborted.wait(30):
            raise AssertionError("never aborted")
        raise RuntimeError("NCCL communicator was aborted")

    def abort(self) -> None:
        self.aborted.set()


def test_abort_ends_a_broadcast_waiting_in_another_thread() -> None:
    pg = _BlockingGroup()
    group = WeightUpdateGroup("g", "gloo", 1, 2, pg, store=None)

    def abort_once_waiting() -> None:
        if pg.waiting.wait(30):
            group.abort()

    threading.Thread(target=abort_once_waiting, daemon=True).start()
    with pytest.raises(RuntimeError, match="'g' was aborted during the transfer"):
        group.broadcast([torch.empty(4)])
    assert pg.aborted.is_set() and group.destroyed
    group.abort()  # once left, a no-op


def test_a_receiving_rank_aborts_when_rank_0s_process_is_gone() -> None:
    """Rank 0 hosts the store; when its process ends, a receiving rank notices within about
    a second and aborts its broadcast instead of waiting for the transfer timeout."""
    port = free_port()
    host = (
        "import datetime, sys, time, torch.distributed as d; "
        "s = d.TCPStore('127.0.0.1', int(sys.argv[1]), 2, True, "
        "timeout=datetime.timedelta(seconds=30), wait_for_workers=True, multi_tenant=True); "
        "time.sleep(1)"
    )
    rank0 = subprocess.Popen([sys.executable, "-c", host, str(port)])
    try:
        store = TCPStore("127.0.0.1", port, 2, False, timeout=datetime.timedelta(seconds=30))
        pg = _BlockingGroup()
        group = WeightUpdateGroup("g", "gloo", 1, 2, pg, store)
        # Noticed as rank 0's departure, not as the 30 s transfer timeout.
        with pytest.raises(RuntimeError, match=r"'g': rank 0 \(the trainer\) went away"):
            group.broadcast([torch.empty(4)])
        assert pg.aborted.is_set() and group.destroyed
    finally:
        rank0.kill()
        rank0.wait()


def join_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("join ")]


async def test_a_silent_master_fails_the_join_within_its_timeout(served: Served) -> None:
    """A master that accepts the connection and never speaks (torch's store would wait for
    it for ever): the init fails once its timeout passes, the server answers meanwhile,
    and the abandoned join's thread ends (its connection is shut down)."""
    _, client, server = served
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        port = silent.getsockname()[1]
        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:

                async def join() -> None:
                    with pytest.raises(SGLangError, match=r"did not join at 127\.0\.0\.1:\d+ "
                                                          r"within 2 s"):  # fmt: skip
                        await client.init_weights_update_group(
                            "127.0.0.1", port, 1, 2, group_name="s", backend="gloo",
                            rendezvous_timeout=2,
                        )  # fmt: skip

                tg.start_soon(join)
                await until(lambda: "s" in server._forming)
                assert await client.health()
        assert "s" not in server._forming and "s" not in server._groups
        with anyio.fail_after(60):
            while join_threads():  # noqa: ASYNC110 - polls a thread of the server
                await anyio.sleep(0.05)


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_sigterm_stops_the_server_while_a_join_waits(tmp_path: Path) -> None:
    """``agentenv serve`` joining a group whose master never answers still stops on SIGTERM."""
    command = [sys.executable, "-m", "agentenv", "serve", "--model", "smollm2-135m",
               "--port", "0", "--context-length", "256"]  # fmt: skip
    err = tmp_path / "err"
    with socket.socket() as silent, err.open("wb") as stderr:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        silent.setblocking(False)
        port = silent.getsockname()[1]
        async with await anyio.open_process(command, stdout=None, stderr=stderr) as proc:
            url = None
            with anyio.fail_after(240):
                while url is None:
                    assert proc.returncode is None, err.read_text()
                    for line in err.read_text().splitlines():
                        if line.startswith("agentenv serve:") and " at http" in line:
                            url = line.split(" at ")[1].split()[0]
                    await anyio.sleep(0.1)
            async with SGLangClient(url, retries=0) as client, anyio.create_task_group() as tg:

                async def join() -> None:
                    with contextlib.suppress(SGLangError):  # the server goes away meanwhile
                        await client.init_weights_update_group(
                            "127.0.0.1", port, 1, 2, group_name="s", backend="gloo",
                            rendezvous_timeout=3600,
                        )  # fmt: skip

                tg.start_soon(join)
                with anyio.fail_after(60):
                    while True:  # the server's store connected: the join waits on it
                        try:
                            conn, _ = silent.accept()
                            break
                        except BlockingIOError:
                            await anyio.sleep(0.05)
                proc.send_signal(signal.SIGTERM)
                with anyio.fail_after(60):
                    await proc.wait()
                conn.close()
            assert proc.returncode == 0, err.read_text()
