"""agentenv's HTTP/1.1 server, under the Buffer service, the engine and the endpoint."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import anyio
import httpx
import pytest

from agentenv import ConfigError
from agentenv._http import (
    HTTPError,
    HTTPServer,
    Request,
    Response,
    Router,
    StreamingResponse,
    sse,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


def _router() -> Router:
    router = Router()

    @router.route("GET", "/hello")
    async def hello(request: Request) -> Response:
        return Response.json({"hello": request.query.get("name", "world")})

    @router.route("POST", "/echo")
    async def echo(request: Request) -> Response:
        return Response(request.body, content_type="application/octet-stream")

    @router.route("GET", "/fail")
    async def fail(request: Request) -> Response:
        raise RuntimeError("handler bug")

    @router.route("GET", "/bad-header")
    async def bad_header(request: Request) -> Response:
        return Response(headers=[("x-a", "b\r\nx-injected: 1")])

    @router.route("GET", "/teapot")
    async def teapot(request: Request) -> Response:
        raise HTTPError(418, "short and stout", type="Teapot")

    @router.route("GET", "/events")
    async def events(request: Request) -> StreamingResponse:
        async def gen() -> AsyncIterator[bytes]:
            for i in range(3):
                yield sse(f"tick {i}\nline two", event="tick", id=str(i))
            yield b"data: [DONE]\n\n"

        return StreamingResponse(gen())

    return router


async def _raw(port: int, data: bytes, wait: float = 5) -> bytes:
    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
        await stream.send(data)
        out = b""
        with anyio.move_on_after(wait):
            while True:
                try:
                    out += await stream.receive()
                except (anyio.EndOfStream, anyio.BrokenResourceError):
                    break
        return out


async def test_http_server_basics() -> None:
    async with (
        HTTPServer(_router(), max_body_bytes=1 << 20) as server,
        httpx.AsyncClient(base_url=server.url, trust_env=False) as client,
    ):
        r = await client.get("/hello", params={"name": "a b"})
        assert r.json() == {"hello": "a b"} and r.headers["content-type"] == "application/json"
        payload = bytes(range(256)) * 1000
        for _ in range(3):  # keep-alive: one connection serves them all
            r = await client.post("/echo", content=payload)
            assert r.content == payload
        r = await client.get("/fail")
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalError"
        r = await client.get("/bad-header")  # a header that would break the head
        assert r.status_code == 500 and "x-injected" not in r.headers
        r = await client.get("/teapot")
        assert r.status_code == 418 and r.json()["error"] == {
            "type": "Teapot",
            "message": "short and stout",
        }
        r = await client.head("/hello")
        assert r.status_code == 200 and r.content == b""
        r = await client.post("/echo", content=b"x" * ((1 << 20) + 1))
        assert r.status_code == 413
        async with client.stream("GET", "/events") as stream:
            assert stream.headers["transfer-encoding"] == "chunked"
            text = "".join([piece async for piece in stream.aiter_text()])
        assert text.count("event: tick") == 3
        assert "data: tick 2\ndata: line two\n\n" in text and text.endswith("[DONE]\n\n")
        r = await client.get("/hello")  # the connection is still good after a stream
        assert r.status_code == 200


def _status(answer: bytes) -> bytes:
    """The status code of a raw answer (aiohttp answers a request it cannot parse, whose
    version it does not know, in HTTP/1.0)."""
    line = answer.split(b"\r\n", 1)[0]
    assert line.startswith((b"HTTP/1.1 ", b"HTTP/1.0 ")), answer[:80]
    return line.split(b" ")[1]


async def test_http_server_protocol_edges() -> None:
    async with HTTPServer(_router(), max_header_bytes=1024) as server:
        port = server.port
        # Pipelined keep-alive requests on one connection, answered in order.
        out = await _raw(
            port,
            b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n"
            b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 3\r\n\r\nabc"
            b"GET /hello?name=z HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n",
        )
        assert out.count(b"HTTP/1.1 200 OK") == 3
        assert out.index(b'"world"') < out.index(b"abc") < out.index(b'"z"')
        # HTTP/1.0 closes unless asked to keep alive (_raw reads to the end of the stream).
        with anyio.fail_after(4):
            out = await _raw(port, b"GET /hello HTTP/1.0\r\n\r\n")
        assert _status(out) == b"200" and b"keep-alive" not in out.lower()
        out = await _raw(port, b"GET /hello HTTP/1.0\r\nconnection: keep-alive\r\n\r\n", 0.3)
        assert _status(out) == b"200" and b"connection: keep-alive" in out.lower()
        # Expect: 100-continue is answered before the body is read.
        out = await _raw(
            port,
            b"POST /echo HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\ncontent-length: 3\r\n"
            b"connection: close\r\n\r\nabc",
        )
        assert out.startswith(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\n"), out
        assert out.endswith(b"\r\n\r\nabc")
        # A stream to an HTTP/1.0 client is not chunked: it ends with the connection.
        with anyio.fail_after(4):
            out = await _raw(port, b"GET /events HTTP/1.0\r\n\r\n")
        assert _status(out) == b"200" and b"chunked" not in out.lower()
        assert out.endswith(b"data: [DONE]\n\n")
        for request, status in [
            (b"garbage\r\n\r\n", b"400"),
            (b"GET /hello HTTP/1.1\r\n\r\n", b"400"),  # no Host (RFC 9112 3.2)
            (b"GET /hello HTTP/2.0\r\nhost: x\r\n\r\n", b"505"),
            (b"GET hello HTTP/1.1\r\nhost: x\r\n\r\n", b"400"),
            (b"GET /hello HTTP/1.1\r\nhost: x\r\nbad header\r\n\r\n", b"400"),
            (b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: x\r\n\r\n", b"400"),
            (
                b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 1\r\ncontent-length: 2\r\n\r\n",
                b"400",
            ),
            (
                b"POST /echo HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
                b"3\r\nabc\r\n0\r\n\r\n",
                b"411",
            ),
            (b"GET /hello HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 2000 + b"\r\n\r\n", b"431"),
            # Many small headers, over the whole head's bound.
            (b"GET /hello HTTP/1.1\r\nhost: x\r\n" + b"x-a: b\r\n" * 200 + b"\r\n", b"431"),
        ]:
            with anyio.fail_after(4):  # answered, and the connection closed
                out = await _raw(port, request)
            assert _status(out) == status, (request[:40], out[:80])
            head, _, body = out.partition(b"\r\n\r\n")
            assert b"content-type: application/json" in head.lower(), out[:200]
            assert json.loads(body)["error"]["message"], body  # agentenv's error shape
        # A client that disconnects mid-request does not disturb the server.
        async with await anyio.connect_tcp("127.0.0.1", port) as stream:
            await stream.send(b"POST /echo HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\nabc")
        async with httpx.AsyncClient(trust_env=False) as client:
            assert (await client.get(f"{server.url}/hello")).status_code == 200


def test_http_config_errors() -> None:
    router = Router()
    with pytest.raises(ConfigError, match="port must be in"):
        HTTPServer(router, port=70000)
    with pytest.raises(ConfigError, match="max_body_bytes must be at least 1"):
        HTTPServer(router, max_body_bytes=0)

    async def h(request: Request) -> Response:
        return Response()

    router.add("GET", "/x", h)
    with pytest.raises(ConfigError, match="already registered"):
        router.add("GET", "/x", h)
    with pytest.raises(ConfigError, match="must start with '/'"):
        router.add("GET", "x", h)


async def test_closing_while_clients_connect_never_strands_a_client() -> None:
    # Stopping the server at any moment of a client's connect-and-send must leave the
    # client with an answer or a closed connection, never a socket nobody reads.
    for i in range(150):
        server = HTTPServer(_router(), keepalive_timeout=30)
        async with server:
            answers: list[bytes] = []

            async def client(port: int, answers: list[bytes]) -> None:
                out = b""
                try:
                    async with await anyio.connect_tcp("127.0.0.1", port) as stream:
                        await stream.send(b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n")
                        while True:  # no deadline of its own: a stranded client hangs
                            out += await stream.receive()
                except (OSError, anyio.EndOfStream, anyio.BrokenResourceError):
                    pass
                answers.append(out)

            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(client, server.port, answers)
                    await anyio.sleep((i % 50) * 0.0001)
                    await server.aclose()
            assert len(answers) == 1
            assert answers[0] in (b"",) or answers[0].startswith(b"HTTP/1.1 ")


async def test_a_connection_reset_before_it_is_accepted_is_ignored() -> None:
    import socket
    import struct
    import time

    async with HTTPServer(_router()) as server:
        s = socket.create_connection(("127.0.0.1", server.port))
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a reset, queued before the server's loop gets to accept it
        time.sleep(0.2)  # noqa: ASYNC251 - keeps the loop from accepting in between
        await anyio.sleep(0.2)
        async with httpx.AsyncClient(base_url=server.url, trust_env=False) as client:
            with anyio.fail_after(5):
                r = await client.get("/hello")
        assert r.json() == {"hello": "world"}


# -- the connection cap -------------------------------------------------------------------
def _capped_router(release: anyio.Event) -> Router:
    router = _router()

    @router.route("GET", "/health", probe=True)
    async def health(request: Request) -> Response:
        return Response.empty(200)

    @router.route("GET", "/slow", long_poll=True)
    async def slow(request: Request) -> Response:
        await release.wait()
        return Response.json({"slow": True})

    return router


async def test_idle_sockets_cannot_lock_clients_out_and_a_full_server_answers_503() -> None:
    release = anyio.Event()
    server = HTTPServer(_capped_router(release), max_connections=8, reserve_connections=2)
    async with server:
        # 60 sockets that connect and never send: each newcomer at the cap closes the
        # longest-idle one, so the server never holds more than its cap ...
        idle = [await anyio.connect_tcp("127.0.0.1", server.port) for _ in range(60)]
        with anyio.fail_after(10):
            while server.connections < 8:  # noqa: ASYNC110 - the server accepts meanwhile
                await anyio.sleep(0.01)
        assert server.connections == 8
        # ... and a normal client still gets in.
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=5) as client:
            assert (await client.get("/hello")).json() == {"hello": "world"}
            assert server.connections <= 8
        for s in idle:
            await s.aclose()

        # Every connection busy: the reserve answers health probes only, beyond it a 503.
        busy_clients = [
            httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=10) for _ in range(8)
        ]
        answers: list[int] = []

        async def wait_slow(client: httpx.AsyncClient) -> None:
            answers.append((await client.get("/slow")).status_code)

        async with anyio.create_task_group() as tg:
            for client in busy_clients:
                tg.start_soon(wait_slow, client)
            with anyio.fail_after(10):
                while server._conns.busy < 8:  # noqa: ASYNC110 - the handlers start meanwhile
                    await anyio.sleep(0.01)
            health = await _raw(server.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert health.startswith(b"HTTP/1.1 200 OK\r\n"), health
            assert b"connection: close" in health.lower() and health.endswith(b"\r\n\r\n")
            refused = await _raw(server.port, b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n")
            assert refused.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), refused
            assert b"retry-after: 1" in refused.lower() and b"maximum of 8 connections" in refused
            # The reserve taken too (by requests whose body is still arriving; idle ones, or
            # ones still sending their head, would be closed to make room): refused at once.
            held = []
            for n in (9, 10):
                held.append(await anyio.connect_tcp("127.0.0.1", server.port))
                await held[-1].send(b"GET /health HTTP/1.1\r\nhost: x\r\ncontent-length: 9\r\n\r\n")
                with anyio.fail_after(5):
                    while server._conns.busy < n:  # noqa: ASYNC110 - the server reads it meanwhile
                        await anyio.sleep(0.01)
            beyond = await _raw(server.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert beyond.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), beyond
            for s in held:
                await s.aclose()
            release.set()
        assert answers == [200] * 8
        for client in busy_clients:
            await client.aclose()
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=5) as client:
            assert (await client.get("/hello")).status_code == 200


async def test_half_sent_heads_cannot_lock_clients_or_probes_out() -> None:
    release = anyio.Event()
    server = HTTPServer(_capped_router(release), max_connections=4, reserve_connections=2)
    async with server:
        # Sockets that start a request head and never finish it: each newcomer at the cap
        # closes the one waiting longest, as for idle sockets, so none of them holds a
        # connection (the probe reserve included) against a client that sends its head.
        half = []
        for _ in range(12):
            half.append(await anyio.connect_tcp("127.0.0.1", server.port))
            await half[-1].send(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        with anyio.fail_after(10):
            while server.connections < 4:  # noqa: ASYNC110 - the server accepts meanwhile
                await anyio.sleep(0.01)
        with anyio.fail_after(10):
            health = await _raw(server.port, b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
            assert health.startswith(b"HTTP/1.1 200 OK\r\n"), health
            async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=5) as c:
                assert (await c.get("/hello")).json() == {"hello": "world"}
        assert server.connections <= 4
        for s in half:
            await s.aclose()


async def test_a_head_that_never_ends_gets_408_after_head_timeout() -> None:
    async with HTTPServer(_router(), head_timeout=0.3, request_timeout=60) as server:
        with anyio.fail_after(5):
            answer = await _raw(server.port, b"GET /hello HTTP/1.1\r\nHost: x\r\n")
        assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), answer
        assert b"the request head took over 0.3 s to arrive" in answer
    with pytest.raises(ConfigError, match="head_timeout must be > 0 seconds, got 0"):
        HTTPServer(_router(), head_timeout=0)


def test_the_default_cap_stays_below_the_descriptor_limit() -> None:
    from agentenv._http._limits import default_max_connections

    assert default_max_connections(1024) == 720
    assert default_max_connections(80) == 16
    assert default_max_connections(1 << 20) == 8192
    with pytest.raises(ConfigError, match="max_connections must be at least 1, got 0"):
        HTTPServer(_router(), max_connections=0)


async def test_out_of_descriptors_a_client_gets_503_and_the_server_goes_on() -> None:
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    async with HTTPServer(_router(), max_connections=1000) as server:
        used = len(os.listdir("/proc/self/fd"))
        resource.setrlimit(resource.RLIMIT_NOFILE, (used + 64, hard))
        filler: list[int] = []
        try:
            with pytest.raises(OSError, match="Too many open files"):  # noqa: PT012
                for _ in range(200):
                    filler.append(os.open(os.devnull, os.O_RDONLY))
            os.close(filler.pop())  # room for the client's socket only: the accept fails
            with anyio.fail_after(10):
                answer = await _raw(server.port, b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n")
            assert answer.startswith(b"HTTP/1.1 503 Service Unavailable\r\n"), answer
        finally:
            for fd in filler:
                os.close(fd)
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        async with httpx.AsyncClient(base_url=server.url, trust_env=False, timeout=5) as client:
            assert (await client.get("/hello")).json() == {"hello": "world"}


# -- timeouts and shutdown ------------------------------------------------------------------
async def test_idle_connections_close_after_keepalive_timeout() -> None:
    async with HTTPServer(_router(), keepalive_timeout=0.3, head_timeout=5) as server:
        for request in (b"", b"GET /hello HTTP/1.1\r\nhost: x\r\n\r\n"):  # silent, kept alive
            start = anyio.current_time()
            out = await _raw(server.port, request, wait=5)
            assert anyio.current_time() - start < 3, request  # closed by the server
            assert out == b"" if not request else out.startswith(b"HTTP/1.1 200 OK\r\n")
        with anyio.fail_after(5):
            while server.connections:  # noqa: ASYNC110 - the server closes them meanwhile
                await anyio.sleep(0.01)


async def test_a_head_under_way_is_timed_by_head_timeout_not_keepalive_timeout() -> None:
    async with HTTPServer(_router(), keepalive_timeout=0.3, head_timeout=1.0) as server:
        async with await anyio.connect_tcp("127.0.0.1", server.port) as stream:
            await stream.send(b"GET /hello HTTP/1.1\r\n")  # then nothing more
            start = anyio.current_time()
            out = b""
            with anyio.fail_after(5):
                while True:
                    try:
                        out += await stream.receive()
                    except (anyio.EndOfStream, anyio.BrokenResourceError):
                        break
        assert out.startswith(b"HTTP/1.1 408 Request Timeout\r\n"), out
        assert anyio.current_time() - start >= 0.9  # not cut at the keep-alive timeout


async def test_shutdown_lets_requests_finish_within_the_grace_then_cancels_them() -> None:
    release = anyio.Event()
    started = anyio.Event()
    cancelled: list[bool] = []

    async def slow(request: Request) -> Response:
        started.set()
        try:
            await (release.wait() if request.query.get("finish") else anyio.sleep_forever())
        except BaseException:
            cancelled.append(True)
            raise
        return Response.json({"finished": True})

    router = Router()
    router.add("GET", "/slow", slow)
    for finish, grace in ((True, 10.0), (False, 0.2)):
        started = anyio.Event()
        server = HTTPServer(router, shutdown_grace=grace)
        async with server, httpx.AsyncClient(base_url=server.url, trust_env=False) as client:
            answers: list[httpx.Response | Exception] = []

            async def call(client: httpx.AsyncClient, answers: list[Any], finish: bool) -> None:
                try:
                    answers.append(await client.get("/slow", params={"finish": finish or ""}))
                except httpx.TransportError as e:
                    answers.append(e)

            with anyio.fail_after(5):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(call, client, answers, finish)
                    await started.wait()
                    tg.start_soon(server.aclose)
                    if finish:
                        await anyio.wait_all_tasks_blocked()
                        release.set()
        (answer,) = answers
        if finish:  # finished within the grace, answered, and told the connection closes
            assert isinstance(answer, httpx.Response) and answer.json() == {"finished": True}
            assert answer.headers["connection"] == "close" and not cancelled
        else:  # cancelled once the grace ran out; the connection is closed unanswered
            assert isinstance(answer, httpx.TransportError) and cancelled == [True]


def test_router_patterns_match_one_segment() -> None:
    router = Router()

    async def handler(request: Request) -> Response:
        return Response.empty()

    router.add("POST", "/e/{key}/v1/chat/completions", handler)
    router.add("GET", "/e/fixed/v1/models", handler)
    assert router.resolve("POST", "/e/abc/v1/chat/completions").handler is handler
    assert router.resolve("GET", "/e/fixed/v1/models").handler is handler
    with pytest.raises(HTTPError) as missing:
        router.resolve("POST", "/e//v1/chat/completions")  # an empty segment is no key
    assert missing.value.status == 404
    with pytest.raises(HTTPError) as wrong:
        router.resolve("GET", "/e/abc/v1/chat/completions")
    assert wrong.value.status == 405
    with pytest.raises(HTTPError):
        router.resolve("POST", "/e/a/b/v1/chat/completions")


def test_json_bodies_nested_past_the_bound_are_refused_not_recursed() -> None:
    from agentenv._http import MAX_JSON_DEPTH, decode_json

    def nested(depth: int) -> bytes:
        return b'{"a": ' * (depth - 1) + b"[]" + b"}" * (depth - 1)

    assert decode_json(b"[" * 64 + b"]" * 64) is not None
    assert decode_json(nested(MAX_JSON_DEPTH)) is not None
    for body in (nested(MAX_JSON_DEPTH + 1), b"[" * 100_000 + b"]" * 100_000):
        with pytest.raises(ValueError, match=f"deeper than {MAX_JSON_DEPTH} levels"):
            decode_json(body)
    request = Request("POST", "/", {}, {}, b"[" * 100_000 + b"]" * 100_000)
    with pytest.raises(HTTPError) as info:
        request.json()
    assert info.value.status == 400 and "not valid JSON" in info.value.message
