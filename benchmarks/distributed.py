"""``agentenv bench distributed``: what Ray costs a run -- the step time of a run placed on
Ray against the same run in one process, the time to place and start a run, and the time
to sync the weights into two engine actors.

Every run trains the same model (default: a 2-layer random Llama with SmolLM2's tokenizer)
on ``ArithmeticEnv``'s train split in order (``--no-rollout-shuffle``), ``--prompts``
prompts x ``--samples`` samples of ``--max-new-tokens`` tokens per step, ``--steps`` steps,
the same seed, on ``--device`` (cpu), each ``agentenv train`` in a subprocess of its own:

``in_process``: one trainer (``TorchBackend``) in the driver's process and one ``agentenv
serve`` engine launched as a local subprocess (``--rollout-engine serve``), weights from
disk. ``ray``: the same one trainer rank as a Ray actor and one ``agentenv serve`` engine
actor behind sglang-router on a Ray of the run's own (``--ray-address local
--rollout-num-gpus 1 --rollout-engine serve``), weights from disk. ``ray_2_ranks``: as
``ray`` with two data-parallel trainer ranks (``--actor-num-gpus-per-node 2``), for
information. The steady step is the median of steps 2..N; the ratio ray / in_process is the
overhead (target at most 1.10); the ratio of the fastest of steps 2..N is given beside it
(other work on the machine only ever slows a step down), with the load before and after
each run.

``start``: in a fresh process, the stages of placing a run as ``agentenv train`` does
(``--ray-address local``, one trainer rank, two engines): joining Ray (``ray.init``), the
placement group ready and measured, the trainer rank's actor with the model loaded, the two
engine actors serving behind the router. ``sync``: the trainer rank's weights into both
engines, ``--sync-repeats`` times each: from disk (saved by rank 0, loaded by each engine)
and broadcast over a gloo process group from the rank's actor (``--weight-sync
distributed``). ``sync_colocated``: two trainer ranks with an engine beside each
(``--colocate``), the weights into both from disk and handed over by handle from the rank
beside each (``--weight-sync tensor``).

Every process computes on ``--threads`` threads (``OMP_NUM_THREADS``, default 1: what Ray
gives a one-CPU actor; left to torch, the in-process trainer and its engine would each take
every core and contend, which is not Ray's doing). ``--quick``: 2 steps of 2 prompts x 2
samples of 4 tokens, the ``in_process`` and ``ray`` runs, one sync of each kind (a smoke
test).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import bench_parser

__all__ = ["RUNS", "add_parser", "run"]

QUICK = "smoke test: 2 steps of 2 x 2 samples, 4 tokens"

MODULE = "benchmarks.distributed"
ENV = "environments.arithmetic:ArithmeticEnv"
#: Each run's ``agentenv train`` flags beyond the workload's.
RUNS: dict[str, tuple[str, ...]] = {
    "in_process": ("--rollout-engine", "serve"),
    "ray": ("--ray-address", "local", "--rollout-num-gpus", "1", "--rollout-engine", "serve"),
    "ray_2_ranks": (
        "--ray-address", "local", "--actor-num-gpus-per-node", "2",
        "--rollout-num-gpus", "1", "--rollout-engine", "serve",
    ),
}  # fmt: skip
TARGET_RATIO = 1.10


def add_parser(sub: Any) -> None:
    parser = bench_parser(
        sub, "distributed",
        help="a run on Ray against one process; placing a run; weight sync into 2 engines",
        doc=__doc__, quick=QUICK,
    )  # fmt: skip
    _add_arguments(parser)
    parser.set_defaults(handler=_main)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model", metavar="MODEL", help="model name or HF directory (default: a tiny random Llama)"
    )
    parser.add_argument("--device", default="cpu", metavar="DEVICE", help="cpu (default)")
    parser.add_argument("--steps", type=int, metavar="N", help="steps per run (default 10)")
    parser.add_argument("--prompts", type=int, metavar="N", help="prompts per step (default 4)")
    parser.add_argument("--samples", type=int, metavar="N", help="samples per prompt (default 4)")
    parser.add_argument(
        "--max-new-tokens", type=int, metavar="N", help="tokens per sample (default 8)"
    )
    parser.add_argument(
        "--sync-repeats", type=int, metavar="N", help="syncs of each kind (default 3)"
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        metavar="N",
        help="OMP_NUM_THREADS of every process of every run (default 1: what Ray gives a "
        "one-CPU actor, so both sides compute alike)",
    )
    parser.add_argument("--seed", type=int, default=0, metavar="N", help="the runs' seed")
    parser.add_argument(
        "--runs",
        metavar="LIST",
        help=f"which runs (default all: {', '.join(RUNS)}; --quick: in_process,ray); the "
        "ratio needs in_process and ray",
    )
    parser.add_argument(
        "--no-start", action="store_true", help="leave out the start and sync measurements"
    )
    parser.add_argument(
        "--tokenizer-dir", metavar="DIR", help="the tiny model's tokenizer (smollm2-135m's)"
    )


def _workload_argv(args: argparse.Namespace, model: str, save: str) -> list[str]:
    quick = args.quick
    steps = args.steps or (2 if quick else 10)
    return [
        "--env", ENV, "--hf-checkpoint", model, "--device", args.device,
        "--num-rollout", str(steps),
        "--rollout-batch-size", str(args.prompts or (2 if quick else 4)),
        "--n-samples-per-prompt", str(args.samples or (2 if quick else 4)),
        "--rollout-max-response-len", str(args.max_new_tokens or (4 if quick else 8)),
        "--rollout-temperature", "1.0", "--rollout-seed", str(args.seed),
        "--no-rollout-shuffle", "--n-eval", "0", "--lr", "1e-3",
        "--save", save, "--save-interval", str(steps), "--no-use-tensorboard", "--json",
    ]  # fmt: skip


def _child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    # Every process of every run (driver, trainer ranks, engines) computes on this many
    # threads: Ray gives its actors OMP_NUM_THREADS of their CPUs (1) unless it is set.
    env["OMP_NUM_THREADS"] = str(threads)
    root = str(Path(__file__).resolve().parents[1])  # this checkout's packages first
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    env.setdefault("HF_HUB_OFFLINE", "1")
    return env


def _subprocess(name: str, command: list[str], log: Path, threads: int) -> str:
    """``command`` with its output to ``log``; its stdout (raises with the log's tail)."""
    print(f"bench distributed: {name} ...", file=sys.stderr, flush=True)
    with log.open("w") as err:
        proc = subprocess.run(
            command, env=_child_env(threads), stdout=subprocess.PIPE, stderr=err, text=True,
            timeout=600, check=False,
        )  # fmt: skip
    if proc.returncode != 0:
        tail = log.read_text()[-3000:]
        raise RuntimeError(f"{name} failed (exit status {proc.returncode}):\n{tail}")
    return proc.stdout


def _train_run(name: str, args: argparse.Namespace, model: str, tmp: Path) -> dict[str, Any]:
    save = tmp / name
    flags = _workload_argv(args, model, str(save)) + list(RUNS[name])
    command = [sys.executable, "-m", "agentenv", "train", *flags]
    load = os.getloadavg()[0]
    out = _subprocess(name, command, tmp / f"{name}.log", args.threads)
    # The summary is the last JSON line (Ray may print a warning of its own after it).
    summary = json.loads([x for x in out.splitlines() if x.startswith("{")][-1])
    lines = (save / "metrics.jsonl").read_text().splitlines()
    history = [json.loads(line) for line in lines if line.strip()]
    steps = [float(m["time_step_s"]) for m in history]
    steady = steps[1:] or steps
    return {
        "command": "agentenv train "
        + shlex.join([*_workload_argv(args, "MODEL", "RUN"), *RUNS[name]]),
        "steps": len(steps),
        "step_s": [round(s, 4) for s in steps],
        "steady_step_s": round(statistics.median(steady), 4),
        "steady_step_mean_s": round(statistics.fmean(steady), 4),
        "fastest_step_s": round(min(steady), 4),
        **{
            f"{part}_s": _steady(history, f"time_{part}_s") for part in ("rollout", "train", "sync")
        },
        "wall_s": round(float(summary["wall_s"]), 2),
        "reward": [round(float(m["reward_mean"]), 4) for m in history],
        # The machine's load (1 min) before and after: other work slows a run down.
        "load_average": [round(load, 2), round(os.getloadavg()[0], 2)],
    }


def _steady(history: list[dict[str, Any]], key: str) -> float:
    """The median of ``key`` over steps 2..N (step 1 alone when there is one)."""
    return round(statistics.median(float(m[key]) for m in history[1:] or history), 4)


# -- start and sync (in a child process: a fresh Ray) --------------------------------------


def _start_and_sync(model: str, device: str, repeats: int, weights: Path) -> dict[str, Any]:
    """Place a run of one trainer rank and two engines as ``agentenv train`` does, timing
    each stage; then sync the rank's weights into both engines, from disk and over gloo."""
    import anyio

    from agentenv import ChatTokenizer
    from trainer import TrainConfig, build_backend, engine_dtypes, place_run, rollout_engine
    from trainer.distributed import EngineGroup, connect

    flat: dict[str, Any] = dict(
        env=ENV, hf_checkpoint=model, device=device, ray_address="local",
        rollout_num_gpus=2, rollout_engine="serve", use_tensorboard=False,
    )  # fmt: skip
    config = TrainConfig(**flat)
    t0 = time.perf_counter()
    connect("local", num_cpus=4)  # what place_run does first
    t1 = time.perf_counter()
    placed = place_run(config)
    assert placed is not None
    t2 = time.perf_counter()
    backend: Any = build_backend(config, placed)
    t3 = time.perf_counter()
    out: dict[str, Any] = {}
    try:
        dtypes = engine_dtypes(backend, device)

        async def engines() -> None:
            tokenizer = ChatTokenizer.load(model)
            async with rollout_engine(config, tokenizer, weights / "run", dtypes, placed) as group:
                assert isinstance(group, EngineGroup)  # engine bundles: actors on Ray
                t4 = time.perf_counter()
                out["start"] = {
                    "ray_init_s": round(t1 - t0, 3),
                    "placement_s": round(t2 - t1, 3),
                    "trainer_ranks_s": round(t3 - t2, 3),
                    "engines_ready_s": round(t4 - t3, 3),
                    "total_s": round(t4 - t0, 3),
                    "trainer_ranks": 1,
                    "engines": len(group.engines),
                }
                syncs: dict[str, Any] = {}
                version = 0
                for kind in ("disk", "distributed"):
                    if kind == "disk":
                        sync = group.weight_sync("disk", directory=weights / "disk")
                    else:
                        sync = group.weight_sync(
                            "distributed", backend="gloo", bucket_bytes=512 << 20, timeout=120
                        )
                    times = []
                    try:
                        for _ in range(repeats):
                            version += 1
                            s = time.perf_counter()
                            await sync(backend, version)
                            times.append(time.perf_counter() - s)
                    finally:
                        await sync.aclose()
                    syncs[kind] = {
                        "s": [round(t, 4) for t in times],
                        "median_s": round(statistics.median(times), 4),
                        "first_s": round(times[0], 4),
                    }
                syncs["engines"] = len(group.engines)
                syncs["parameters"] = sum(int(v.numel()) for v in backend.state_dict().values())
                out["sync"] = syncs

        anyio.run(engines)
    finally:
        backend.close()
        placed.release()
    out["sync_colocated"] = _colocated_sync(flat, repeats, weights)
    return out


async def _timed(sync: Any, backend: Any, repeats: int, first: int) -> dict[str, Any]:
    times = []
    try:
        for version in range(first, first + repeats):
            s = time.perf_counter()
            await sync(backend, version)
            times.append(time.perf_counter() - s)
    finally:
        await sync.aclose()
    return {
        "s": [round(t, 4) for t in times],
        "median_s": round(statistics.median(times), 4),
        "first_s": round(times[0], 4),
    }


def _colocated_sync(flat: dict[str, Any], repeats: int, weights: Path) -> dict[str, Any]:
    """Two trainer ranks with an engine beside each (``--colocate``): the weights into
    both engines from disk and by handle from the rank beside each (``tensor``)."""
    import anyio

    from agentenv import ChatTokenizer
    from trainer import TrainConfig, build_backend, engine_dtypes, place_run, rollout_engine
    from trainer.distributed import EngineGroup

    colocated = {**flat, "colocate": True, "actor_num_gpus_per_node": 2}
    colocated.pop("rollout_num_gpus")
    config = TrainConfig(**colocated)
    placed = place_run(config)
    assert placed is not None
    backend: Any = build_backend(config, placed)
    out: dict[str, Any] = {"trainer_ranks": 2}
    try:
        dtypes = engine_dtypes(backend, config.model.device)

        async def engines() -> None:
            tokenizer = ChatTokenizer.load(config.model.hf_checkpoint)
            colocated_dir = weights / "colocated"
            async with rollout_engine(config, tokenizer, colocated_dir, dtypes, placed) as g:
                assert isinstance(g, EngineGroup)  # engine bundles: actors on Ray
                out["engines"] = len(g.engines)
                disk = g.weight_sync("disk", directory=weights / "colocated-disk")
                out["disk"] = await _timed(disk, backend, repeats, 1)
                out["tensor"] = await _timed(g.weight_sync("tensor"), backend, repeats, 100)

        anyio.run(engines)
    finally:
        backend.close()
        placed.release()
    return out


# -- the bench ----------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else round(a / b, 3)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every run and measurement; the result."""
    runs_flag = args.runs or ("in_process,ray" if args.quick else ",".join(RUNS))
    names = [n.strip() for n in runs_flag.split(",") if n.strip()]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        raise SystemExit(
            f"agentenv bench distributed: error: --runs {runs_flag!r}: unknown {unknown}; "
            f"expected some of {', '.join(RUNS)}"
        )
    repeats = args.sync_repeats or (1 if args.quick else 3)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="agentenv-bench-distributed-") as tmp_name:
        tmp = Path(tmp_name)
        if args.model is None:
            from benchmarks.grpo import _tiny_model

            (tmp / "model").mkdir()
            model = str(_tiny_model(tmp / "model", args.tokenizer_dir))
        else:
            from agentenv.engine import resolve_model

            model = str(resolve_model(args.model))
        runs = {name: _train_run(name, args, model, tmp) for name in names}
        result: dict[str, Any] = {
            "bench": "distributed",
            "quick": bool(args.quick),
            "model": args.model or "tiny-random-llama",
            "device": args.device,
            "cpus": os.cpu_count(),
            "threads": args.threads,
            "load_average": [round(x, 2) for x in os.getloadavg()],
            "runs": runs,
        }
        if "in_process" in runs and "ray" in runs:
            ratio = _ratio(runs["ray"]["steady_step_s"], runs["in_process"]["steady_step_s"])
            result["ratio"] = {
                "ray_over_in_process": ratio,
                "mean_ray_over_in_process": _ratio(
                    runs["ray"]["steady_step_mean_s"], runs["in_process"]["steady_step_mean_s"]
                ),
                "fastest_ray_over_in_process": _ratio(
                    runs["ray"]["fastest_step_s"], runs["in_process"]["fastest_step_s"]
                ),
                "target": TARGET_RATIO,
                "met": ratio is not None and ratio <= TARGET_RATIO,
            }
        if not args.no_start:
            spec = tmp / "start.json"
            command = [
                sys.executable, "-m", MODULE, "--child", model, args.device, str(repeats),
                str(tmp / "weights"), str(spec),
            ]  # fmt: skip
            _subprocess("start and sync", command, tmp / "start.log", args.threads)
            result.update(json.loads(spec.read_text()))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    return result


def _table(result: dict[str, Any]) -> str:
    lines = []
    runs = result["runs"]
    if runs:
        lines.append(
            f"{'run':<12} {'steady step':>12} {'fastest':>8} {'rollout':>8} {'train':>8} "
            f"{'sync':>8}  load"
        )
        for name, r in runs.items():
            lines.append(
                f"{name:<12} {r['steady_step_s']:>11.3f}s {r['fastest_step_s']:>7.3f}s "
                f"{r['rollout_s']:>7.3f}s {r['train_s']:>7.3f}s {r['sync_s']:>7.3f}s  "
                f"{r['load_average'][0]:.1f} -> {r['load_average'][1]:.1f}"
            )
    if "ratio" in result:
        r = result["ratio"]
        verdict = "met" if r["met"] else "not met"
        lines.append(
            f"ray / in_process, steady step: {r['ray_over_in_process']} "
            f"(target <= {r['target']}: {verdict}); fastest step: "
            f"{r['fastest_ray_over_in_process']}"
        )
    if "start" in result:
        s = result["start"]
        lines.append(
            f"start: {s['total_s']:.2f}s = ray.init {s['ray_init_s']:.2f} + placement "
            f"{s['placement_s']:.2f} + trainer rank {s['trainer_ranks_s']:.2f} + "
            f"{s['engines']} engines ready {s['engines_ready_s']:.2f}"
        )
    if "sync" in result:
        s = result["sync"]
        lines.append(
            f"weight sync into {s['engines']} engines ({s['parameters']:,} parameters): "
            f"disk {s['disk']['median_s']:.3f}s, gloo {s['distributed']['median_s']:.3f}s "
            "(median)"
        )
    if "sync_colocated" in result:
        s = result["sync_colocated"]
        lines.append(
            f"colocated ({s['trainer_ranks']} ranks, an engine beside each): disk "
            f"{s['disk']['median_s']:.3f}s, tensor (by handle) {s['tensor']['median_s']:.3f}s "
            "(median)"
        )
    return "\n".join(lines)


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    print(_table(result), file=sys.stderr)
    print(json.dumps(result, indent=None if args.json else 1), flush=True)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m benchmarks.distributed [FLAGS]``: the bench without the CLI."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        model, device, repeats, weights, result = argv[1:6]
        out = _start_and_sync(model, device, int(repeats), Path(weights))
        Path(result).write_text(json.dumps(out))
        return 0
    parser = bench_parser(None, "distributed", help="", doc=__doc__, quick=QUICK)
    _add_arguments(parser)
    return _main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
