"""SGLangClient against stand-in servers that answer with SGLang's recorded response shapes."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import pytest

from agentenv import ConfigError, SamplingParams
from agentenv._http import HTTPServer, Request, Response, Router, StreamingResponse, sse
from agentenv.sglang import SGLangClient, SGLangError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

# Responses as SGLang 0.5.x sends them (older: no weight_version/cached_tokens; newer: extra
# keys this client must ignore).
OLDER = {
    "text": "2+2=4",
    "output_ids": [17, 10, 17],
    "meta_info": {
        "id": "r1",
        "finish_reason": {"type": "length", "length": 3},
        "prompt_tokens": 4,
        "completion_tokens": 3,
        "output_token_logprobs": [[-0.5, 17, None], [-0.25, 10, None], [-0.125, 17, None]],
    },
}
NEWER = {
    "text": "ok<|im_end|>",
    "output_ids": [5, 2],
    "meta_info": {
        "id": "r2",
        "finish_reason": {"type": "stop", "matched": 2},
        "prompt_tokens": 4,
        "completion_tokens": 2,
        "cached_tokens": 3,
        "weight_version": "7",
        "output_token_logprobs": [[-0.0625, 5, "ok"], [-1.5, 2, "<|im_end|>"]],
        "e2e_latency": 0.01,
        "spec_verify_ct": 0,
        "some_future_key": {"nested": True},
    },
    "another_future_key": [1, 2],
}


class StandIn:
    """A scriptable SGLang stand-in: records requests, answers by path."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, dict[str, str], Any]] = []
        self.answers: dict[str, Callable[[Request], Any]] = {}
        self.router = Router()
        for method, path in [
            ("POST", "/generate"),
            ("POST", "/abort_request"),
            ("POST", "/pause_generation"),
            ("POST", "/continue_generation"),
            ("POST", "/flush_cache"),
            ("GET", "/health"),
            ("GET", "/health_generate"),
            ("GET", "/get_model_info"),
            ("GET", "/model_info"),
            ("GET", "/get_weight_version"),
            ("POST", "/update_weight_version"),
            ("POST", "/update_weights_from_disk"),
            ("POST", "/update_weights_from_tensor"),
            ("POST", "/init_weights_update_group"),
            ("POST", "/update_weights_from_distributed"),
            ("POST", "/destroy_weights_update_group"),
            ("POST", "/workers"),
            ("GET", "/workers"),
            ("POST", "/add_worker"),
            ("GET", "/list_workers"),
            ("DELETE", "/workers/1"),
            ("POST", "/remove_worker"),
            ("POST", "/release_memory_occupation"),
            ("POST", "/resume_memory_occupation"),
        ]:
            self.router.add(method, path, self._handle, long_poll=True)

    async def _handle(self, request: Request) -> Response | StreamingResponse:
        body = json.loads(request.body) if request.body else None
        self.requests.append((request.method, request.path, dict(request.headers), body))
        answer = self.answers.get(request.path)
        if answer is None:
            return Response.json({"error": {"message": f"{request.path} not found"}}, status=404)
        out = answer(request)
        if isinstance(out, Response | StreamingResponse):
            return out
        return Response.json(out)

    def bodies(self, path: str) -> list[Any]:
        return [b for _, p, _, b in self.requests if p == path]


@pytest.fixture
async def stand_in() -> AsyncIterator[tuple[StandIn, SGLangClient]]:
    s = StandIn()
    async with HTTPServer(s.router) as server, SGLangClient(server.url, backoff=0.01) as client:
        yield s, client


async def test_generate_sends_sglangs_request_and_parses_both_response_shapes(
    stand_in: tuple[StandIn, SGLangClient],
) -> None:
    s, client = stand_in
    s.answers["/generate"] = lambda r: OLDER
    params = SamplingParams(max_new_tokens=3, temperature=0.5, stop=["</a>"], seed=11)
    old = await client.generate([1, 2, 3, 4], params, rid="g1/0/agent/2")
    assert old.output_ids == [17, 10, 17] and old.logprobs == [-0.5, -0.25, -0.125]
    assert old.finish_reason.type == "length" and old.finish_reason.length == 3
    assert old.weight_version == "default" and old.prompt_tokens == 4
    method, path, headers, body = s.requests[-1]
    assert (method, path) == ("POST", "/generate")
    assert body["input_ids"] == [1, 2, 3, 4] and body["rid"] == "g1/0/agent/2"
    assert body["return_logprob"] is True and body["stream"] is False
    assert body["sampling_params"]["temperature"] == 0.5
    assert body["sampling_params"]["stop"] == ["</a>"]
    assert body["sampling_params"]["sampling_seed"] == 11
    assert body["sampling_params"]["skip_special_tokens"] is False
    assert headers["x-smg-routing-key"] == "g1/0/agent"  # the episode: sticky routing

    s.answers["/generate"] = lambda r: NEWER
    new = await client.generate([1, 2], SamplingParams(), routing_key="ep-9")
    assert new.output_ids == [5, 2] and new.logprobs == [-0.0625, -1.5]
    assert new.finish_reason.type == "stop" and new.finish_reason.matched == 2
    assert new.weight_version == "7" and new.cached_tokens == 3
    assert s.requests[-1][2]["x-smg-routing-key"] == "ep-9"


async def test_batch_keeps_order_and_names_requests(
    stand_in: tuple[StandIn, SGLangClient],
) -> None:
    s, client = stand_in
    s.answers["/generate"] = lambda r: [OLDER, NEWER]
    out = await client.generate_batch([[1, 2], [3]], SamplingParams(), rid="b")
    assert [c.output_ids for c in out] == [[17, 10, 17], [5, 2]]
    body = s.bodies("/generate")[-1]
    assert body["input_ids"] == [[1, 2], [3]] and body["rid"] == ["b_0", "b_1"]
    s.answers["/generate"] = lambda r: [OLDER]
    with pytest.raises(SGLangError, match="batch of 2"):
        await client.generate_batch([[1, 2], [3]], SamplingParams())


def _events(chunks: list[dict[str, Any]]) -> StreamingResponse:
    async def gen() -> AsyncIterator[bytes]:
        for c in chunks:
            yield sse(json.dumps(c))
        yield sse("[DONE]")

    return StreamingResponse(gen())


def _chunk(
    ids: list[int], lps: list[float], total: int, version: str, finish: Any = None
) -> dict[str, Any]:
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "completion_tokens": total,
            "weight_version": version,
            "finish_reason": finish,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(lps, ids, strict=True)],
        },
    }


@pytest.mark.parametrize("mode", ["cumulative", "incremental"])
async def test_streaming_either_way_and_version_spans(
    stand_in: tuple[StandIn, SGLangClient], mode: str
) -> None:
    s, client = stand_in
    ids, lps = [4, 4, 5, 6, 2], [-0.5, -0.25, -1.0, -2.0, -0.125]
    versions = ["3", "3", "4", "4", "4"]
    cuts = [(0, 2), (2, 3), (3, 5)]
    chunks = []
    for k, (a, b) in enumerate(cuts):
        lo = 0 if mode == "cumulative" else a
        finish = {"type": "stop", "matched": 2} if k == len(cuts) - 1 else None
        chunks.append(_chunk(ids[lo:b], lps[lo:b], b, versions[b - 1], finish))
    s.answers["/generate"] = lambda r: _events(chunks)
    got = [c async for c in client.stream([1], SamplingParams(), rid="x")]
    assert [c.output_ids for c in got] == [[4, 4], [5], [6, 2]]
    assert [c.logprobs for c in got] == [[-0.5, -0.25], [-1.0], [-2.0, -0.125]]
    assert got[-1].finish_reason is not None and got[-1].finish_reason.matched == 2
    assert s.bodies("/generate")[-1]["stream"] is True
    done = await client.generate_streamed([1], SamplingParams(), rid="x")
    assert done.output_ids == ids and done.logprobs == lps
    assert done.version_spans == (("3", 2), ("4", 3)) and done.versions == ["3", "4"]


async def test_retries_5xx_and_connection_loss_but_never_4xx(
    stand_in: tuple[StandIn, SGLangClient],
) -> None:
    s, client = stand_in
    calls = 0

    def flaky(r: Request) -> Any:
        nonlocal calls
        calls += 1
        if calls < 3:
            return Response.json({"error": {"message": "overloaded"}}, status=503)
        return NEWER

    s.answers["/generate"] = flaky
    assert (await client.generate([1], SamplingParams())).output_ids == [5, 2]
    assert calls == 3

    calls = 0
    s.answers["/generate"] = lambda r: Response.json(
        {"error": {"message": "top_p must be in (0, 1], got 1.5"}}, status=400
    )
    with pytest.raises(SGLangError, match=r"400: top_p must be in \(0, 1\], got 1.5") as info:
        await client.generate([1], SamplingParams())
    assert info.value.status == 400
    assert len(s.bodies("/generate")) == 4  # 3 + 1: the 4xx was not retried

    s.answers["/generate"] = lambda r: Response.json({"detail": "boom"}, status=500)
    with pytest.raises(SGLangError, match="500: boom"):
        await client.generate([1], SamplingParams())
    assert len(s.bodies("/generate")) == 4 + 1 + client.retries


async def test_a_server_that_is_down_or_dies_mid_request() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        async with SGLangClient(f"http://127.0.0.1:{port}", retries=2, backoff=0.01) as c:
            with pytest.raises(SGLangError, match=rf"127.0.0.1:{port}.*after 3 attempts"):
                await c.generate([1], SamplingParams())
            assert await c.health() is False

    # A server that reads the request, then closes the connection without answering.
    accepted = 0

    async def handle(stream: Any) -> None:
        nonlocal accepted
        accepted += 1
        async with stream:
            await stream.receive(65536)

    async with await anyio.create_tcp_listener(local_host="127.0.0.1") as listener:
        port = listener.extra(anyio.abc.SocketAttribute.local_port)
        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, handle)
            async with SGLangClient(f"http://127.0.0.1:{port}", retries=1, backoff=0.01) as c:
                with pytest.raises(SGLangError, match="after 2 attempts"):
                    await c.generate([1], SamplingParams())
            tg.cancel_scope.cancel()
    assert accepted == 2


async def test_responses_missing_fields_are_clear_errors(
    stand_in: tuple[StandIn, SGLangClient],
) -> None:
    s, client = stand_in
    for broken, field in [
        ({"meta_info": NEWER["meta_info"]}, "output_ids"),
        ({"output_ids": [5, 2]}, "meta_info"),
        ({"output_ids": [5, 2], "meta_info": {"finish_reason": None}}, "output_token_logprobs"),
        (
            {"output_ids": [5, 2], "meta_info": {"output_token_logprobs": [[-1.0, 5], [-1.0, 2]]}},
            "finish_reason",
        ),
    ]:
        s.answers["/generate"] = lambda r, b=broken: b  # type: ignore[misc]
        with pytest.raises(SGLangError, match=f"has no '{field}'"):
            await client.generate([1], SamplingParams())
    wrong = {**NEWER, "output_ids": [5, 3]}
    s.answers["/generate"] = lambda r: wrong
    with pytest.raises(SGLangError, match="other tokens than output_ids"):
        await client.generate([1], SamplingParams())


async def test_bad_input_is_refused_locally(stand_in: tuple[StandIn, SGLangClient]) -> None:
    s, client = stand_in
    with pytest.raises(ConfigError, match="input_ids is empty"):
        await client.generate([], SamplingParams())
    with pytest.raises(ConfigError, match="input_ids must be non-negative ints, got -1"):
        await client.generate([1, -1], SamplingParams())
    with pytest.raises(ConfigError, match=r"input_ids\[1\] is empty"):
        await client.generate_batch([[1], []], SamplingParams())
    with pytest.raises(ConfigError, match="top_p must be in"):
        await client.generate([1], SamplingParams(top_p=1.5))
    with pytest.raises(ConfigError, match="pause mode"):
        await client.pause("later")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="http://"):
        SGLangClient("localhost:30000")
    assert s.requests == []


async def test_control_and_weight_update_calls(stand_in: tuple[StandIn, SGLangClient]) -> None:
    s, client = stand_in
    ok = {"success": True, "message": "ok"}
    for path in [
        "/abort_request",
        "/pause_generation",
        "/continue_generation",
        "/flush_cache",
        "/update_weight_version",
        "/update_weights_from_tensor",
        "/init_weights_update_group",
        "/update_weights_from_distributed",
        "/destroy_weights_update_group",
    ]:
        s.answers[path] = lambda r: ok
    await client.abort("ep/1")
    await client.abort_all()
    assert s.bodies("/abort_request") == [{"rid": "ep/1"}, {"rid": "", "abort_all": True}]
    await client.pause("retract")
    await client.resume()
    await client.flush_cache()
    assert s.bodies("/pause_generation") == [{"mode": "retract"}]
    s.answers["/get_weight_version"] = lambda r: {"weight_version": "5"}
    assert await client.weight_version() == "5"
    await client.update_weight_version("6")
    assert s.bodies("/update_weight_version")[-1]["new_version"] == "6"

    s.answers["/update_weights_from_disk"] = lambda r: {"success": False, "message": "no such dir"}
    with pytest.raises(SGLangError, match="no such dir"):
        await client.update_weights_from_disk("/ckpt/v3", weight_version="3")
    assert s.bodies("/update_weights_from_disk")[-1] == {
        "model_path": "/ckpt/v3",
        "load_format": None,
        "weight_version": "3",
        "flush_cache": True,
        "abort_all_requests": False,
    }
    await client.update_weights_from_tensor(["abc"], weight_version="4")
    await client.init_weights_update_group("10.0.0.1", 29500, 1, 2, group_name="g")
    await client.update_weights_from_distributed(
        ["w"], ["bfloat16"], [(2, 3)], group_name="g", weight_version="4"
    )
    await client.destroy_weights_update_group("g")
    assert s.bodies("/init_weights_update_group")[-1]["world_size"] == 2
    assert s.bodies("/update_weights_from_distributed")[-1]["shapes"] == [[2, 3]]
    with pytest.raises(ConfigError, match="aligned"):
        await client.update_weights_from_distributed(["w"], [], [])

    # Newer servers only have /model_info; the client falls back.
    s.answers["/model_info"] = lambda r: {"model_path": "m", "weight_version": "5"}
    assert (await client.model_info())["model_path"] == "m"


async def test_router_workers_current_and_older_api(
    stand_in: tuple[StandIn, SGLangClient],
) -> None:
    s, client = stand_in
    s.answers["/workers"] = lambda r: (
        Response.json({"status": "accepted"}, status=202)
        if r.method == "POST"
        else {"workers": [{"id": "1", "url": "http://a:1"}]}
    )
    await client.add_worker("http://a:1")
    assert await client.list_workers() == ["http://a:1"]
    del s.answers["/workers"]
    s.answers["/add_worker"] = lambda r: Response.text("ok")
    s.answers["/list_workers"] = lambda r: {"urls": ["http://b:2"]}
    await client.add_worker("http://b:2")
    assert await client.list_workers() == ["http://b:2"]


async def test_remove_worker_current_and_older_api(
    stand_in: tuple[StandIn, SGLangClient],
) -> None:
    s, client = stand_in
    s.answers["/workers"] = lambda r: {"workers": [{"id": "1", "url": "http://a:1"}]}
    s.answers["/workers/1"] = lambda r: Response.json({"status": "accepted"}, status=202)
    assert await client.remove_worker("http://a:1")
    assert not await client.remove_worker("http://elsewhere:1")
    assert [(m, p) for m, p, _, _ in s.requests if m == "DELETE"] == [("DELETE", "/workers/1")]
    del s.answers["/workers"]
    s.answers["/list_workers"] = lambda r: {"urls": ["http://b:2"]}
    s.answers["/remove_worker"] = lambda r: Response.text("ok")
    assert await client.remove_worker("http://b:2")
    assert not await client.remove_worker("http://a:1")
    assert len(s.bodies("/remove_worker")) == 1


async def test_memory_release_and_resume_send_sglangs_tags(
    stand_in: tuple[StandIn, SGLangClient],
) -> None:
    s, client = stand_in
    s.answers["/release_memory_occupation"] = lambda r: None
    s.answers["/resume_memory_occupation"] = lambda r: None
    await client.release_memory_occupation(["kv_cache", "weights"])
    await client.release_memory_occupation()
    await client.resume_memory_occupation(["kv_cache"])
    assert s.bodies("/release_memory_occupation") == [{"tags": ["kv_cache", "weights"]}, {}]
    assert s.bodies("/resume_memory_occupation") == [{"tags": ["kv_cache"]}]


async def test_wait_healthy_polls_then_gives_up(stand_in: tuple[StandIn, SGLangClient]) -> None:
    s, client = stand_in
    polls = 0

    def starting(r: Request) -> Response:
        nonlocal polls
        polls += 1
        return Response.json({}, status=503 if polls < 3 else 200)

    s.answers["/health"] = starting
    await client.wait_healthy(timeout=5, interval=0.01)
    assert polls == 3
    s.answers["/health_generate"] = lambda r: Response.json({}, status=503)
    with pytest.raises(SGLangError, match=r"not healthy within 0\.1 s"):
        await client.wait_healthy(timeout=0.1, generate=True, interval=0.01)
