"""How many ``/generate`` requests per second the SGLang client sustains, on one core.

A stand-in server answers every ``POST /generate`` at once with a fixed SGLang response
(8 output tokens with logprobs); it runs in a process of its own, on the other core, and
is a bare asyncio protocol so that it is never the limit. The client process, pinned to one
core, keeps ``--in-flight`` requests going (each a 100-token prompt) until ``--requests``
are answered, and reports requests/s and its own CPU time per request. The comparisons
post the same body and decode the same JSON: a bare ``aiohttp.ClientSession``
(``--client aiohttp``), and plain ``httpx.AsyncClient`` with its default transport
(``--client httpx``). ::

    python -m benchmarks.client --serve            # prints the port, serves
    python -m benchmarks.client --url http://127.0.0.1:PORT --client agentenv
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import resource
import sys
import time
from typing import Any

import anyio

OUTPUT = list(range(1000, 1008))
RESPONSE = json.dumps(
    {
        "text": "",
        "output_ids": OUTPUT,
        "meta_info": {
            "id": "standin",
            "finish_reason": {"type": "length", "length": len(OUTPUT)},
            "prompt_tokens": 100,
            "completion_tokens": len(OUTPUT),
            "cached_tokens": 0,
            "output_token_logprobs": [[-0.5, t, None] for t in OUTPUT],
            "weight_version": "default",
            "e2e_latency": 0.0,
        },
    },
    separators=(",", ":"),
).encode()
_ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
    + str(len(RESPONSE)).encode()
    + b"\r\n\r\n"
    + RESPONSE
)


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


class _Instant(asyncio.Protocol):
    """Answers each complete request (head + Content-Length body) with the fixed reply."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        replies = 0
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = bytes(buf[:end]).lower()
            length = 0
            at = head.find(b"content-length:")
            if at >= 0:
                length = int(head[at + 15 :].split(b"\r\n", 1)[0])
            if len(buf) < end + 4 + length:
                break
            del buf[: end + 4 + length]
            replies += 1
        if replies and self.transport is not None:
            self.transport.write(_ANSWER * replies)


async def serve() -> None:
    _raise_fd_limit()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(_Instant, "127.0.0.1", 0, backlog=8192)
    port = server.sockets[0].getsockname()[1]
    print(port, flush=True)
    async with server:
        await server.serve_forever()


async def _drive(send: Any, requests: int, in_flight: int) -> float:
    left = requests

    async def worker() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await send()

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for _ in range(in_flight):
            tg.start_soon(worker)
    return time.perf_counter() - start


async def _measure(send: Any, requests: int, in_flight: int) -> tuple[float, float]:
    """After a warm-up that opens the connections: the wall-clock and this process's CPU
    seconds that ``requests`` calls of ``send`` take, ``in_flight`` at a time."""
    await _drive(send, in_flight, in_flight)
    cpu = time.process_time()
    elapsed = await _drive(send, requests, in_flight)
    return elapsed, time.process_time() - cpu


async def run_client(url: str, client: str, requests: int, in_flight: int) -> dict[str, Any]:
    """Requests per second with ``client`` (``agentenv``: SGLangClient; ``aiohttp``: a bare
    aiohttp.ClientSession; ``httpx``: plain httpx.AsyncClient, default transport)."""
    import httpx

    from agentenv import SamplingParams
    from agentenv.sglang import SGLangClient, parse_completion

    prompt = list(range(2000, 2100))
    params = SamplingParams(max_new_tokens=8)
    if client == "agentenv":
        async with SGLangClient(url, max_connections=in_flight) as sglang:

            async def send() -> None:
                completion = await sglang.generate(prompt, params)
                assert completion.output_ids == OUTPUT

            elapsed, cpu = await _measure(send, requests, in_flight)
    elif client == "aiohttp":
        import aiohttp

        headers = {"content-type": "application/json"}
        connector = aiohttp.TCPConnector(limit=in_flight, limit_per_host=0)
        timeout = aiohttp.ClientTimeout(total=3600, connect=10)
        async with aiohttp.ClientSession(
            url, connector=connector, timeout=timeout, trust_env=False
        ) as session:

            async def send() -> None:
                body = {
                    "input_ids": prompt,
                    "sampling_params": params.to_sglang(),
                    "return_logprob": True,
                    "stream": False,
                }
                data = json.dumps(body, separators=(",", ":")).encode()
                async with session.post("/generate", data=data, headers=headers) as response:
                    content = await response.read()
                    response.raise_for_status()
                completion = parse_completion(json.loads(content), True, url=url)
                assert completion.output_ids == OUTPUT

            elapsed, cpu = await _measure(send, requests, in_flight)
    elif client == "httpx":
        body = {
            "input_ids": prompt,
            "sampling_params": params.to_sglang(),
            "return_logprob": True,
            "stream": False,
        }
        limits = httpx.Limits(max_connections=in_flight, max_keepalive_connections=in_flight)
        async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600) as http:

            async def send() -> None:
                response = await http.post("/generate", json=body)
                response.raise_for_status()
                completion = parse_completion(response.json(), True, url=url)
                assert completion.output_ids == OUTPUT

            elapsed, cpu = await _measure(send, requests, in_flight)
    else:
        raise ValueError(f"unknown client {client!r}")
    return {
        "client": client,
        "requests": requests,
        "in_flight": in_flight,
        "seconds": round(elapsed, 3),
        "requests_per_s": round(requests / elapsed, 1),
        "client_cpu_us_per_request": round(cpu / requests * 1e6, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", action="store_true", help="run the stand-in server")
    parser.add_argument("--url")
    parser.add_argument("--client", default="agentenv", choices=["agentenv", "aiohttp", "httpx"])
    parser.add_argument("--requests", type=int, default=40000)
    parser.add_argument("--in-flight", type=int, default=4096)
    parser.add_argument("--cpu", type=int, default=None, help="pin to this CPU")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, {args.cpu})
    if args.serve:
        asyncio.run(serve())
        return 0
    _raise_fd_limit()
    result = anyio.run(run_client, args.url, args.client, args.requests, args.in_flight)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
