"""The Data Buffer benchmark: samples of 1,000 tokens through put_group + get_batch.

Measures, in one process pinned to one core: the in-memory Buffer, the durable Buffer
(SQLite, fsync per group commit), and -- as a baseline -- a plain ``asyncio.Queue`` moving
the same sample objects. A producer task puts groups while a consumer task takes batches,
so the numbers include the hand-off between them. The service is measured twice: client
and server in one process on one core (``service``), and as deployed, the server in a
process of its own on another core (``service_split``: one core each). ::

    python -m benchmarks.buffer --mode memory --groups 20000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

import anyio

from agentenv import Sample
from agentenv.buffer import Buffer, BufferConfig
from benchmarks.rollout import peak_rss_mb, pin_to_one_core

GROUP = 8
BATCH_GROUPS = 16
TOKENS = 1000


def make_groups(n: int, *, prefix: str = "g") -> list[list[Sample]]:
    """``n`` groups of ``GROUP`` samples of 1,000 tokens (200 prompt + 800 completion)."""
    rng = random.Random(0)
    prompt = [rng.randrange(49152) for _ in range(200)]
    completion = [rng.randrange(49152) for _ in range(TOKENS - 200)]
    mask = [1] * (TOKENS - 200)
    logprobs = [-rng.random() for _ in range(TOKENS - 200)]
    groups = []
    for g in range(n):
        gid = f"{prefix}{g}"
        groups.append(
            [
                Sample(
                    prompt_ids=prompt,
                    completion_ids=completion,
                    reward=float(k % 2),
                    loss_mask=mask,
                    rollout_logprobs=logprobs,
                    group_id=gid,
                    id=f"{gid}/{k}",
                    episode=k,
                    task_id=gid,
                    weight_versions=["0"],
                )
                for k in range(GROUP)
            ]
        )
    return groups


async def _through_buffer(
    buffer: Any, groups: Sequence[Sequence[Sample]], producers: int = 8
) -> float:
    n_batches = len(groups) // BATCH_GROUPS
    start = time.perf_counter()

    async def produce(part: Sequence[Sequence[Sample]]) -> None:
        for g in part:
            await buffer.put_group(g)

    async def consume() -> None:
        for step in range(n_batches):
            batch = await buffer.get_batch(BATCH_GROUPS)
            await buffer.ack(batch, step=step)

    async with anyio.create_task_group() as tg:
        for p in range(producers):
            tg.start_soon(produce, groups[p::producers])
        tg.start_soon(consume)
    return time.perf_counter() - start


async def _through_queue(groups: Sequence[Sequence[Sample]]) -> float:
    queue: asyncio.Queue[Sequence[Sample]] = asyncio.Queue(maxsize=1024)
    n_batches = len(groups) // BATCH_GROUPS
    start = time.perf_counter()

    async def produce() -> None:
        for g in groups:
            await queue.put(g)

    async def consume() -> None:
        for _ in range(n_batches):
            batch = [await queue.get() for _ in range(BATCH_GROUPS)]
            assert batch

    await asyncio.gather(produce(), consume())
    return time.perf_counter() - start


async def run(
    mode: str, n_groups: int, *, producers: int = 8, durability: str = "power"
) -> dict[str, Any]:
    groups = make_groups(n_groups)
    samples = n_groups * GROUP
    config = BufferConfig(
        n_samples_per_prompt=GROUP,
        capacity=4096,
        durability="process" if durability == "process" else "power",
    )
    if mode == "queue":
        wall = await _through_queue(groups)
    elif mode == "memory":
        async with Buffer(config) as buffer:
            wall = await _through_buffer(buffer, groups, producers)
    elif mode == "durable":
        with tempfile.TemporaryDirectory(prefix="agentenv-bench-") as tmp:
            async with Buffer(config, path=tmp) as buffer:
                wall = await _through_buffer(buffer, groups, producers)
                size = sum(
                    [
                        (await anyio.Path(tmp, name).stat()).st_size
                        for name in ("buffer.sqlite", "samples.log")
                    ]
                )
    elif mode == "service":
        from agentenv.buffer import BufferClient, BufferServer

        async with (
            Buffer(config) as buffer,
            BufferServer(buffer, token="bench") as server,
            BufferClient(server.url, token="bench") as client,
        ):
            wall = await _through_buffer(client, groups, producers)
    elif mode == "service_split":
        from agentenv.buffer import BufferClient

        async with _server_process() as url, BufferClient(url, token="bench") as client:
            wall = await _through_buffer(client, groups, producers)
    else:
        raise ValueError(
            f"mode must be queue, memory, durable, service or service_split, got {mode!r}"
        )
    out = {
        "mode": mode,
        "samples": samples,
        "tokens_per_sample": TOKENS,
        "producers": producers,
        "durability": durability if mode == "durable" else None,
        "wall_s": round(wall, 4),
        "samples_per_s": round(samples / wall, 1),
        "peak_rss_mb": round(peak_rss_mb(), 1),
    }
    if mode == "durable":
        out["disk_bytes_per_sample"] = round(size / samples, 1)
    return out


@contextlib.asynccontextmanager
async def _server_process() -> AsyncIterator[str]:
    """A Buffer service in a child process pinned to another core; yields its URL."""
    proc = await anyio.open_process(
        [sys.executable, "-m", "benchmarks.buffer", "--serve"], stderr=None
    )
    try:
        assert proc.stdout is not None
        url = (await proc.stdout.receive()).decode().strip()
        yield url
    finally:
        proc.terminate()
        await proc.wait()


async def _serve() -> None:
    from agentenv.buffer import BufferServer

    config = BufferConfig(n_samples_per_prompt=GROUP, capacity=4096)
    async with Buffer(config) as buffer, BufferServer(buffer, token="bench") as server:
        print(server.url, flush=True)
        await anyio.sleep_forever()


def _other_core() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:  # the client takes the last core (pin_to_one_core)
        os.sched_setaffinity(0, {cpus[-2]})


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--mode", choices=["queue", "memory", "durable", "service", "service_split"]
    )
    parser.add_argument("--groups", type=int)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--producers", type=int, default=8, help="concurrent put_group callers")
    parser.add_argument("--durability", choices=["power", "process"], default="power")
    args = parser.parse_args(argv)
    if args.serve:  # the server half of service_split
        _other_core()
        with contextlib.suppress(KeyboardInterrupt):
            anyio.run(_serve)
        return
    if args.mode is None or args.groups is None:
        parser.error("--mode and --groups are required")
    cpu = pin_to_one_core()
    result = anyio.run(
        functools.partial(run, producers=args.producers, durability=args.durability),
        args.mode,
        args.groups,
    )
    result["cpu"] = cpu
    print(json.dumps(result))


if __name__ == "__main__":
    main()
