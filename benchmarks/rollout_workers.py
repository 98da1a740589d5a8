"""``agentenv bench rollout --workers N``: how rollout workers scale an environment-bound run.

The environment (:class:`BusyEnv`) spends ``--cpu-ms`` of CPU in its verifier per
episode (a single turn); the policy is a scripted model (no engine), so episodes/s is
bound by the environment. Three ways, the same ``--episodes`` episodes each:

``in_process``: :func:`agentenv.run_rollouts` in one process into a Buffer (what a run
without workers does). ``workers_1`` / ``workers_N``: the same rounds through
:class:`~trainer.distributed.RolloutWorkers` (``--workers`` of them), each worker on a host
of its own -- network namespaces on this machine (:mod:`benchmarks.hosts`: a
Ray head in one, a one-CPU Ray node per worker in the others), the Buffer served by the
driver on the head's host. Reported: episodes/s of each, the speed-up of N workers over
one (target at least 1.7 on a 2-core machine with 2 workers), and the time per episode
through one worker against in-process (the SDK's overhead through Ray; target at most
1.2). Needs root (namespaces); ``--local`` runs the workers on a local Ray instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentenv import Rubric, SingleTurnEnv, State, Task

__all__ = ["BusyEnv", "add_parser", "main"]

MODULE = "benchmarks.rollout_workers"
SCRIPT = "def reply(ctx):\n    return 'The answer is 42.'\n"


def _busy(task: Task, state: State) -> float:
    """``cpu_ms`` of CPU (a verifier at work), then a reward."""
    cpu_ms = task.info.get("cpu_ms", 20)
    deadline = time.process_time() + float(cpu_ms if isinstance(cpu_ms, int | float) else 20) / 1000
    while time.process_time() < deadline:
        pass
    return 1.0 if state.transcript.current.completion_ids else 0.0


class BusyEnv(SingleTurnEnv):
    """One turn; the verifier burns ``cpu_ms`` of CPU per episode."""

    name = "busy"
    rubric = Rubric(_busy)

    def __init__(self, cpu_ms: float = 20.0, n: int = 4096) -> None:
        self.cpu_ms = cpu_ms
        self.n = n

    def tasks(self, split: str = "train") -> list[Task]:
        return [
            Task(id=f"{split}{i}", prompt=f"What is {i} + 42 - {i}?", info={"cpu_ms": self.cpu_ms})
            for i in range(self.n)
        ]


def add_parser(sub: Any) -> None:
    """``--workers N`` on ``agentenv bench rollout`` (the SDK's per-turn bench, which
    runs without it): this bench's flags join that command's."""
    parser: argparse.ArgumentParser | None = sub.choices.get("rollout")
    if parser is None:  # the core's bench is not there: a command of its own
        parser = sub.add_parser("rollout", help="episodes/s through rollout workers")
    plain = parser.get_default("handler")
    group = parser.add_argument_group(
        "rollout workers", "--workers N: episodes/s of a CPU-bound environment in one "
        "process, on 1 and on N workers",
    )  # fmt: skip
    _add_arguments(group, json_flag=plain is None)
    parser.description = (parser.description or "") + "\n\n" + (__doc__ or "")
    parser.formatter_class = argparse.RawDescriptionHelpFormatter

    def handler(args: argparse.Namespace) -> int:
        if args.workers is None:
            if plain is None:
                raise SystemExit("agentenv bench rollout: pass --workers N")
            return int(plain(args))
        return _main(args)

    parser.set_defaults(handler=handler)


def _add_arguments(parser: Any, *, json_flag: bool = True) -> None:
    parser.add_argument(
        "--workers", type=int, metavar="N",
        help="rollout workers to compare with one and with one process (e.g. 2)",
    )  # fmt: skip
    parser.add_argument(
        "--episodes", type=int, default=400, metavar="N", help="episodes per way (400)"
    )
    parser.add_argument(
        "--cpu-ms", type=float, default=20.0, metavar="MS", help="verifier CPU per episode (20)"
    )
    parser.add_argument(
        "--local", action="store_true", help="workers on a local Ray, not namespace hosts"
    )
    if json_flag:
        parser.add_argument("--json", action="store_true", help="print the result as JSON")


def _measure(args: argparse.Namespace, address: str | None, tokenizer: str) -> dict[str, Any]:
    """In the driver's host: the three ways, timed."""
    import anyio

    from agentenv import RolloutConfig, SamplingParams, load_policy, run_rollouts
    from agentenv.buffer import Buffer, BufferConfig
    from trainer.distributed import RolloutWorkers, WorkerSpec, connect

    n_per = 4
    env = BusyEnv(args.cpu_ms)
    tasks = env.tasks()[: max(1, args.episodes // n_per)]
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write(SCRIPT)
    scripted = f"scripted:{f.name}"
    config = RolloutConfig(
        n_samples_per_prompt=n_per, sampling=SamplingParams(max_new_tokens=8), concurrency=64,
        seed=0, progress=False,
    )  # fmt: skip
    out: dict[str, Any] = {"episodes": len(tasks) * n_per, "cpu_ms": args.cpu_ms}

    async def in_process() -> float:
        policy, tok = load_policy(scripted, tokenizer=tokenizer)
        async with Buffer(BufferConfig(n_samples_per_prompt=n_per)) as buffer:
            start = time.perf_counter()
            await run_rollouts(env, tasks, policy, tokenizer=tok, sink=buffer, config=config)
            return time.perf_counter() - start

    async def through(workers: int) -> float:
        spec = WorkerSpec(
            f"{MODULE}:BusyEnv", {"cpu_ms": args.cpu_ms}, tokenizer, scripted,
            concurrency=64 * workers, resources={} if args.local else {"rollout": 1},
        )  # fmt: skip
        async with Buffer(BufferConfig(n_samples_per_prompt=n_per)) as buffer:
            group = RolloutWorkers(spec, workers)
            async with group.serving(buffer):
                await group.play(tasks[:8], config)  # warm: imports, first connections
                start = time.perf_counter()
                await group.play(tasks, dataclasses.replace(config, seed=1))
                return time.perf_counter() - start

    out["in_process_s"] = anyio.run(in_process)
    connect(address or "local", num_cpus=4)
    out["workers_1_s"] = anyio.run(through, 1)
    out[f"workers_{args.workers}_s"] = anyio.run(through, args.workers)
    e = out["episodes"]
    out["in_process_episodes_per_s"] = e / out["in_process_s"]
    out["workers_1_episodes_per_s"] = e / out["workers_1_s"]
    out[f"workers_{args.workers}_episodes_per_s"] = e / out[f"workers_{args.workers}_s"]
    out["speedup"] = out["workers_1_s"] / out[f"workers_{args.workers}_s"]
    out["overhead_ratio"] = out["workers_1_s"] / out["in_process_s"]
    os.unlink(f.name)
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from agentenv.engine import resolve_model

    tokenizer = str(resolve_model("smollm2-135m"))
    result: dict[str, Any] = {"bench": "rollout", "workers": args.workers, "local": args.local}
    result["load_before"] = os.getloadavg()[0]
    if args.local:
        result.update(_measure(args, None, tokenizer))
    else:
        from benchmarks.hosts import Hosts, popen
        from benchmarks.hosts import available as hosts_available

        why = hosts_available()
        if why is not None:
            raise SystemExit(f"agentenv bench rollout: {why}; pass --local")
        with Hosts(args.workers + 1) as hosts, tempfile.TemporaryDirectory() as tmp:
            head = hosts.ray_head(0, port=6391, num_cpus=1)
            for i in range(1, args.workers + 1):
                hosts.ray_worker(i, head, num_cpus=1, resources={"rollout": 1})
            hosts.wait_nodes(0, head, args.workers + 1)
            spec = Path(tmp) / "out.json"
            root = Path(__file__).resolve().parents[1]
            cmd = [
                sys.executable, "-m", MODULE, "--_child", head, tokenizer, str(spec),
                f"--workers={args.workers}", f"--episodes={args.episodes}",
                f"--cpu-ms={args.cpu_ms}",
            ]  # fmt: skip
            env = {**os.environ, "PYTHONPATH": str(root)}
            child = popen(hosts, 0, cmd, env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                _, err = child.communicate(timeout=900)
            finally:
                hosts.stop(child)
            if child.returncode:
                raise SystemExit(f"agentenv bench rollout: the driver failed:\n{err[-3000:]}")
            result.update(json.loads(spec.read_text()))
            result["hosts"] = [hosts.address(i) for i in range(args.workers + 1)]
    result["load_after"] = os.getloadavg()[0]
    result["speedup_target"], result["overhead_target"] = 1.7, 1.2
    result["speedup_met"] = result["speedup"] >= 1.7
    result["overhead_met"] = result["overhead_ratio"] <= 1.2
    return result


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    n = args.workers
    print(
        f"{result['episodes']} episodes, {result['cpu_ms']:g} ms of CPU each: in one process "
        f"{result['in_process_episodes_per_s']:.1f}/s; 1 worker "
        f"{result['workers_1_episodes_per_s']:.1f}/s; {n} workers "
        f"{result[f'workers_{n}_episodes_per_s']:.1f}/s -> speed-up {result['speedup']:.2f} "
        f"(target >= 1.7), overhead through Ray {result['overhead_ratio']:.2f} (target <= 1.2)"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_child"]:
        head, tokenizer, out = argv[1], argv[2], argv[3]
        parser = argparse.ArgumentParser()
        _add_arguments(parser)
        args = parser.parse_args(argv[4:])
        Path(out).write_text(json.dumps(_measure(args, head, tokenizer)))
        return 0
    parser = argparse.ArgumentParser(prog="agentenv bench rollout", description=__doc__)
    _add_arguments(parser)
    args = parser.parse_args(argv)
    args.workers = args.workers or 2
    return _main(args)


if __name__ == "__main__":
    raise SystemExit(main())
