"""The Buffer service against hostile and sloppy clients: every malformed request is a 4xx
naming its problem, a request's memory is a small multiple of its size, leases bring back
the batches of a consumer that died, and capacity holds under concurrent puts."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import anyio
import httpx
import pytest

from agentenv import Sample
from agentenv.buffer import Buffer, BufferConfig
from agentenv.buffer._codec import join_frames
from agentenv.buffer._service import BufferClient, BufferServer
from tests.agentenv.buffer._groups import encode_samples, group

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

TOKEN = "s3cret-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[3]
MB = 1024 * 1024


@pytest.fixture
async def raw() -> AsyncIterator[tuple[Buffer, httpx.AsyncClient]]:
    async with (
        Buffer(BufferConfig(n_samples_per_prompt=2, rollout_batch_size=1)) as buffer,
        BufferServer(buffer, token=TOKEN) as server,
        httpx.AsyncClient(base_url=server.url, headers=AUTH, trust_env=False) as client,
    ):
        yield buffer, client


BAD_JSON: list[tuple[str, str, bytes, str]] = [
    # (method, path, body, a word the message must contain)
    ("POST", "/v1/get_batch", b'{"groups": 1, "timeout": NaN}', "timeout"),
    ("POST", "/v1/get_batch", b'{"groups": 1, "timeout": Infinity}', "timeout"),
    ("POST", "/v1/get_batch", b'{"groups": 1, "timeout": -1}', "timeout"),
    ("POST", "/v1/get_batch", b'{"groups": 1, "timeout": "5"}', "timeout"),
    ("POST", "/v1/get_batch", b'{"groups": 0}', "groups"),
    ("POST", "/v1/get_batch", b'{"groups": 1.5}', "groups"),
    ("POST", "/v1/get_batch", b'{"groups": true}', "groups"),
    ("POST", "/v1/get_batch", b'{"policy_version": 100000000000000000000000}', "policy_version"),
    ("POST", "/v1/get_batch", b"null", "body"),
    ("POST", "/v1/get_batch", b"[" * 200_000 + b"]" * 200_000, "body"),
    ("POST", "/v1/ack", b'{"batch": "x", "step": 100000000000000000000000}', "step"),
    ("POST", "/v1/ack", b'{"batch": 5}', "batch"),
    ("POST", "/v1/ack", b'{"batch": ""}', "batch"),
    ("POST", "/v1/ack", b"{}", "batch"),
    ("POST", "/v1/release_batch", b'{"batch": null}', "batch"),
    ("POST", "/v1/renew", b'{"batches": "x"}', "batches"),
    ("POST", "/v1/renew", b"{}", "batches"),
    ("POST", "/v1/reserve", b'{"prompts": -5}', "prompts"),
    ("POST", "/v1/release", b'{"prompts": -5}', "prompts"),
    ("POST", "/v1/release", b'{"prompts": 1e3}', "prompts"),
    ("POST", "/v1/set_policy_version", b'{"version": "3"}', "version"),
    ("POST", "/v1/set_policy_version", b"{}", "version"),
    ("POST", "/v1/rewind", b'{"step": 100000000000000000000000}', "step"),
    ("GET", "/v1/prompts_to_start?groups=%C2%B2", b"", "groups"),
    ("GET", "/v1/prompts_to_start?groups=1e3", b"", "groups"),
    ("GET", "/v1/prompts_to_start?other=1", b"", "other"),
]


@pytest.mark.parametrize(("method", "path", "body", "word"), BAD_JSON)
async def test_malformed_json_requests_are_400_naming_the_field(
    raw: tuple[Buffer, httpx.AsyncClient], method: str, path: str, body: bytes, word: str
) -> None:
    buffer, client = raw
    r = await client.request(method, path, content=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "BadRequest" and word in error["message"], error
    assert (await buffer.statistics()).in_flight == 0  # nothing reached the Buffer
    assert (await client.get("/v1/statistics")).status_code == 200


def _header_blob(metadata: bytes) -> bytes:
    header = (
        b'[0.0,"a",null,"a/0",null,0,[],"completed",null,null,' + metadata + b",1,0,false,true]"
    )
    return len(header).to_bytes(4, "little") + header + (7).to_bytes(4, "little")


BAD_SAMPLES: list[tuple[str, bytes, str]] = [
    ("/v1/put_group", b"\0" * 4096, "has length 0"),
    ("/v1/put_group", encode_samples(group("a", [1, 0])) + b"\0" * 4, "sample 2"),
    ("/v1/put_groups", b"\0" * 4096, "group 0 (at byte 0) has length 0"),
    (
        "/v1/put_groups",
        join_frames([encode_samples(group("a", [1, 0])), b"\0" * 8]),
        "group 1 of the put_groups body",
    ),
    (
        "/v1/put_group",
        join_frames([_header_blob(b'{"x":' + b"[" * 200_000 + b"]" * 200_000 + b"}")]),
        "nested too deeply",
    ),
    ("/v1/put_group", join_frames([_header_blob(b'{"x":NaN}')]), "metadata['x'] is nan"),
    ("/v1/put_group", join_frames([_header_blob(b'{"x":1e999}')]), "metadata['x'] is inf"),
]


@pytest.mark.parametrize(("path", "body", "words"), BAD_SAMPLES, ids=[w for _, _, w in BAD_SAMPLES])
async def test_malformed_sample_bodies_are_400_and_nothing_is_stored(
    raw: tuple[Buffer, httpx.AsyncClient], path: str, body: bytes, words: str
) -> None:
    buffer, client = raw
    r = await client.post(path, content=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "SampleError"
    assert words in r.json()["error"]["message"]
    assert (await buffer.statistics()).groups_put == 0


async def test_too_many_samples_in_one_request_is_413() -> None:
    async with (
        Buffer(BufferConfig(n_samples_per_prompt=2, capacity=20_000)) as buffer,
        BufferServer(buffer, token=TOKEN, max_samples_per_request=10_000) as server,
        httpx.AsyncClient(base_url=server.url, headers=AUTH, trust_env=False, timeout=60) as client,
    ):
        tiny = [encode_samples(group(f"g{i}", [1.0], tokens=1)) for i in range(10_001)]
        r = await client.post("/v1/put_groups", content=join_frames(tiny))
        assert r.status_code == 413 and "more than 10000 samples" in r.json()["error"]["message"]
        r = await client.post("/v1/put_groups", content=join_frames(tiny[:10_000]))
        assert r.status_code == 200 and r.json()["errors"] == [None] * 10_000


# -- memory per request -------------------------------------------------------------------
def _memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and VmHWM (peak) of process ``pid``, in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) / 1024
    return out


@pytest.fixture
def buffer_serve(tmp_path: Path) -> Iterator[tuple[str, int]]:
    """``agentenv buffer serve`` in a process of its own: its URL and pid."""
    token = tmp_path / "token"
    token.write_text(TOKEN)
    token.chmod(0o600)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "agentenv",
            "buffer",
            "serve",
            "--path",
            str(tmp_path / "buf"),
            "--token-file",
            str(token),
            "--n-samples-per-prompt",
            "8",
        ],
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        assert " at http://" in line, line
        yield line.split(" at ")[1].split()[0], proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


@pytest.mark.timeout(300)
def test_a_64_mb_body_costs_a_small_multiple_of_its_size(buffer_serve: tuple[str, int]) -> None:
    url, pid = buffer_serve
    size = 64 * MB
    with httpx.Client(base_url=url, headers=AUTH, trust_env=False, timeout=120) as client:
        # Zero bytes: each 4 read as an empty frame; refused at the first, for two copies'
        # worth of memory (the server's reading of the body).
        for path in ("/v1/put_groups", "/v1/put_group"):
            before = _memory_mb(pid)["VmRSS"]
            r = client.post(path, content=bytes(size))
            assert r.status_code == 400 and "length 0" in r.text
            grown = _memory_mb(pid)["VmHWM"] - before
            assert grown < 3 * size / MB, (path, grown)
        # Real groups, 64 MB of them in one request: stored, and kept ready in memory.
        groups, total = [], 0
        while total < size:
            blob = encode_samples(group(f"g{len(groups)}", [1.0, 0.0] * 4, tokens=1000))
            groups.append(blob)
            total += len(blob) + 4
        before = _memory_mb(pid)["VmRSS"]
        r = client.post("/v1/put_groups", content=join_frames(groups))
        assert r.status_code == 200 and r.json()["errors"] == [None] * len(groups)
        grown = _memory_mb(pid)["VmHWM"] - before
        assert grown < 5 * size / MB, grown


@pytest.mark.timeout(300)
def test_a_json_heavy_body_is_refused_before_it_is_parsed(
    buffer_serve: tuple[str, int],
) -> None:
    url, pid = buffer_serve
    size = 8 * MB
    # Two samples whose metadata is 4 MB of empty dicts each: parsed, ~50x the body.
    meta = {"x": [{}] * (size // 2 // 3)}
    body = encode_samples(
        [
            Sample(prompt_ids=[1], completion_ids=[2], reward=0.0, group_id="m", id=f"m{i}",
                   metadata=meta)
            for i in range(2)
        ]
    )  # fmt: skip
    with httpx.Client(base_url=url, headers=AUTH, trust_env=False, timeout=120) as client:
        for path, content in (("/v1/put_group", body), ("/v1/put_groups", join_frames([body]))):
            before = _memory_mb(pid)["VmRSS"]
            r = client.post(path, content=content)
            assert r.status_code == 413, r.text
            error = r.json()["error"]
            assert error["type"] == "HeaderTooLarge", error
            assert "at most 1048576 bytes per sample" in error["message"], error
            grown = _memory_mb(pid)["VmHWM"] - before
            assert grown < 3 * size / MB, (path, grown)
        # Many samples of small headers, over the per-request total: refused too.
        groups = [
            encode_samples(
                [Sample(prompt_ids=[1], completion_ids=[2], reward=0.0, group_id=f"s{k}",
                        id=f"s{k}", metadata={"pad": "x" * 100_000})]
            )
            for k in range(100)
        ]  # fmt: skip
        r = client.post("/v1/put_groups", content=join_frames(groups))
        assert r.status_code == 413 and "over 8388608 bytes of JSON headers" in r.text, r.text
        assert client.get("/v1/statistics").json()["groups_put"] == 0


async def test_reserve_beyond_its_bound_and_release_beyond_the_reserved_are_400(
    raw: tuple[Buffer, httpx.AsyncClient],
) -> None:
    buffer, client = raw
    for path, body, words in (
        ("/v1/reserve", b'{"prompts": 1000000000}', "reserve(1000000000)"),
        ("/v1/release", b'{"prompts": 5}', "release(5)"),
    ):
        r = await client.post(path, content=body)
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["type"] == "ConfigError" and words in error["message"], error
    assert (await buffer.statistics()).in_flight == 0
    with anyio.fail_after(60):
        await buffer.reserve(1)  # nobody is held back


async def test_the_client_splits_puts_below_the_header_limit() -> None:
    cfg = BufferConfig(n_samples_per_prompt=1)
    async with (
        Buffer(cfg) as buffer,
        BufferServer(buffer, token=TOKEN) as server,
        BufferClient(server.url, token=TOKEN) as client,
    ):
        # 100 concurrent groups of 100 KB headers: 10 MB, more than one request may carry.
        async with anyio.create_task_group() as tg:
            for k in range(100):
                sample = Sample(prompt_ids=[1], completion_ids=[2], reward=0.0, group_id=f"h{k}",
                                id=f"h{k}", metadata={"pad": "x" * 100_000})  # fmt: skip
                tg.start_soon(client.put_group, [sample])
        assert (await buffer.statistics()).groups_put == 100
