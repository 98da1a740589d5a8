"""The SDK's own benchmarks: ``agentenv bench rollout|buffer|engine|client|http``.

    agentenv bench rollout [--quick] [--json]
    agentenv bench buffer [--quick] [--json]
    agentenv bench engine [--quick] [--device cpu|cuda] [--json]
    agentenv bench engine --grpo [--groups 4 16] [--device cpu|cuda] [--json]
    agentenv bench client [--quick] [--json]
    agentenv bench http [--quick] [--repeat N] [--json]

``rollout`` measures the SDK's per-turn overhead on a 3-turn tool-use episode with an
instant model, at concurrency 1, 64 and 1024, each level in a fresh process pinned to one
CPU core; in the same run it plays the equivalent episode through PrimeIntellect's
``verifiers`` (when installed) and reports the throughput ratio.

``engine`` measures generated tokens/s of the embedded engine against Hugging Face
``generate`` on the same model, prompts, sampling and device, at 1, 8, 32 and 128
concurrent requests; with ``--grpo`` it runs a GRPO-shaped workload instead (groups of 8
samples of 200-token prompts, with and without the prefix cache, against HF ``generate``
with ``num_return_sequences=8``, and a 5-turn tool episode). ``client`` measures the
requests/s the SGLang client sustains with 4,096 requests in flight against an instant
stand-in server (client on one core, server on the other), and the same with a bare
``aiohttp.ClientSession`` (and, at 256 in flight, plain httpx) for comparison. ``http``
serves the Buffer service's and ``agentenv serve``'s handlers (over an instant engine) on
agentenv's HTTPServer (aiohttp underneath, with agentenv's connection rules) and on a
plain aiohttp application, server and client each on one core,
and reports requests/s of each and their ratio: what agentenv's layer costs.

Each ``add_*`` function is the entry point (group ``agentenv.benches``) of one bench.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from agentenv import ConfigError
from benchmarks import ROOT, bench_parser, emit, run_child

LEVELS = (1, 64, 1024)
# Episodes per level: enough for ≥ 1 s of steady state at the measured rates.
FULL = {1: 1000, 64: 4000, 1024: 8192}
QUICK = {1: 200, 64: 1000, 1024: 2048}
# verifiers runs about 20 turns/s here (see docs/benchmarks.md): --quick skips its 1024 level.
VERIFIERS_FULL = {1: 100, 64: 512, 1024: 1024}
VERIFIERS_QUICK = {1: 20, 64: 128}


def add_rollout(sub: Any) -> None:
    """``agentenv bench rollout``: the SDK's per-turn overhead; with ``--workers N``,
    episodes/s through rollout workers (:mod:`benchmarks.rollout_workers`)."""
    rollout = bench_parser(
        sub, "rollout", help="SDK overhead per tool-use turn", doc=None,
        quick="fewer episodes (< 60 s)",
    )  # fmt: skip
    rollout.add_argument(
        "--no-verifiers", action="store_true", help="skip the verifiers comparison"
    )
    rollout.add_argument(
        "--verifiers-python",
        default=None,
        metavar="PYTHON",
        help="python of a virtualenv with verifiers installed (default: this one)",
    )
    rollout.set_defaults(handler=run_rollout)
    from benchmarks import rollout_workers

    rollout_workers.add_parser(sub)  # --workers N joins this command


def add_buffer(sub: Any) -> None:
    buffer = bench_parser(
        sub, "buffer", help="Data Buffer throughput, 1,000-token samples", doc=None,
        quick="fewer samples (< 60 s)",
    )  # fmt: skip
    buffer.add_argument("--no-service", action="store_true", help="skip the HTTP service mode")
    buffer.set_defaults(handler=run_buffer)


def add_engine(sub: Any) -> None:
    engine = bench_parser(
        sub, "engine", help="embedded engine vs HF generate, tokens/s", doc=None,
        quick="32 new tokens, not 128",
    )  # fmt: skip
    engine.add_argument(
        "--device", default="cpu", metavar="DEVICE", help="cpu, cuda or cuda:N (default: cpu)"
    )
    engine.add_argument(
        "--dtype", default=None, metavar="DTYPE", help="default: float32 on CPU, bfloat16 on CUDA"
    )
    engine.add_argument(
        "--model",
        default="smollm2-135m",
        metavar="MODEL",
        help="model name or HF directory (default: smollm2-135m)",
    )
    engine.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights of the model's shape (where the model package is missing)",
    )
    engine.add_argument(
        "--levels",
        type=int,
        nargs="+",
        default=[1, 8, 32, 128],
        metavar="N",
        help="concurrency levels (default: 1 8 32 128)",
    )
    engine.add_argument("--no-cuda-graphs", action="store_true", help="eager decode steps")
    engine.add_argument(
        "--grpo",
        action="store_true",
        help="the GRPO-shaped workload: prompt prefills with and without the prefix cache",
    )
    engine.add_argument(
        "--groups",
        type=int,
        nargs="+",
        default=[4, 16],
        metavar="G",
        help="--grpo: groups of 8 samples (default: 4 16)",
    )
    engine.set_defaults(handler=run_engine)


def add_client(sub: Any) -> None:
    client = bench_parser(
        sub, "client", help="SGLang client requests/s, 4,096 in flight", doc=None,
        quick="fewer requests (< 60 s)",
    )  # fmt: skip
    client.add_argument(
        "--no-httpx", action="store_true", help="skip the plain-httpx comparison (slow)"
    )
    client.set_defaults(handler=run_client)


def add_http(sub: Any) -> None:
    http = bench_parser(
        sub, "http", help="agentenv's HTTPServer vs plain aiohttp, same handlers, requests/s",
        doc=None, quick="fewer requests (< 60 s a round)",
    )  # fmt: skip
    http.add_argument(
        "--repeat", type=int, default=3, metavar="N", help="rounds, for the spread (default: 3)"
    )
    http.set_defaults(handler=run_http)


def run_rollout(args: argparse.Namespace) -> int:
    episodes = QUICK if args.quick else FULL
    results: dict[str, Any] = {"bench": "rollout", "quick": bool(args.quick), "levels": {}}
    for c in LEVELS:
        r = run_child(
            "benchmarks.rollout", ["--concurrency", str(c), "--episodes", str(episodes[c])]
        )
        results["levels"][str(c)] = r
        print(
            f"agentenv   concurrency {c:>5}: {r['turns_per_s']:>9,.0f} turns/s  "
            f"{r['overhead_us_per_turn']:>7.1f} µs/turn  peak RSS {r['peak_rss_mb']:.0f} MB",
            file=sys.stderr,
        )
    # Heap per episode with all 1024 in flight (read at a barrier, see _rollout.py).
    top = results["levels"][str(LEVELS[-1])]
    results["memory"] = {
        "kb_per_in_flight_episode": round(top["heap_bytes_per_in_flight_episode"] / 1024, 2),
        "token_kb_per_episode": round(top["token_bytes_per_in_flight_episode"] / 1024, 2),
        "kb_per_episode_beyond_tokens": round(top["bytes_per_episode_beyond_tokens"] / 1024, 2),
    }
    print(
        f"memory per in-flight episode: {results['memory']['kb_per_in_flight_episode']} KB, "
        f"{results['memory']['kb_per_episode_beyond_tokens']} KB beyond its token ids",
        file=sys.stderr,
    )
    results["verifiers"] = None if args.no_verifiers else _verifiers(args, results)
    emit(results, args.json)
    return 0


def _verifiers(args: argparse.Namespace, results: dict[str, Any]) -> dict[str, Any]:
    module = "benchmarks.verifiers_episode"
    probe = subprocess.run(
        [
            args.verifiers_python or sys.executable,
            "-c",
            "from benchmarks.verifiers_episode import verifiers_available as v; print(v() or 'ok')",
        ],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ, PYTHONPATH=ROOT),
    )
    reason = probe.stdout.strip().splitlines()[-1] if probe.stdout.strip() else probe.stderr
    if reason != "ok":
        print(f"verifiers comparison skipped: {reason}", file=sys.stderr)
        return {"skipped": reason}
    episodes = VERIFIERS_QUICK if args.quick else VERIFIERS_FULL
    out: dict[str, Any] = {"levels": {}}
    for c in LEVELS:
        if c not in episodes:
            continue
        r = run_child(
            module,
            ["--concurrency", str(c), "--episodes", str(episodes[c])],
            python=args.verifiers_python,
            timeout=1800,
        )
        ours = results["levels"][str(c)]["turns_per_s"]
        r["agentenv_over_verifiers"] = (
            round(ours / r["turns_per_s"], 2) if r["turns_per_s"] else None
        )
        out["levels"][str(c)] = r
        print(
            f"verifiers  concurrency {c:>5}: {r['turns_per_s']:>9,.0f} turns/s  "
            f"agentenv is {r['agentenv_over_verifiers']}x",
            file=sys.stderr,
        )
    return out


def run_buffer(args: argparse.Namespace) -> int:
    groups = 1000 if args.quick else 4000  # x 8 samples of 1,000 tokens
    runs = [
        ("queue_baseline", ["--mode", "queue"]),
        ("memory", ["--mode", "memory"]),
        ("durable", ["--mode", "durable", "--producers", "64", "--durability", "power"]),
        ("durable_process", ["--mode", "durable", "--producers", "64", "--durability", "process"]),
    ]
    if not args.no_service:
        runs.append(("service", ["--mode", "service", "--producers", "16"]))
        runs.append(("service_split", ["--mode", "service_split", "--producers", "16"]))
    results: dict[str, Any] = {"bench": "buffer", "quick": bool(args.quick), "runs": {}}
    for name, extra in runs:
        n = groups // 4 if name.startswith("service") else groups
        r = run_child("benchmarks.buffer", [*extra, "--groups", str(n)])
        results["runs"][name] = r
        results[f"{name}_samples_per_s"] = r["samples_per_s"]
        print(f"{name:>16}: {r['samples_per_s']:>12,.0f} samples/s", file=sys.stderr)
    emit(results, args.json)
    return 0


def run_engine(args: argparse.Namespace) -> int:
    from benchmarks.engine import bench

    if args.grpo:
        from agentenv.engine import resolve_model
        from benchmarks.engine_grpo import bench as grpo

        if any(g < 1 for g in args.groups):
            raise ConfigError(f"--groups must be positive, got {args.groups}")
        found = grpo(
            model_dir=Path(resolve_model(args.model)), device=args.device, groups=args.groups
        )
        emit({"bench": "engine_grpo", "device": args.device, **found}, args.json)
        return 0
    levels = [c for c in args.levels if c > 0]
    if not levels:
        raise ConfigError("--levels needs at least one positive concurrency")
    results = bench(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        levels=levels,
        max_new_tokens=32 if args.quick else 128,
        random_weights=args.random_weights,
        cuda_graphs=not args.no_cuda_graphs,
    )
    results["quick"] = bool(args.quick)
    emit(results, args.json)
    return 0


def run_client(args: argparse.Namespace) -> int:
    server = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.client", "--serve", *_cpu_args(1)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert server.stdout is not None
        port = server.stdout.readline().strip()
        if not port.isdigit():
            raise ConfigError("the stand-in server of `bench client` did not start")
        url = f"http://127.0.0.1:{port}"
        results: dict[str, Any] = {"bench": "client", "quick": bool(args.quick), "runs": {}}
        # (name, client, requests, in flight). httpx's default pool scans its connections
        # on every request, so at 4,096 in flight it manages ~15 requests/s: it is compared
        # at 256 in flight, against agentenv at 256 too.
        n = 10000 if args.quick else 40000
        runs = [("agentenv", "agentenv", n, 4096), ("aiohttp", "aiohttp", n, 4096)]
        if not args.no_httpx:
            runs.append(("agentenv_256", "agentenv", 4000, 256))
            runs.append(("httpx_256", "httpx", 1000 if args.quick else 3000, 256))
        for name, client, n, in_flight in runs:
            extra = ["--url", url, "--client", client, "--requests", str(n)]
            extra += ["--in-flight", str(in_flight), *_cpu_args(0)]
            r = run_child("benchmarks.client", extra, timeout=1200)
            results["runs"][name] = r
            print(
                f"{client:>9} {in_flight:>5} in flight: {r['requests_per_s']:>9,.0f} requests/s"
                f"  client {r['client_cpu_us_per_request']:.0f} µs/request",
                file=sys.stderr,
            )
        results["requests_per_s"] = results["runs"]["agentenv"]["requests_per_s"]
        results["ratio_vs_aiohttp"] = round(
            results["requests_per_s"] / results["runs"]["aiohttp"]["requests_per_s"], 2
        )
        if "httpx_256" in results["runs"]:
            results["ratio_vs_httpx_at_256"] = round(
                results["runs"]["agentenv_256"]["requests_per_s"]
                / results["runs"]["httpx_256"]["requests_per_s"],
                2,
            )
    finally:
        server.terminate()
        server.wait(timeout=10)
        if server.stdout is not None:
            server.stdout.close()
    emit(results, args.json)
    return 0


def run_http(args: argparse.Namespace) -> int:
    from benchmarks.http_server import compare

    emit(compare(quick=args.quick, repeat=args.repeat), args.json)
    return 0


def _cpu_args(index: int) -> list[str]:
    """``--cpu N`` for the index-th CPU this process may use (none on a one-CPU machine)."""
    try:
        cpus = sorted(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return []
    return ["--cpu", str(cpus[index])] if len(cpus) > index and len(cpus) > 1 else []
