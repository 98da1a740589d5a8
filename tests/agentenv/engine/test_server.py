"""`agentenv serve` (EngineServer) against hostile requests: every body is checked at the
HTTP boundary (400 naming the field), a request that still fails inside the engine fails
alone, and the server stays healthy whatever JSON it is sent (hypothesis)."""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import anyio
import anyio.lowlevel
import httpx
import pytest
from anyio.from_thread import start_blocking_portal
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv import ConfigError
from agentenv.engine import Engine, EngineServer, resolve_model

pytestmark = [pytest.mark.timeout(300)]

PROMPT = [1, 504, 3458, 314, 253, 1345, 28, 2817, 5122, 30]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model("smollm2-135m")


@pytest.fixture
async def server(model_dir: Path) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    async with (
        Engine(model_dir, context_length=64) as engine,
        EngineServer(engine) as served,
        httpx.AsyncClient(base_url=served.url, timeout=60) as http,
    ):
        yield engine, http


async def _post(http: httpx.AsyncClient, path: str, body: Any) -> httpx.Response:
    # json.dumps writes NaN and Infinity as JSON's common extension does (Python, JS).
    return await http.post(
        path, content=json.dumps(body), headers={"content-type": "application/json"}
    )


async def _still_serving(http: httpx.AsyncClient) -> None:
    assert (await http.get("/health")).status_code == 200
    sampling = {"max_new_tokens": 2, "ignore_eos": True}  # sampled: may draw the stop token
    r = await _post(http, "/generate", {"input_ids": PROMPT, "sampling_params": sampling})
    assert r.status_code == 200 and len(r.json()["output_ids"]) == 2


def _generate(**sampling: Any) -> dict[str, Any]:
    return {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3, **sampling}}


BAD_GENERATE = [
    # Each of these ended the engine loop (and the process with it).
    (
        _generate(sampling_seed=math.nan),
        "sampling_params.sampling_seed must be an integer, got nan",
    ),
    (_generate(sampling_seed="%d"), "sampling_params.sampling_seed must be an integer, got '%d'"),
    (
        _generate(stop_token_ids=[1000000], min_new_tokens=2),
        "sampling_params.stop_token_ids[0] must be a token id [0, 49152), got 1000000",
    ),
    (_generate(top_k=1e30, top_p=0.5), "sampling_params.top_k must be an integer, got 1e+30"),
    # Accepted though invalid (ran to the context length, or truncated silently).
    (
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": math.nan}},
        "max_new_tokens must be an integer, got nan",
    ),
    (
        {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2.5}},
        "max_new_tokens must be an integer, got 2.5",
    ),
    (_generate(top_k=math.nan), "sampling_params.top_k must be an integer, got nan"),
    # Answered 500.
    (
        {"input_ids": PROMPT, "sampling_params": "x"},
        "sampling_params must be a JSON object, got 'x'",
    ),
    (
        {"input_ids": PROMPT, "sampling_params": [1]},
        "sampling_params must be a JSON object, got [1]",
    ),
    (_generate(sampling_seed="abc"), "sampling_params.sampling_seed must be an integer, got 'abc'"),
    # And their neighbours.
    (
        _generate(temperature=math.inf),
        "sampling_params.temperature must be a finite number, got inf",
    ),
    (_generate(temperature=-1), "temperature must be non-negative, got -1"),
    (_generate(top_p=0), "top_p must be in (0, 1], got 0"),
    (_generate(top_k=-2), "top_k must be -1 (disable), or at least 1, got -2"),
    (_generate(ignore_eos=1), "sampling_params.ignore_eos must be true or false, got 1"),
    (_generate(max_new_tokens=True), "sampling_params.max_new_tokens must be an integer, got True"),
    (_generate(stop=[""]), "sampling_params.stop must hold non-empty strings"),
    (_generate(stop=[1]), "sampling_params.stop[0] must be a string, got 1"),
    ({"input_ids": [1, -1]}, "input_ids[1] must be a token id [0, 49152), got -1"),
    ({"input_ids": [1, 2.0]}, "input_ids[1] must be a token id [0, 49152), got 2.0"),
    ({"input_ids": [[1], [49152]]}, "input_ids[1][0] must be a token id [0, 49152), got 49152"),
    ({"input_ids": [[1], 2]}, "input_ids must be a list of token ids or a list of such lists"),
    ({"input_ids": "1 2"}, "input_ids must be a list of token ids or a list of such lists"),
    ({"input_ids": [[1], []]}, "input_ids[1] cannot be empty"),
    ({"text": 5}, "text must be a string, got 5"),
    ({"text": "a", "input_ids": [1]}, "text and input_ids cannot be provided at the same time"),
    ({}, "Either text or input_ids should be provided"),
    ({"input_ids": PROMPT, "rid": 7}, "rid must be a string, got 7"),
    ({"input_ids": PROMPT, "return_logprob": "false"}, "return_logprob must be true or false"),
    ({"input_ids": PROMPT, "stream": 1}, "stream must be true or false, got 1"),
    (
        {"input_ids": [1] * 60, "sampling_params": {"max_new_tokens": 10}},
        "exceeds the model's maximum context length",
    ),
]


@pytest.mark.anyio
async def test_every_reported_body_is_refused_naming_the_field_and_the_server_goes_on(
    server: tuple[Engine, httpx.AsyncClient],
) -> None:
    engine, http = server
    for body, message in BAD_GENERATE:
        r = await _post(http, "/generate", body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert message in r.json()["error"]["message"], (body, r.json())
        await _still_serving(http)
    for raw, message in [
        (b"[" * 100_000 + b"]" * 100_000, "the request body is not JSON"),
        (b"{", "the request body is not JSON"),
        (b"[1]", "the request body must be a JSON object, got [1]"),
    ]:
        r = await http.post("/generate", content=raw)
        assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert engine.healthy
    await _still_serving(http)


@pytest.mark.anyio
async def test_no_sampling_parameter_is_ignored_silently(
    server: tuple[Engine, httpx.AsyncClient],
) -> None:
    engine, http = server
    refused = [
        # Not SGLang's name (SGLang refuses it too): named, with the supported ones.
        (_generate(seed=7), "sampling_params.seed is not a sampling parameter (the seed is "),
        (_generate(sede=7), "supported: max_new_tokens, temperature, top_p, top_k, min_p"),
        # SGLang's, not implemented here: refused unless neutral.
        (_generate(frequency_penalty=0.5), "sampling_params.frequency_penalty=0.5 is not "),
        (_generate(n=2), "sampling_params.n=2 is not supported by this engine"),
        (_generate(regex="a+"), "sampling_params.regex='a+' is not supported"),
        (_generate(no_stop_trim=False), "sampling_params.no_stop_trim=false is not supported"),
        # A text that cannot fit the context: refused before it is tokenized.
        ({"text": "hello world " * 100_000}, "is longer than the model's context length"),
        # Nested deeper than the server walks (but within the JSON decoder's own limit).
        (
            {"input_ids": PROMPT, "rid": json.loads("[" * 500 + "]" * 500)},
            "deeper than 128 levels",
        ),
    ]
    for body, message in refused:
        r = await _post(http, "/generate", body)
        assert r.status_code == 400, (body, r.status_code, r.text)
        assert message in r.json()["error"]["message"], (body, r.json())
    # Neutral values and the decoding flags are accepted; skip_special_tokens is honoured.
    sampling = {"max_new_tokens": 4, "min_new_tokens": 4, "temperature": 0}
    neutral = {"frequency_penalty": 0, "repetition_penalty": 1.0, "n": 1, "regex": None}
    flags = {"spaces_between_special_tokens": False, "no_stop_trim": True}
    for skip in (False, True):
        body = {
            "input_ids": PROMPT,
            "sampling_params": {**sampling, **neutral, **flags, "skip_special_tokens": skip},
        }
        r = await _post(http, "/generate", body)
        assert r.status_code == 200, r.text
        ids = r.json()["output_ids"]
        want = engine.tokenizer.decode(ids, skip_special_tokens=skip)
        assert r.json()["text"] == want
    await _still_serving(http)


@pytest.mark.anyio
async def test_the_control_endpoints_check_their_bodies_too(
    server: tuple[Engine, httpx.AsyncClient],
) -> None:
    engine, http = server
    cases = [
        ("/abort_request", {"rid": 5}, "rid must be a string, got 5"),
        ("/abort_request", {"abort_all": "yes"}, "abort_all must be true or false, got 'yes'"),
        ("/pause_generation", {"mode": 3}, "mode must be 'abort', 'retract' or 'in_place', got 3"),
        ("/update_weights_from_disk", {}, "model_path is required"),
        ("/update_weights_from_disk", {"model_path": ["/"]}, "model_path must be a string"),
        (
            "/update_weights_from_disk",
            {"model_path": "/", "weight_version": 3},
            "weight_version must be a string, got 3",
        ),
        ("/update_weights_from_disk", {"model_path": "/"}, "'/' has no *.safetensors weights"),
        ("/update_weight_version", {"new_version": None}, "new_version must be a string, got None"),
        ("/update_weight_version", {}, "new_version is required"),
        (
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": 70000,
                "rank_offset": 1,
                "world_size": 2,
            },
            "master_port must be less than or equal to 65535, got 70000",
        ),
        (
            "/init_weights_update_group",
            {"master_address": "127.0.0.1", "master_port": 1.5, "rank_offset": 1, "world_size": 2},
            "master_port must be an integer, got 1.5",
        ),
        (
            "/init_weights_update_group",
            {
                "master_address": "127.0.0.1",
                "master_port": 29500,
                "rank_offset": 1,
                "world_size": 2,
                "timeout": math.nan,
            },
            "timeout must be a finite number, got nan",
        ),
        (
            "/update_weights_from_distributed",
            {"names": "x", "dtypes": [], "shapes": []},
            "names must be a list, got 'x'",
        ),
        (
            "/update_weights_from_distributed",
            {"names": ["x"], "dtypes": ["float32"], "shapes": [[1.5]]},
            "shapes[0][0] must be an integer, got 1.5",
        ),
        ("/destroy_weights_update_group", {"group_name": []}, "group_name must be a string"),
        ("/release_memory_occupation", {"tags": "kv_cache"}, "tags must be a list"),
        ("/release_memory_occupation", {"tags": ["gpu"]}, "tags[0] must be 'weights'"),
        ("/resume_memory_occupation", {"tags": [1]}, "tags[0] must be 'weights'"),
    ]
    for path, body, message in cases:
        r = await _post(http, path, body)
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        data = r.json()
        text = data["message"] if "message" in data else data["error"]["message"]
        assert message in text, (path, body, data)
    assert engine.weight_version == "default"
    await _still_serving(http)


@pytest.mark.anyio
async def test_released_memory_refuses_generation_until_resumed(
    server: tuple[Engine, httpx.AsyncClient], model_dir: Path
) -> None:
    """SGLang's colocated protocol: release, (train), update the weights, resume."""
    engine, http = server
    r = await _post(http, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert r.status_code == 200 and r.json() is None
    assert engine.released == {"kv_cache"}
    r = await _post(http, "/generate", _generate())
    assert r.status_code == 400
    assert "memory is released (kv_cache)" in r.json()["error"]["message"]
    assert "/resume_memory_occupation" in r.json()["error"]["message"]
    assert (await http.get("/health")).status_code == 200  # alive: not an engine to replace
    r = await _post(http, "/release_memory_occupation", {})  # no tags: everything
    assert engine.released == {"kv_cache", "weights", "cuda_graph"}
    # The weights are updated while released (the trainer's new weights), then resumed.
    body = {"model_path": str(model_dir), "weight_version": "7"}
    r = await _post(http, "/update_weights_from_disk", body)
    assert r.status_code == 200 and r.json()["success"], r.text
    r = await _post(http, "/resume_memory_occupation", {"tags": ["weights", "cuda_graph"]})
    assert r.status_code == 200 and engine.released == {"kv_cache"}
    assert (await _post(http, "/generate", _generate())).status_code == 400
    assert (await http.get("/resume_memory_occupation")).status_code == 200
    assert engine.released == set()
    r = await _post(http, "/generate", _generate())
    assert r.status_code == 200 and r.json()["meta_info"]["weight_version"] == "7"
    await _still_serving(http)


@pytest.mark.anyio
async def test_memory_is_released_only_when_idle(server: tuple[Engine, httpx.AsyncClient]) -> None:
    engine, http = server
    await engine.pause("in_place")  # a request waits in the engine
    async with anyio.create_task_group() as tg:
        tg.start_soon(_post, http, "/generate", _generate(max_new_tokens=2))
        with anyio.fail_after(30):
            while not engine.running:
                await anyio.lowlevel.checkpoint()
        r = await _post(http, "/release_memory_occupation", {})
        assert r.status_code == 400
        assert "1 requests are running" in r.json()["error"]["message"]
        assert engine.released == set()
        await engine.resume()
    with pytest.raises(ConfigError, match="unknown memory tags"):
        await engine.release_memory(["gpu"])


@pytest.mark.anyio
async def test_sizes_seeds_and_versions_are_bounded(
    server: tuple[Engine, httpx.AsyncClient],
) -> None:
    engine, http = server
    group = {"master_address": "127.0.0.1", "master_port": 1, "backend": "gloo"}
    seed = "sampling_params.sampling_seed must be in [0, 2**63)"
    cases = [
        # The process group's constructor failed on these (500).
        (
            "/init_weights_update_group",
            group | {"rank_offset": 1, "world_size": 2**70},
            "world_size must be less than or equal to 65536",
        ),
        (
            "/init_weights_update_group",
            group | {"rank_offset": 2**70, "world_size": 4},
            "rank_offset must be in [1, 3]",
        ),
        # Accepted, then reported in every answer.
        ("/update_weight_version", {"new_version": ""}, "new_version must be 1 to 256 printable"),
        ("/update_weight_version", {"new_version": "\ud800"}, "no control characters or lone"),
        ("/update_weight_version", {"new_version": "a\nb"}, "new_version must be 1 to 256"),
        ("/update_weight_version", {"new_version": "v" * 257}, "new_version must be 1 to 256"),
        (
            "/update_weights_from_disk",
            {"model_path": "/", "weight_version": ""},
            "weight_version must be 1 to 256 printable",
        ),
        # Wrapped silently onto another seed.
        ("/generate", _generate(sampling_seed=2**64), seed),
        ("/generate", _generate(sampling_seed=2**63), seed),
        ("/generate", _generate(sampling_seed=-1), seed),
        ("/generate", _generate(sampling_seed=-(2**70)), seed),
        # A batch of any size was accepted.
        (
            "/generate",
            {"input_ids": [[1]] * 4097},
            "input_ids holds 4097 prompts; this server takes at most 4096 per request",
        ),
        ("/generate", {"text": ["a"] * 4097}, "text holds 4097 prompts"),
    ]
    for path, body, message in cases:
        r = await _post(http, path, body)
        assert r.status_code == 400, (path, body, r.status_code, r.text)
        data = r.json()
        text = data["message"] if "message" in data else data["error"]["message"]
        assert message in text, (path, body, data)
    assert engine.weight_version == "default"
    # The largest seed is a seed of its own, and a top_p that is 0 in float32 is greedy
    # (it masked every token, and the draw fell on the last id).
    greedy = await _post(http, "/generate", _generate(temperature=0))
    for sampling in ({"sampling_seed": 2**63 - 1}, {"top_p": 1e-300, "sampling_seed": 3}):
        r = await _post(http, "/generate", _generate(**sampling))
        assert r.status_code == 200, r.text
    assert r.json()["output_ids"] == greedy.json()["output_ids"]
    async with EngineServer(engine, max_prompts=2) as small:
        r = await http.post(f"{small.url}/generate", json={"input_ids": [[1], [2], [3]]})
        assert r.status_code == 400 and "at most 2 per request" in r.text, r.text
        r = await http.post(
            f"{small.url}/generate",
            json={"input_ids": [[1], [2]], "sampling_params": {"max_new_tokens": 1}},
        )
        assert r.status_code == 200 and len(r.json()) == 2, r.text
    await _still_serving(http)


@pytest.mark.anyio
async def test_a_request_that_fails_inside_the_engine_fails_alone(
    server: tuple[Engine, httpx.AsyncClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past the schema, a request that still breaks a step (a bug, a device error) gets an
    error answer; the requests beside it finish and the engine keeps serving."""
    engine, http = server
    import agentenv.engine._engine as engine_module

    real_sample = engine_module.sample

    def sample(logits: Any, rows: Any) -> Any:
        if any(r.seed == 666 for r in rows):
            raise RuntimeError("injected sampling failure")
        return real_sample(logits, rows)

    monkeypatch.setattr(engine_module, "sample", sample)
    real_prefill = engine.model.prefill

    def prefill(seqs: list[Any], *args: Any) -> Any:
        if any(seq.tokens == [7, 7, 7] for seq in seqs):
            raise RuntimeError("injected prefill failure")
        return real_prefill(seqs, *args)

    monkeypatch.setattr(engine.model, "prefill", prefill)
    sampled = {"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}
    answers: dict[str, httpx.Response] = {}

    async def send(name: str, body: dict[str, Any]) -> None:
        answers[name] = await _post(http, "/generate", body)

    async with anyio.create_task_group() as tg:
        tg.start_soon(
            send,
            "bad_seed",
            {"input_ids": PROMPT, "sampling_params": {**sampled, "sampling_seed": 666}},
        )
        tg.start_soon(send, "bad_prompt", {"input_ids": [7, 7, 7], "sampling_params": sampled})
        for i in range(3):
            tg.start_soon(
                send,
                f"ok{i}",
                {"input_ids": PROMPT, "sampling_params": {**sampled, "sampling_seed": i}},
            )
    for name in ("bad_seed", "bad_prompt"):
        r = answers[name]
        assert r.status_code == 500, (name, r.text)
        assert "the engine failed on this request: RuntimeError: injected" in r.text
    for i in range(3):
        r = answers[f"ok{i}"]
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 6, r.text

    # A decode step that fails fails the requests in it; the engine goes on.
    real_decode = engine.model.decode
    calls = 0

    def decode(*args: Any) -> Any:
        nonlocal calls
        calls += 1
        if calls == 2:
            raise RuntimeError("injected decode failure")
        return real_decode(*args)

    monkeypatch.setattr(engine.model, "decode", decode)
    r = await _post(http, "/generate", {"input_ids": PROMPT, "sampling_params": sampled})
    assert r.status_code == 500 and "injected decode failure" in r.text
    assert engine.healthy and engine.running == 0
    await _still_serving(http)


# -- any JSON at all ----------------------------------------------------------------------
GENERATE_KEYS = ["text", "input_ids", "sampling_params", "rid", "return_logprob", "stream"]
SAMPLING_KEYS = [
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "min_new_tokens",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "sampling_seed",
    "seed",
    "n",
]
CONTROL = {
    # Not /init_weights_update_group: a valid body waits `timeout` s for a rendezvous.
    "/abort_request": ["rid", "abort_all"],
    "/pause_generation": ["mode"],
    "/update_weights_from_disk": ["model_path", "weight_version", "abort_all_requests"],
    "/update_weight_version": ["new_version", "abort_all_requests"],
    "/update_weights_from_distributed": ["names", "dtypes", "shapes", "group_name"],
    "/destroy_weights_update_group": ["group_name"],
    "/flush_cache": [],
    "/continue_generation": [],
    "/release_memory_occupation": ["tags"],
    "/resume_memory_occupation": ["tags"],
}

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.integers(min_value=-2, max_value=40)
    | st.floats(allow_nan=True, allow_infinity=True)
    | st.text(max_size=12)
    | st.sampled_from(["abort", "in_place", "float32", "/", "."])
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
token_ids = st.lists(st.integers(min_value=-1, max_value=49153), max_size=6)
plausible = json_values | token_ids | st.lists(token_ids, min_size=1, max_size=3)
sampling = st.dictionaries(
    st.sampled_from(SAMPLING_KEYS), plausible | st.integers(0, 8), max_size=6
)
generate_bodies = st.dictionaries(
    st.sampled_from(GENERATE_KEYS), plausible | sampling, max_size=5
) | st.fixed_dictionaries({"input_ids": token_ids, "sampling_params": sampling})


@st.composite
def requests(draw: st.DrawFn) -> tuple[str, bytes]:
    if draw(st.integers(0, 3)):
        path, body = "/generate", draw(generate_bodies | json_values)
    else:
        path = draw(st.sampled_from(sorted(CONTROL)))
        keys = CONTROL[path]
        body = draw(
            st.dictionaries(st.sampled_from(keys), json_values, max_size=3) if keys else json_values
        )
    raw = json.dumps(body).encode() if draw(st.integers(0, 9)) else draw(st.binary(max_size=20))
    return path, raw


@pytest.fixture(scope="module")
def live_url(model_dir: Path) -> Iterator[str]:
    """A server on its own event loop thread, for a synchronous hypothesis test."""
    with start_blocking_portal() as portal:
        engine = portal.call(lambda: Engine(model_dir, context_length=32))
        with portal.wrap_async_context_manager(engine):
            served = portal.call(EngineServer, engine)
            with portal.wrap_async_context_manager(served):
                yield served.url


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(call=requests())
def test_any_json_gets_a_2xx_or_4xx_and_the_server_stays_healthy(
    live_url: str, model_dir: Path, call: tuple[str, bytes]
) -> None:
    path, raw = call
    with httpx.Client(base_url=live_url, timeout=60) as http:
        r = http.post(path, content=raw)
        assert 200 <= r.status_code < 500, (path, raw[:300], r.status_code, r.text[:500])
        http.post("/continue_generation")  # undo a pause the body may have asked for
        http.post("/resume_memory_occupation")  # and a release
        if path == "/release_memory_occupation" and r.status_code == 200:
            # On CPU released weights are freed: the next full update loads them again.
            reload = {"model_path": str(model_dir)}
            assert http.post("/update_weights_from_disk", json=reload).status_code == 200
        assert http.get("/health").status_code == 200
        body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 1}}
        assert http.post("/generate", json=body).status_code == 200


# -- the API key --------------------------------------------------------------------------
@pytest.mark.anyio
async def test_with_an_api_key_every_route_but_health_needs_it(
    model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from agentenv import SamplingParams
    from agentenv.sglang import SGLangClient, SGLangError

    key = "s3cret-key"
    async with (
        Engine(model_dir, context_length=64) as engine,
        EngineServer(engine, api_key=key) as served,
        httpx.AsyncClient(base_url=served.url, timeout=30) as http,
    ):
        body = json.dumps({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        routes = [
            ("POST", "/generate", body),
            ("GET", "/get_model_info", None),
            ("GET", "/get_server_info", None),
            ("GET", "/get_weight_version", None),
            ("POST", "/abort_request", '{"abort_all": true}'),
            ("POST", "/pause_generation", '{"mode": "abort"}'),
            ("POST", "/continue_generation", None),
            ("POST", "/flush_cache", None),
            ("POST", "/update_weights_from_disk", '{"model_path": "/tmp"}'),
            ("POST", "/update_weight_version", '{"new_version": "evil"}'),
            ("POST", "/init_weights_update_group", '{"master_address": "10.9.9.9"}'),
            ("POST", "/update_weights_from_distributed", "{}"),
            ("POST", "/destroy_weights_update_group", "{}"),
        ]
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": key},
                        {"authorization": f"Basic {key}"}, {"x-api-key": "s3cret"}):  # fmt: skip
            for method, path, content in routes:
                r = await http.request(method, path, content=content, headers=headers)
                assert r.status_code == 401, (headers, path, r.status_code, r.text)
                assert "missing or wrong API key: send 'Authorization: Bearer <key>'" in r.text
                assert r.headers["www-authenticate"] == "Bearer"
        assert engine.weight_version == "default" and not engine._paused
        # Health probes pass without a key, as SGLang's.
        assert (await http.get("/health")).status_code == 200
        assert (await http.get("/health_generate")).status_code == 200
        # The key, as a bearer token (any case of the scheme) or X-API-Key.
        for headers in ({"authorization": f"Bearer {key}"}, {"authorization": f"bearer {key}"},
                        {"x-api-key": key}):  # fmt: skip
            r = await http.post("/generate", content=body, headers=headers)
            assert r.status_code == 200 and len(r.json()["output_ids"]) == 2
        # SGLangClient sends it.
        async with SGLangClient(served.url, api_key=key, retries=0) as client:
            await client.wait_healthy(timeout=10)
            c = await client.generate(PROMPT, SamplingParams(max_new_tokens=2))
            assert len(c.output_ids) == 2
            streamed = await client.generate_streamed(PROMPT, SamplingParams(max_new_tokens=2))
            assert len(streamed.output_ids) == 2
            await client.update_weight_version("2")
            assert await client.weight_version() == "2"
        # agentenv eval --model http://... takes it from $AGENTENV_API_KEY.
        from agentenv._policies import open_policy

        with pytest.MonkeyPatch.context() as env:
            env.setenv("AGENTENV_API_KEY", key)
            async with open_policy(served.url, tokenizer="smollm2-135m") as (policy, _):
                c = await policy.generate(PROMPT, SamplingParams(max_new_tokens=2))
                assert len(c.output_ids) == 2
        async with SGLangClient(served.url, retries=0) as keyless:
            assert await keyless.health()
            with pytest.raises(SGLangError, match="401: missing or wrong API key"):
                await keyless.generate(PROMPT, SamplingParams(max_new_tokens=2))
    assert "WITHOUT an API key" not in caplog.text


@pytest.mark.anyio
async def test_an_open_server_without_a_key_warns(
    model_dir: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from agentenv._http import _auth

    assert _auth.is_loopback("127.0.0.1") and _auth.is_loopback("::1")
    assert _auth.is_loopback("localhost") and not _auth.is_loopback("0.0.0.0")
    assert not _auth.is_loopback("10.1.2.3") and not _auth.is_loopback("node7")
    # Bound on loopback for the test, seen as another interface.
    monkeypatch.setattr(_auth, "is_loopback", lambda host: False)
    async with Engine(model_dir, context_length=64) as engine:
        async with EngineServer(engine, api_key="k"):
            pass
        assert "WITHOUT an API key" not in caplog.text
        async with EngineServer(engine):
            pass
    assert "agentenv serve listens on 127.0.0.1" in caplog.text
    assert "WITHOUT an API key" in caplog.text and "Set --api-key" in caplog.text


@pytest.fixture
async def chat_server(model_dir: Path) -> AsyncIterator[tuple[Engine, httpx.AsyncClient]]:
    """The engine with OpenAI's /v1 routes, as agentenv serve runs it."""
    from agentenv import ChatTokenizer
    from agentenv.endpoint import serve_chat

    tokenizer = ChatTokenizer.load(str(model_dir))
    async with Engine(model_dir, context_length=64) as engine:

        def routes(router: Any) -> None:
            serve_chat(router, engine, tokenizer, model="smollm2-135m", context_length=64)

        async with (
            EngineServer(engine, extra_routes=routes) as served,
            httpx.AsyncClient(base_url=served.url, timeout=60) as http,
        ):
            yield engine, http


@pytest.mark.anyio
async def test_chat_completions_through_the_model_template(
    chat_server: tuple[Engine, httpx.AsyncClient],
) -> None:
    import openai

    _, http = chat_server
    models = (await http.get("/v1/models")).json()
    assert models["data"][0]["id"] == "smollm2-135m"
    url = str(http.base_url).rstrip("/")
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
    async with client:
        r = await client.chat.completions.create(
            model="smollm2-135m",
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=4,
            temperature=0,
            logprobs=True,
        )
        choice = r.choices[0]
        assert r.usage is not None and r.usage.completion_tokens <= 4
        assert choice.finish_reason in ("stop", "length")
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert len(choice.logprobs.content) == r.usage.completion_tokens
        assert all(c.logprob <= 0.0 for c in choice.logprobs.content)
        # Greedy through /generate on the template's rendering gives the same tokens.
        from agentenv import ChatTokenizer

        tok = ChatTokenizer.load("smollm2-135m")
        prompt = tok.encode(
            tok.render([{"role": "user", "content": "Say hi"}], add_generation_prompt=True)
        )
        assert r.usage.prompt_tokens == len(prompt)
        g = await _post(
            http,
            "/generate",
            {"input_ids": prompt, "sampling_params": {"max_new_tokens": 4, "temperature": 0}},
        )
        ids = g.json()["output_ids"]
        assert [tok.decode([t]) for t in ids] == [c.token for c in choice.logprobs.content]
        chunks = [
            c
            async for c in await client.chat.completions.create(
                model="smollm2-135m",
                messages=[{"role": "user", "content": "Say hi"}],
                max_tokens=4,
                temperature=0,
                stream=True,
            )
        ]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == choice.message.content
        response = await client.responses.create(
            model="smollm2-135m", input="Say hi", max_output_tokens=4, temperature=0
        )
        assert response.output_text == choice.message.content
        with pytest.raises(openai.BadRequestError, match="n=1"):
            await client.chat.completions.create(
                model="smollm2-135m", messages=[{"role": "user", "content": "x"}], n=2
            )
