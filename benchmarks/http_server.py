"""agentenv's HTTP server against a plain aiohttp application, serving the same handlers.

agentenv's ``HTTPServer`` serves its routes on aiohttp's web server, with agentenv's own
rules on top (connection cap and probe reserve, head and body timeouts, the guard before
the body, long polls, graceful shutdown). This bench measures what that layer costs: the
same handlers on ``HTTPServer`` (``--server agentenv``) and, through the thin adapter in
``_aiohttp.py``, on a plain ``aiohttp.web.Application`` (``--server aiohttp``).

The server runs in a process of its own pinned to one core and serves either the Buffer
service's routes (``BufferServer``, an in-memory Buffer) or ``agentenv serve``'s routes
(``EngineServer`` over an instant engine: every prompt gets the same 8 output tokens with
log-probs, at once). The client runs in another process pinned to the other core and is
the same for both. Workloads:

- ``buffer_put``: 16 producers put groups of 8 samples of 1,000 tokens while a consumer
  takes batches of 16 groups and acknowledges them (the BufferClient coalesces concurrent
  puts into ``put_groups`` requests): samples/s and requests/s.
- ``buffer_stats``: 64 concurrent ``statistics`` calls, small requests: requests/s.
- ``engine``: SGLangClient ``/generate`` calls (100-token prompts) with ``--in-flight``
  requests going: requests/s. ::

    python -m benchmarks.http_server --serve engine --server aiohttp     # prints its URL
    python -m benchmarks.http_server --url URL --workload engine --requests 4000
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import anyio

from agentenv import ConfigError, FinishReason, SamplingParams
from agentenv.http import Guard, Router
from benchmarks.client import _drive

SERVERS = ("agentenv", "aiohttp")
SERVICES = ("buffer", "engine")
WORKLOADS = {"buffer_put": "buffer", "buffer_stats": "buffer", "engine": "engine"}
TOKEN = "bench"
BUDGET = 0.8  # agentenv's layer may cost at most this much of plain aiohttp's requests/s


# -- the instant engine behind `agentenv serve`'s handlers ----------------------------------
@dataclasses.dataclass(frozen=True, slots=True)
class _Completion:
    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    weight_version: str = "default"
    cached_tokens: int = 0


class _NoText:
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return ""


class InstantEngine:
    """What ``EngineServer``'s handlers use of an Engine, answering every prompt at once."""

    vocab_size = 49152
    healthy = True
    tokenizer = _NoText()
    released: frozenset[str] = frozenset()  # its memory is never released for training

    def check(self, input_ids: Sequence[int], params: SamplingParams) -> None:
        return None

    async def generate(
        self,
        input_ids: Sequence[int],
        params: SamplingParams,
        *,
        rid: str | None = None,
        return_logprob: bool = False,
    ) -> _Completion:
        from benchmarks.client import OUTPUT

        logprobs = [-0.5] * len(OUTPUT) if return_logprob else None
        return _Completion(list(OUTPUT), logprobs, FinishReason("length", length=len(OUTPUT)))


# -- the server process --------------------------------------------------------------------
@contextlib.asynccontextmanager
async def serving(service: str, server: str) -> AsyncIterator[str]:
    """``service``'s handlers (``buffer`` or ``engine``) served on ``server`` (``agentenv``:
    its ``HTTPServer``, or ``aiohttp``: a plain aiohttp application) in this process;
    yields the URL."""
    from agentenv.buffer import Buffer, BufferConfig, BufferServer

    if service not in SERVICES or server not in SERVERS:
        raise ConfigError(
            f"service must be one of {SERVICES} and server one of {SERVERS}, "
            f"got {service!r} and {server!r}"
        )
    async with contextlib.AsyncExitStack() as stack:
        served: Any
        if service == "buffer":
            config = BufferConfig(n_samples_per_prompt=8, capacity=4096)
            buffer = await stack.enter_async_context(Buffer(config))
            served = BufferServer(buffer, token=TOKEN)
        else:
            from agentenv.engine import EngineServer

            served = EngineServer(InstantEngine())  # type: ignore[arg-type]
        # The bench measures the servers' HTTP layer itself: it serves the same router,
        # guard and body limit that the server's own HTTPServer has on plain aiohttp.
        http = served.http_server
        if server == "agentenv":
            await stack.enter_async_context(served)
            yield served.url
        else:
            yield await _start_aiohttp(stack, http.router, http.guard, http.max_body_bytes)


async def _serve(service: str, server: str) -> None:
    async with serving(service, server) as url:
        print(url, flush=True)
        await anyio.sleep_forever()


async def _start_aiohttp(
    stack: contextlib.AsyncExitStack, router: Router, guard: Guard | None, max_body_bytes: int
) -> str:
    from aiohttp import web

    from benchmarks.aiohttp_app import aiohttp_app

    app = aiohttp_app(router, guard, max_body_bytes=max_body_bytes)
    # Long-poll handlers end when their client leaves, as on agentenv's HTTPServer.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    stack.push_async_callback(runner.cleanup)
    site = web.TCPSite(runner, "127.0.0.1", 0, backlog=8192)
    await site.start()
    host, port = runner.addresses[0][:2]
    return f"http://{host}:{port}"


# -- the client process --------------------------------------------------------------------
def cpu_seconds(pid: int | None) -> float | None:
    """CPU time (user + system) process ``pid`` has used so far, where ``/proc`` says."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_workload(
    url: str, workload: str, requests: int, in_flight: int, server_pid: int | None = None
) -> dict[str, Any]:
    """Drive ``workload`` against the server at ``url`` (after a warm-up); the measurements.

    ``requests``: requests to send (``buffer_put``: groups to put, a multiple of 16). With
    ``server_pid``, also the server's CPU time per request: what the server costs, whichever
    side limits the rate.
    """
    if workload not in WORKLOADS:
        raise ConfigError(f"workload must be one of {sorted(WORKLOADS)}, got {workload!r}")
    out: dict[str, Any] = {"workload": workload, "in_flight": in_flight}
    if workload == "engine":
        from agentenv.sglang import SGLangClient
        from benchmarks.client import OUTPUT

        prompt = list(range(2000, 2100))
        params = SamplingParams(max_new_tokens=8)
        async with SGLangClient(url, max_connections=in_flight) as sglang:

            async def generate() -> None:
                completion = await sglang.generate(prompt, params)
                assert completion.output_ids == OUTPUT

            await _drive(generate, in_flight, in_flight)  # warm-up: open the connections
            cpu = cpu_seconds(server_pid)
            wall = await _drive(generate, requests, in_flight)
            sent = requests
    else:
        from agentenv.buffer import BufferClient
        from benchmarks.buffer import BATCH_GROUPS, GROUP, _through_buffer, make_groups

        async with BufferClient(url, token=TOKEN, max_connections=max(in_flight, 1)) as client:
            sent = 0

            async def count(request: Any) -> None:
                nonlocal sent
                sent += 1

            client.http_client.event_hooks = {"request": [count]}  # its requests, counted
            if workload == "buffer_put":
                if requests % BATCH_GROUPS:
                    raise ConfigError(f"buffer_put needs a multiple of 16 groups, got {requests}")
                groups = make_groups(requests + BATCH_GROUPS)
                warm, groups = groups[:BATCH_GROUPS], groups[BATCH_GROUPS:]
                await _through_buffer(client, warm, producers=in_flight)
                sent = 0
                cpu = cpu_seconds(server_pid)
                wall = await _through_buffer(client, groups, producers=in_flight)
                out["samples"] = len(groups) * GROUP
                out["samples_per_s"] = round(len(groups) * GROUP / wall, 1)
            else:
                await _drive(client.statistics, in_flight, in_flight)
                sent = 0
                cpu = cpu_seconds(server_pid)
                wall = await _drive(client.statistics, requests, in_flight)
    after = cpu_seconds(server_pid)
    out.update(requests=sent, seconds=round(wall, 3), requests_per_s=round(sent / wall, 1))
    if cpu is not None and after is not None:
        out["server_cpu_us_per_request"] = round((after - cpu) / sent * 1e6, 1)
        out["server_cpu_busy"] = round((after - cpu) / wall, 2)
    return out


# -- the comparison (`agentenv bench http`) -------------------------------------------------
# (workload, requests -- groups for buffer_put --, in flight), full and --quick.
RUNS = {
    False: [("buffer_put", 1024, 16), ("buffer_stats", 8000, 64), ("engine", 8000, 256)],
    True: [("buffer_put", 256, 16), ("buffer_stats", 2000, 64), ("engine", 2000, 256)],
}


def compare(
    *, quick: bool = False, repeat: int = 3, servers: Sequence[str] = SERVERS
) -> dict[str, Any]:
    """Each workload on each server, ``repeat`` rounds (servers alternating within a round,
    each run on a fresh server process); medians, spreads and agentenv/aiohttp ratios."""
    from benchmarks import run_child

    if repeat < 1:
        raise ConfigError(f"--repeat must be at least 1, got {repeat}")
    server_cpu, client_cpu = _cpus()
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for round_ in range(repeat):
        for workload, n, in_flight in RUNS[quick]:
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for server in order:
                with _server_process(WORKLOADS[workload], server, server_cpu) as (url, pid):
                    args = ["--url", url, "--workload", workload, "--requests", str(n)]
                    args += ["--in-flight", str(in_flight), "--server-pid", str(pid)]
                    if client_cpu is not None:
                        args += ["--cpu", str(client_cpu)]
                    r = run_child("benchmarks.http_server", args, timeout=600)
                rows.setdefault(workload, {}).setdefault(server, []).append(r)
                print(
                    f"{workload:>12} {server:>8}: {r['requests_per_s']:>8,.0f} requests/s"
                    + (f" {r['samples_per_s']:>8,.0f} samples/s" if "samples_per_s" in r else "")
                    + f"  server {r.get('server_cpu_us_per_request', float('nan')):.0f} µs/request",
                    file=sys.stderr,
                )
    return _summarise(rows, quick=quick, repeat=repeat, cpus=(server_cpu, client_cpu))


def _summarise(
    rows: dict[str, dict[str, list[dict[str, Any]]]],
    *,
    quick: bool,
    repeat: int,
    cpus: tuple[int | None, int | None],
) -> dict[str, Any]:
    import statistics

    keys = ("requests_per_s", "samples_per_s", "server_cpu_us_per_request")
    workloads: dict[str, Any] = {}
    for workload, by_server in rows.items():
        entry: dict[str, Any] = {}
        for server, runs in by_server.items():
            stats: dict[str, Any] = {"runs": runs}
            for key in keys:
                values = [r[key] for r in runs if key in r]
                if values:
                    stats[key] = {
                        "median": round(statistics.median(values), 1),
                        "min": min(values),
                        "max": max(values),
                    }
            entry[server] = stats
        if "agentenv" in entry and "aiohttp" in entry:
            ours, theirs = entry["agentenv"], entry["aiohttp"]
            entry["agentenv_over_aiohttp"] = round(
                ours["requests_per_s"]["median"] / theirs["requests_per_s"]["median"], 2
            )
            if "server_cpu_us_per_request" in ours and "server_cpu_us_per_request" in theirs:
                entry["aiohttp_cpu_over_agentenv"] = round(
                    theirs["server_cpu_us_per_request"]["median"]
                    / ours["server_cpu_us_per_request"]["median"],
                    2,
                )
        workloads[workload] = entry
    ratios = [
        w["agentenv_over_aiohttp"] for w in workloads.values() if "agentenv_over_aiohttp" in w
    ]
    result: dict[str, Any] = {
        "bench": "http",
        "quick": quick,
        "repeat": repeat,
        "server_cpu": cpus[0],
        "client_cpu": cpus[1],
        "workloads": workloads,
    }
    if ratios:
        result["layer"] = {
            "rule": f"agentenv's HTTPServer keeps >= {BUDGET}x plain aiohttp's requests/s "
            "everywhere",
            "min_ratio": min(ratios),
            "within_budget": min(ratios) >= BUDGET,
        }
    return result


def _cpus() -> tuple[int | None, int | None]:
    """The server's and the client's CPUs: two different ones where there are two."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return None, None
    if len(cpus) < 2:
        return None, None
    return cpus[-2], cpus[-1]


@contextlib.contextmanager
def _server_process(service: str, server: str, cpu: int | None) -> Iterator[tuple[str, int]]:
    """A server process for ``service`` on ``server``; yields its URL and pid."""
    import subprocess

    from benchmarks import ROOT

    command = [sys.executable, "-m", "benchmarks.http_server", "--serve", service]
    command += ["--server", server, *([] if cpu is None else ["--cpu", str(cpu)])]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p),
        OMP_NUM_THREADS="1",
    )
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        if not url.startswith("http://"):
            raise ConfigError(f"the {service} server on {server} did not start ({url!r})")
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--serve", choices=SERVICES, help="run a server for this service")
    parser.add_argument("--server", choices=SERVERS, default="agentenv")
    parser.add_argument("--url")
    parser.add_argument("--workload", choices=sorted(WORKLOADS))
    parser.add_argument("--requests", type=int, default=4000, help="requests (buffer_put: groups)")
    parser.add_argument("--in-flight", type=int, default=64)
    parser.add_argument("--cpu", type=int, default=None, help="pin to this CPU")
    parser.add_argument("--server-pid", type=int, default=None, help="the server's pid")
    args = parser.parse_args(argv)
    if args.cpu is not None:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, {args.cpu})
    from benchmarks.client import _raise_fd_limit

    _raise_fd_limit()
    if args.serve:
        with contextlib.suppress(KeyboardInterrupt):
            anyio.run(_serve, args.serve, args.server)
        return 0
    if args.url is None or args.workload is None:
        parser.error("--url and --workload are required (or --serve)")
    result = anyio.run(
        run_workload, args.url, args.workload, args.requests, args.in_flight, args.server_pid
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
