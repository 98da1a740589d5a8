"""The endpoints' bounds: a message that cannot fit the context is refused before it is
tokenized, a long one is tokenized off the event loop, bodies are capped in size and in
time, and one agent's half-sent requests cannot take the connections other episodes need."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import httpx
import pytest

from agentenv import ChatTokenizer, Episode, Limits, ScriptedModel, Task
from agentenv._http import HTTPServer, Router
from agentenv.endpoint import AgentServer, serve_chat

from .test_env import calculator_script

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

CONTEXT = 2048


class CountingTokenizer(ChatTokenizer):
    """SmolLM2's tokenizer, noting the length of every text it tokenizes and the thread."""

    def __init__(self, base: ChatTokenizer) -> None:
        super().__init__(
            base._tok,
            base.chat_template,
            bos_token=base.bos_token,
            eos_token=base.eos_token,
            name=base.name,
        )
        self.encoded: list[tuple[int, str]] = []

    def encode(self, text: str) -> list[int]:
        self.encoded.append((len(text), threading.current_thread().name))
        return super().encode(text)


def _episode(tok: ChatTokenizer, context_length: int | None = CONTEXT) -> Episode:
    return Episode(
        task=Task(id="t"),
        tokenizer=tok,
        policy=ScriptedModel(tok, calculator_script),
        limits=Limits(context_length=context_length),
    )


def _chat(text: str) -> dict[str, Any]:
    return {"model": "p", "messages": [{"role": "user", "content": text}]}


async def _episode_url(tok: ChatTokenizer) -> AsyncIterator[str]:
    async with AgentServer().open(_episode(tok)) as endpoint:
        yield f"{endpoint.base_url}/chat/completions"


async def _serve_url(tok: ChatTokenizer) -> AsyncIterator[str]:
    router = Router()
    model = ScriptedModel(tok, calculator_script)
    serve_chat(router, model, tok, model="m", context_length=CONTEXT)
    async with HTTPServer(router) as server:
        yield f"{server.url}/v1/chat/completions"


@pytest.mark.parametrize("where", [_episode_url, _serve_url], ids=["endpoint", "serve"])
async def test_a_message_that_cannot_fit_is_refused_before_it_is_tokenized(
    smollm2: ChatTokenizer, where: Callable[[ChatTokenizer], AsyncIterator[str]]
) -> None:
    tok = CountingTokenizer(smollm2)
    huge = "hello world " * (4 * 1024 * 1024 // 12)  # 4 MiB, ~700k tokens
    async for url in where(tok):
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            r = await http.post(url, json=_chat(huge))
            assert r.status_code == 400, r.text
            error = r.json()["error"]
            assert error["code"] == "context_length_exceeded", error
            assert f"maximum context length is {CONTEXT} tokens" in error["message"]
            assert "the prompt has at least" in error["message"]
            # The tokenizer never saw more text than could fit the context (a token of
            # SmolLM2's is at most 81 bytes of text).
            assert max((n for n, _ in tok.encoded), default=0) <= CONTEXT * 81
            ok = await http.post(url, json=_chat("What is 2+3?"))
            assert ok.status_code == 200, ok.text


async def test_a_long_call_is_tokenized_off_the_event_loop(smollm2: ChatTokenizer) -> None:
    tok = CountingTokenizer(smollm2)
    long = "hello world " * 4000  # 48k characters: fits an unbounded context
    loop_thread = threading.current_thread().name
    async with (
        AgentServer().open(_episode(tok, context_length=None)) as endpoint,
        httpx.AsyncClient(trust_env=False, timeout=60) as http,
    ):
        r = await http.post(f"{endpoint.base_url}/chat/completions", json=_chat(long))
        assert r.status_code == 200, r.text
    threads = {thread for n, thread in tok.encoded if n >= len(long)}
    assert threads and loop_thread not in threads


async def _half_request(port: int, key: str) -> anyio.abc.SocketStream:
    """A connection that sends a chat request's head and half its body, then waits."""
    stream = await anyio.connect_tcp("127.0.0.1", port)
    await stream.send(
        f"POST /e/{key}/v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
        "content-type: application/json\r\ncontent-length: 1000\r\n\r\n".encode()
        + b"{" * 500
    )
    return stream


async def _answer(stream: anyio.abc.SocketStream) -> bytes:
    """What the server sends before it closes the connection."""
    out = b""
    while True:
        try:
            out += await stream.receive()
        except (anyio.EndOfStream, anyio.BrokenResourceError, OSError):
            return out


async def test_one_agents_half_sent_requests_cannot_fail_other_episodes(
    smollm2: ChatTokenizer,
) -> None:
    cap, per_endpoint = 16, 4
    server = AgentServer(
        max_connections=cap, max_requests_per_endpoint=per_endpoint, body_timeout_s=600
    )
    async with (
        server.open(_episode(smollm2)) as attacker,
        server.open(_episode(smollm2)) as a,
        server.open(_episode(smollm2)) as b,
    ):
        port = httpx.URL(attacker.base_url).port
        assert port is not None
        # cap + 40 connections, each with a head and half a body: beyond its endpoint's
        # limit each is answered 429 at once and closed (or closed to make room while
        # its head is unread), so the attacker holds `per_endpoint` connections at most.
        streams = [await _half_request(port, attacker.key) for _ in range(cap + 40)]
        closed: list[bytes] = []

        async def watch(stream: anyio.abc.SocketStream) -> None:
            closed.append(await _answer(stream))

        async with anyio.create_task_group() as tg:
            for stream in streams:
                tg.start_soon(watch, stream)
            with anyio.fail_after(60):  # a bound for a slow machine, not a measure
                while len(closed) < len(streams) - per_endpoint:  # noqa: ASYNC110
                    await anyio.sleep(0.05)
            refusals = [c for c in closed if c.startswith(b"HTTP/1.1 429 ")]
            assert refusals, closed[:3]
            assert b"max_requests_per_endpoint=4" in refusals[0]
            # The other episodes' calls go through meanwhile.
            async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
                for endpoint in (a, b):
                    r = await http.post(
                        f"{endpoint.base_url}/chat/completions", json=_chat("What is 2+3?")
                    )
                    assert r.status_code == 200, r.text
            tg.cancel_scope.cancel()
        for stream in streams:
            await stream.aclose()


async def test_a_body_that_stalls_gets_408_and_an_oversized_one_413(
    smollm2: ChatTokenizer,
) -> None:
    server = AgentServer(body_timeout_s=0.5, max_body_bytes=4096)
    async with server.open(_episode(smollm2)) as endpoint:
        port = httpx.URL(endpoint.base_url).port
        assert port is not None
        stream = await _half_request(port, endpoint.key)
        with anyio.fail_after(30):
            answer = await _answer(stream)
        await stream.aclose()
        assert answer.startswith(b"HTTP/1.1 408 "), answer
        assert b"took over 0.5 s to arrive" in answer and b"body_timeout_s" in answer
        async with httpx.AsyncClient(trust_env=False, timeout=60) as http:
            url = f"{endpoint.base_url}/chat/completions"
            r = await http.post(url, json=_chat("x" * 5000))
            assert r.status_code == 413, r.text
            message = r.json()["error"]["message"]
            assert "takes at most 4096" in message and "max_body_bytes" in message
            assert (await http.post(url, json=_chat("What is 2+3?"))).status_code == 200
