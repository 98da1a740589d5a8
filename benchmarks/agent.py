"""``agentenv bench agent``: chat-completion calls per second through the per-episode
endpoint, and what a call costs over ``episode.generate`` directly; and the same for
Anthropic's Messages API (``/v1/messages``) on the same endpoint.

Both sides play the same episodes with the scripted model on one CPU core (client,
server and runner share one event loop): a conversation of ``--calls`` model turns, each
turn the agent adding one user message. Through the endpoint, the agent posts each call
over loopback HTTP with a lean keep-alive client (an ``aiohttp.ClientSession``; the
``openai`` SDK's own cost is its agent's, not the endpoint's) and ``--episodes`` run with
``--concurrency`` in flight. Directly, an :class:`Environment` calls
``transcript.add_messages`` and ``episode.generate``. The overhead per call is the
difference of the two times per call. The agents run in the endpoint's process (the
numbers an :class:`AgentEnv` sees), and again in a process of their own on the other core
(the endpoint's own cost: its core runs only the runner, the server and the episodes).
The same in-process agents also post Anthropic Messages calls (``messages_*``: the same
conversation as ``system`` and ``user``/``assistant`` messages). For scale it also times
the bare HTTP round trip: a no-op handler on the same server, posted to by the same
client::

    agentenv bench agent [--quick] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import anyio

from agentenv import (
    ChatTokenizer,
    Environment,
    Episode,
    RolloutConfig,
    Rubric,
    Sample,
    ScriptedModel,
    Task,
    run_rollouts,
)
from agentenv.endpoint import AgentEnv
from agentenv.http import Request, Response, Router
from benchmarks import bench_parser

__all__ = ["add_parser", "bench"]

SYSTEM = "You are a terse assistant."
_HEADERS = {"content-type": "application/json"}
_MAX_TOKENS = 1024  # Anthropic's required max_tokens, as an agent sends it


def _reply(ctx: Any) -> str:
    return "Noted."


def _session(connections: int) -> Any:
    """The agents' keep-alive connection pool (an ``aiohttp.ClientSession``)."""
    import aiohttp

    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=60, connect=10),
        trust_env=False,
    )


async def _post(session: Any, url: str, body: bytes) -> tuple[int, bytes]:
    async with session.post(url, data=body, headers=_HEADERS) as r:
        return r.status, await r.read()


async def _agent(session: Any, base_url: str, task_id: str, calls: int, api: str = "chat") -> str:
    """The benchmark's agent: ``calls`` chat completions (``api="messages"``: Anthropic
    Messages calls), one user message more each."""
    url = base_url.rstrip("/") + ("/messages" if api == "messages" else "/chat/completions")
    messages: list[Any] = [] if api == "messages" else [{"role": "system", "content": SYSTEM}]
    content = ""
    for i in range(calls):
        messages.append({"role": "user", "content": f"Item {i} of task {task_id}."})
        request: dict[str, Any] = {"model": "policy", "messages": messages}
        if api == "messages":
            request.update(system=SYSTEM, max_tokens=_MAX_TOKENS)
        body = json.dumps(request).encode()
        status, answer = await _post(session, url, body)
        if status != 200:
            raise RuntimeError(f"the endpoint answered {status}: {answer[:200]!r}")
        if api == "messages":
            blocks = json.loads(answer)["content"]
            messages.append({"role": "assistant", "content": blocks})
            content = "".join(b["text"] for b in blocks if b["type"] == "text")
        else:
            message = json.loads(answer)["choices"][0]["message"]
            messages.append(message)
            content = message["content"]
    return str(content)


class _EndpointEnv(AgentEnv):
    """The agents run in this process, on the same core."""

    rubric = Rubric()
    client_kind = "base_url"
    calls: int = 4
    api: str = "chat"
    session: Any = None

    async def run_agent(self, task: Task, client: Any) -> str:
        assert self.session is not None
        return await _agent(self.session, client, task.id, self.calls, self.api)


class _SplitEnv(AgentEnv):
    """The agents run in another process (on the other core): each episode hands its base
    URL to that process and waits for the agent to say it is done."""

    rubric = Rubric()
    client_kind = "base_url"
    calls: int = 4

    def __init__(self) -> None:
        self.waiting: dict[str, anyio.Event] = {}
        self.send: Any = None

    async def run_agent(self, task: Task, client: Any) -> str:
        done = self.waiting[client] = anyio.Event()
        await self.send(f"{client} {task.id}\n".encode())
        await done.wait()
        return ""

    async def listen(self, stream: Any) -> None:
        buffered = b""
        async for chunk in stream:
            buffered += chunk
            *lines, buffered = buffered.split(b"\n")
            for line in lines:
                self.waiting.pop(line.decode()).set()


async def _driver(calls: int) -> None:
    """The agents' process: one agent per base URL read from stdin; its URL back when done."""
    session = _session(4096)
    stdin = anyio.wrap_file(sys.stdin)

    async def one(url: str, task_id: str) -> None:
        await _agent(session, url, task_id, calls)
        sys.stdout.write(f"{url}\n")
        sys.stdout.flush()

    async with anyio.create_task_group() as tg:
        async for line in stdin:
            url, task_id = line.split()
            tg.start_soon(one, url, task_id)
    await session.close()


class _DirectEnv(Environment):
    calls: int = 4

    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        messages: list[Any] = [{"role": "system", "content": SYSTEM}]
        messages.append({"role": "user", "content": f"Item 0 of task {task.id}."})
        t = episode.transcript(messages)
        await episode.generate(t)
        for i in range(1, self.calls):
            t.add_messages([{"role": "user", "content": f"Item {i} of task {task.id}."}])
            await episode.generate(t)
        return episode.samples(t, 0.0)


async def _play(
    env: Environment, model: ScriptedModel, episodes: int, concurrency: int
) -> tuple[float, float]:
    """The wall time and this process's CPU time of ``episodes`` episodes."""
    tasks = [Task(id=f"t{i}") for i in range(episodes)]
    config = RolloutConfig(concurrency=concurrency, progress=False)
    start, cpu = time.perf_counter(), time.process_time()
    stats = await run_rollouts(env, tasks, model, config=config)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    if stats.failed:
        raise RuntimeError(f"failed episodes in the bench: {dict(stats.failure_reasons)}")
    return wall, cpu


async def _http_floor(calls: int, concurrency: int) -> tuple[float, float]:
    """Wall and CPU time of ``calls`` no-op requests (a fixed answer, no episode) on the
    same server and client: the HTTP round trip every call pays."""
    from agentenv.http import HTTPServer

    router = Router()
    answer = json.dumps({"choices": [{"message": {"role": "assistant", "content": "Noted."}}]})

    async def noop(request: Request) -> Response:
        return Response(answer.encode(), 200, "application/json")

    router.add("POST", "/e/{key}/v1/chat/completions", noop, long_poll=True)
    body = json.dumps({"model": "policy", "messages": [{"role": "user", "content": "hi"}]})
    async with HTTPServer(router) as server:
        session = _session(concurrency)
        url = f"{server.url}/e/k/v1/chat/completions"

        async def worker(n: int) -> None:
            for _ in range(n):
                json.loads((await _post(session, url, body.encode()))[1])

        start, cpu = time.perf_counter(), time.process_time()
        async with anyio.create_task_group() as tg:
            for _ in range(concurrency):
                tg.start_soon(worker, max(1, calls // concurrency))
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        await session.close()
    return wall, cpu


def bench(*, episodes: int, concurrency: int, calls: int, rounds: int) -> dict[str, Any]:
    """Run both sides ``rounds`` times (alternating) and keep each side's fastest.

    Wall time is what an agent sees; on a shared machine other processes take part of
    the core, so CPU time (this process's, all on the one core) is reported beside it:
    it is the steadier number of what a call costs.
    """
    tok = ChatTokenizer.load("smollm2-135m")
    model = ScriptedModel(tok, _reply)
    endpoint_env, direct_env, split_env = _EndpointEnv(), _DirectEnv(), _SplitEnv()
    messages_env = _EndpointEnv()
    messages_env.api = "messages"
    endpoint_env.calls = direct_env.calls = split_env.calls = messages_env.calls = calls
    total = episodes * calls
    inf = float("inf")
    sides = ("endpoint", "split", "messages", "direct", "floor")
    best = {side: [inf, inf] for side in sides}
    floor_calls = max(1, total // concurrency) * concurrency
    driver = [sys.executable, "-m", "benchmarks.agent", "--driver", "--calls", str(calls)]

    def keep(side: str, wall: float, cpu: float) -> None:
        best[side] = [min(best[side][0], wall), min(best[side][1], cpu)]

    async def main() -> None:
        endpoint_env.session = _session(concurrency)
        messages_env.session = _session(concurrency)
        async with (
            await anyio.open_process(driver, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc,
            anyio.create_task_group() as tg,
        ):
            assert proc.stdin is not None and proc.stdout is not None
            split_env.send = proc.stdin.send
            tg.start_soon(split_env.listen, proc.stdout)
            plays = (
                ("endpoint", endpoint_env),
                ("split", split_env),
                ("messages", messages_env),
                ("direct", direct_env),
            )
            for _, env in plays:  # warm up
                await _play(env, model, min(episodes, 64), concurrency)
            for _ in range(rounds):
                for side, env in plays:
                    keep(side, *await _play(env, model, episodes, concurrency))
                keep("floor", *await _http_floor(floor_calls, concurrency))
            await proc.stdin.aclose()
        await endpoint_env.session.close()
        await messages_env.session.close()

    load = os.getloadavg()[0]
    anyio.run(main)
    (e_wall, e_cpu), (d_wall, d_cpu) = best["endpoint"], best["direct"]
    s_wall, s_cpu = best["split"]
    m_wall, m_cpu = best["messages"]
    us = 1e6 / total
    return {
        "bench": "agent",
        "episodes": episodes,
        "concurrency": concurrency,
        "calls_per_episode": calls,
        "calls": total,
        "rounds": rounds,
        "direct_calls_per_s": round(total / d_wall, 1),
        "direct_us_per_call": round(d_wall * us, 1),
        "direct_cpu_us_per_call": round(d_cpu * us, 1),
        # The agents in the same process and on the same core as the endpoint.
        "endpoint_calls_per_s": round(total / e_wall, 1),
        "endpoint_us_per_call": round(e_wall * us, 1),
        "overhead_us_per_call": round((e_wall - d_wall) * us, 1),
        "endpoint_calls_per_cpu_s": round(total / e_cpu, 1),
        "endpoint_cpu_us_per_call": round(e_cpu * us, 1),
        "overhead_cpu_us_per_call": round((e_cpu - d_cpu) * us, 1),
        # The agents in another process on the other core: the endpoint's own core.
        "split_calls_per_s": round(total / s_wall, 1),
        "split_us_per_call": round(s_wall * us, 1),
        "split_overhead_us_per_call": round((s_wall - d_wall) * us, 1),
        "split_cpu_us_per_call": round(s_cpu * us, 1),
        "split_overhead_cpu_us_per_call": round((s_cpu - d_cpu) * us, 1),
        # Anthropic's Messages API, the agents in the endpoint's process (as "endpoint_*").
        "messages_calls_per_s": round(total / m_wall, 1),
        "messages_us_per_call": round(m_wall * us, 1),
        "messages_overhead_us_per_call": round((m_wall - d_wall) * us, 1),
        "messages_cpu_us_per_call": round(m_cpu * us, 1),
        "messages_overhead_cpu_us_per_call": round((m_cpu - d_cpu) * us, 1),
        "http_noop_us_per_call": round(best["floor"][0] / floor_calls * 1e6, 1),
        "http_noop_cpu_us_per_call": round(best["floor"][1] / floor_calls * 1e6, 1),
        "targets": {"calls_per_s": 2000, "overhead_us_per_call": 300},
        "met": {
            "calls_per_s": total / e_wall >= 2000,
            "overhead_us_per_call": (e_wall - d_wall) * us <= 300,
            "split_calls_per_s": total / s_wall >= 2000,
            "split_overhead_us_per_call": (s_wall - d_wall) * us <= 300,
            "split_overhead_cpu_us_per_call": (s_cpu - d_cpu) * us <= 300,
            "messages_calls_per_s": total / m_wall >= 2000,
            "messages_overhead_us_per_call": (m_wall - d_wall) * us <= 300,
        },
        "cpu": _pinned(),
        "loadavg_1m": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def _pinned() -> int | None:
    """Pin this process to one CPU core (the last one it may use); which one, or None."""
    if not hasattr(os, "sched_setaffinity"):
        return None
    cpu = max(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpu})
    return cpu


def add_parser(sub: Any) -> None:
    parser = bench_parser(
        sub, "agent",
        help="chat-completion (and Anthropic messages) calls/s through the per-episode "
        "endpoint, overhead per call",
        doc=__doc__, quick="fewer episodes (< 30 s)",
    )  # fmt: skip
    parser.add_argument(
        "--concurrency", type=int, default=256, metavar="N", help="episodes in flight (256)"
    )
    parser.add_argument("--calls", type=int, default=4, metavar="N", help="calls per episode (4)")
    parser.add_argument("--rounds", type=int, default=3, metavar="N", help="rounds; fastest kept")
    parser.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    if args.driver:  # the agents' process, started by the bench itself
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        anyio.run(_driver, args.calls)
        return 0
    _pinned()
    episodes = 512 if args.quick else 2048
    result = bench(
        episodes=episodes,
        concurrency=args.concurrency,
        calls=args.calls,
        rounds=1 if args.quick else args.rounds,
    )
    print(
        f"endpoint: {result['endpoint_calls_per_s']:,.0f} calls/s "
        f"({result['endpoint_us_per_call']} µs/call; CPU {result['endpoint_cpu_us_per_call']} "
        f"µs/call); episode.generate directly: {result['direct_us_per_call']} µs/call (CPU "
        f"{result['direct_cpu_us_per_call']}); overhead {result['overhead_us_per_call']} "
        f"µs/call (CPU {result['overhead_cpu_us_per_call']}); agents in another process: "
        f"{result['split_calls_per_s']:,.0f} calls/s, overhead "
        f"{result['split_overhead_us_per_call']} µs/call (CPU "
        f"{result['split_overhead_cpu_us_per_call']}); Anthropic messages: "
        f"{result['messages_calls_per_s']:,.0f} calls/s, overhead "
        f"{result['messages_overhead_us_per_call']} µs/call (CPU "
        f"{result['messages_overhead_cpu_us_per_call']}); a no-op HTTP call "
        f"{result['http_noop_us_per_call']} µs (CPU {result['http_noop_cpu_us_per_call']}); "
        f"load {result['loadavg_1m']}",
        file=sys.stderr,
    )
    print(json.dumps(result, separators=(",", ":")) if args.json else json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":  # python -m benchmarks.agent [--quick] [--json]
    _parser = argparse.ArgumentParser(prog="agentenv bench")
    add_parser(_parser.add_subparsers())
    sys.exit(run(_parser.parse_args(["agent", *sys.argv[1:]])))
