"""``agentenv bench http`` in seconds: the plain aiohttp application serves agentenv's
handlers with the same answers as agentenv's HTTPServer, every workload runs on both, and
the layer's budget follows the measured ratios (the numbers are in docs/benchmarks.md)."""

from __future__ import annotations

import os
from typing import Any

import httpx
import pytest

from benchmarks.http_server import (
    SERVERS,
    TOKEN,
    WORKLOADS,
    _summarise,
    run_workload,
    serving,
)

pytestmark = [pytest.mark.timeout(60)]

AUTH = {"authorization": f"Bearer {TOKEN}"}
# (service, method, path, headers, body): answers that must not depend on the server.
REQUESTS = [
    ("buffer", "GET", "/v1/statistics", {}, None),  # no token: 401 before the body
    ("buffer", "GET", "/v1/statistics", AUTH, None),
    ("buffer", "GET", "/v1/prompts_to_start?groups=-1", AUTH, None),  # query validated
    ("buffer", "POST", "/v1/get_batch", AUTH, b"not json"),
    ("buffer", "POST", "/v1/ack", AUTH, b'{"batch": "nope", "step": 0}'),
    ("buffer", "POST", "/v1/put_group", AUTH, b"\x01\x02"),  # not an encoded group
    ("engine", "GET", "/health", {}, None),
    ("engine", "GET", "/get_model_info", {}, None),
    (
        "engine",
        "POST",
        "/generate",
        {},
        b'{"input_ids": [1, 2], "sampling_params": {"top_k": 0.5}}',
    ),
]


async def _answer(url: str, method: str, path: str, headers: dict[str, str], body: Any) -> Any:
    async with httpx.AsyncClient(base_url=url, timeout=30) as http:
        r = await http.request(method, path, headers=headers, content=body)
    payload = r.json() if r.content else None
    return r.status_code, r.headers.get("content-type"), r.headers.get("www-authenticate"), payload


@pytest.mark.anyio
@pytest.mark.parametrize(("service", "method", "path", "headers", "body"), REQUESTS)
async def test_plain_aiohttp_answers_as_agentenvs_server(
    service: str, method: str, path: str, headers: dict[str, str], body: bytes | None
) -> None:
    answers = []
    for server in SERVERS:
        async with serving(service, server) as url:
            answers.append(await _answer(url, method, path, headers, body))
    ours, theirs = answers
    assert ours == theirs
    assert ours[0] in (200, 204) or ours[3]["error"]["message"]


@pytest.mark.anyio
@pytest.mark.parametrize("server", SERVERS)
@pytest.mark.parametrize("workload", sorted(WORKLOADS))
async def test_every_workload_runs_on_both_servers(workload: str, server: str) -> None:
    n = 32 if workload == "buffer_put" else 40  # groups (two batches), or requests
    async with serving(WORKLOADS[workload], server) as url:
        r = await run_workload(url, workload, n, 4, server_pid=os.getpid())
    assert r["workload"] == workload and r["requests_per_s"] > 0
    if workload == "buffer_put":
        # two get_batch and two ack requests, and the puts, coalesced into put_groups
        assert r["samples"] == 256 and 5 <= r["requests"] <= 4 + 32
    else:
        assert r["requests"] == n
    assert r["server_cpu_us_per_request"] >= 0


def _run(rate: float) -> dict[str, Any]:
    return {"requests_per_s": rate, "server_cpu_us_per_request": 1e6 / rate}


@pytest.mark.parametrize(("ratio", "within"), [(1.1, True), (0.8, True), (0.7, False)])
def test_the_layer_must_keep_four_fifths_of_plain_aiohttps_rate_everywhere(
    ratio: float, within: bool
) -> None:
    rows = {
        "engine": {"agentenv": [_run(300.0 * ratio)] * 3, "aiohttp": [_run(300.0)] * 3},
        "buffer_stats": {
            "agentenv": [_run(1000.0 * 2), _run(1000.0 * 2.2), _run(1000.0 * 1.8)],
            "aiohttp": [_run(1000.0)] * 3,
        },
    }
    result = _summarise(rows, quick=True, repeat=3, cpus=(0, 1))
    engine = result["workloads"]["engine"]
    assert engine["agentenv_over_aiohttp"] == pytest.approx(ratio, abs=0.01)
    assert engine["aiohttp_cpu_over_agentenv"] == pytest.approx(ratio, abs=0.01)
    spread = result["workloads"]["buffer_stats"]["agentenv"]["requests_per_s"]
    assert (spread["min"], spread["median"], spread["max"]) == (1800.0, 2000.0, 2200.0)
    assert result["layer"]["min_ratio"] == pytest.approx(ratio, abs=0.01)
    assert result["layer"]["within_budget"] is within
