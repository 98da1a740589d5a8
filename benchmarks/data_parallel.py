"""``agentenv bench data-parallel``: how the torch backend's data-parallel ranks should sum
their gradients -- its own one flat all-reduce after the step's micro-batches
(what the torch backend did first), torch's ``DistributedDataParallel``
(bucketed all-reduces overlapped with the last micro-batch's backward, ``no_sync`` for the
others) or FSDP2's ``fully_shard`` (parameters, gradients and optimizer state sharded over
the ranks; each decoder layer and the root a unit, gradients reduce-scattered at the last
micro-batch) -- on the same model, micro-batches and AdamW step.

Each strategy runs in its own ``--ranks`` processes (gloo on CPU, NCCL with
``--device cuda`` and one GPU per rank), ``--steps`` steps of ``--micro-batches``
micro-batches of ``--batch`` x ``--tokens`` tokens, dealt to the ranks as the backend
deals them. Reported per strategy: the steady step time (median of steps 2..N), each
rank's peak memory (RSS on CPU, ``max_memory_allocated`` on CUDA), and the largest
difference of its weights after the last step from the one-process run's (the same
steps on one rank): a strategy that is not exact shows it there.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

from benchmarks import bench_parser

__all__ = ["add_parser", "main"]

JSON = "print the results as JSON"

STRATEGIES = ("one_process", "flat_all_reduce", "ddp", "fsdp2")


def add_parser(sub: Any) -> None:
    parser = bench_parser(
        sub, "data-parallel",
        help="the torch backend's gradient sum against DDP and FSDP2 on the same step",
        doc=__doc__, json=JSON,
    )  # fmt: skip
    _add_arguments(parser)
    parser.set_defaults(handler=_main)


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--ranks", type=int, default=2, metavar="N", help="ranks (default 2)")
    parser.add_argument(
        "--device", default="cpu", metavar="DEVICE", help="cpu (gloo, default) or cuda (NCCL)"
    )
    parser.add_argument("--layers", type=int, default=4, metavar="N", help="decoder layers (4)")
    parser.add_argument("--hidden", type=int, default=256, metavar="N", help="hidden size (256)")
    parser.add_argument("--vocab", type=int, default=8192, metavar="N", help="vocabulary (8192)")
    parser.add_argument("--steps", type=int, default=6, metavar="N", help="steps (default 6)")
    parser.add_argument(
        "--micro-batches", type=int, default=4, metavar="N", help="per step (default 4)"
    )
    parser.add_argument("--batch", type=int, default=4, metavar="N", help="rows (default 4)")
    parser.add_argument("--tokens", type=int, default=128, metavar="N", help="per row (128)")
    parser.add_argument(
        "--strategies",
        default=",".join(STRATEGIES),
        metavar="NAMES",
        help=f"comma-separated: {STRATEGIES}",
    )


def _model(args: argparse.Namespace, device: str) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=max(args.hidden // 64, 1),
        num_key_value_heads=max(args.hidden // 128, 1), max_position_embeddings=args.tokens,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).to(device)  # type: ignore[arg-type]


def _batches(args: argparse.Namespace, step: int) -> list[Any]:
    import torch

    g = torch.Generator().manual_seed(1000 + step)
    return [
        torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g)
        for _ in range(args.micro_batches)
    ]


def _peak(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _flat_sum(params: Sequence[Any]) -> None:
    """The gradients of ``params`` summed over the ranks with one all-reduce of one flat
    buffer per dtype (what the torch backend did before it used DDP)."""
    import torch
    import torch.distributed as dist

    buckets: dict[Any, list[Any]] = {}
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        buckets.setdefault((p.grad.dtype, p.grad.device), []).append(p)
    for members in buckets.values():
        flat = torch.cat([p.grad.reshape(-1) for p in members])
        dist.all_reduce(flat)
        offset = 0
        for p in members:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p))
            offset += n


def _rank(strategy: str, rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    """One rank of ``strategy``; rank 0 writes the results to stdout as JSON."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = args.device == "cuda"
    device = f"cuda:{rank}" if cuda else "cpu"
    if cuda:
        torch.cuda.set_device(rank)
    if world > 1:
        dist.init_process_group(
            "nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
            world_size=world,
        )  # fmt: skip
    model = _model(args, device)
    n = args.micro_batches
    # The torch backend's deal for micro-batches of equal size: one each in turn.
    indices = list(range(rank, n, world))
    if strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        wrapped: Any = DistributedDataParallel(model)
    elif strategy == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        wrapped = model
    else:
        wrapped = model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    times = []
    for step in range(args.steps):
        batches = _batches(args, step)
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        for k, i in enumerate(indices):
            ids = batches[i].to(device)
            last = k == len(indices) - 1
            if strategy == "fsdp2":
                wrapped.set_requires_gradient_sync(last)
            # Each micro-batch's loss is its share of the step's: the sum is the step's.
            # DDP and FSDP2 average over the ranks: their loss is scaled up to a sum.
            scale = (world if strategy in ("ddp", "fsdp2") else 1) / n
            if strategy == "ddp" and not last:
                with wrapped.no_sync():
                    (wrapped(input_ids=ids, labels=ids).loss * scale).backward()
            else:
                (wrapped(input_ids=ids, labels=ids).loss * scale).backward()
        if strategy == "flat_all_reduce" and world > 1:
            _flat_sum(list(model.parameters()))
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    if strategy == "fsdp2":
        full = {k: v.full_tensor() for k, v in model.state_dict().items()}
    else:
        full = dict(model.state_dict())
    weights = {k: v.detach().float().cpu() for k, v in full.items()}
    peaks = [_peak(device)]
    if world > 1:
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, peaks[0])
        peaks = gathered
    if rank == 0:
        steady = times[1:] or times
        out = {"step_s": statistics.median(steady), "steps_s": times, "peak_mib": peaks}
        torch.save(weights, os.environ["BENCH_DP_WEIGHTS"])
        print(json.dumps(out), flush=True)
    if world > 1:
        dist.destroy_process_group()


def _strategy(strategy: str, args: argparse.Namespace, tmp: str) -> dict[str, Any]:
    import subprocess

    from benchmarks import free_port

    world = 1 if strategy == "one_process" else args.ranks
    port = free_port()
    weights = os.path.join(tmp, f"{strategy}.pt")
    argv = [sys.executable, "-m", "benchmarks.data_parallel", "--_rank"]
    passed = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k in _PASSED]
    env = {**os.environ, "BENCH_DP_WEIGHTS": weights, "OMP_NUM_THREADS": "1"}
    procs = [
        subprocess.Popen(
            [*argv, strategy, str(r), str(world), str(port), *passed],
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        for r in range(world)
    ]
    outs = [p.communicate()[0] for p in procs]
    for r, p in enumerate(procs):
        if p.returncode:
            raise RuntimeError(f"{strategy}: rank {r} exited with {p.returncode}")
    result: dict[str, Any] = json.loads(outs[0].strip().splitlines()[-1])
    result["weights_file"] = weights
    return result


_PASSED = ("device", "layers", "hidden", "vocab", "steps", "micro_batches", "batch", "tokens")


def run(args: argparse.Namespace) -> dict[str, Any]:
    import tempfile

    import torch

    wanted = [s.strip() for s in args.strategies.split(",") if s.strip()]
    unknown = sorted(set(wanted) - set(STRATEGIES))
    if unknown:
        raise SystemExit(f"unknown strategies {unknown}; known: {', '.join(STRATEGIES)}")
    if "one_process" not in wanted:
        wanted.insert(0, "one_process")
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for strategy in wanted:
            print(f"data-parallel bench: {strategy}", file=sys.stderr, flush=True)
            results[strategy] = _strategy(strategy, args, tmp)
        ref = torch.load(results["one_process"]["weights_file"])
        for r in results.values():
            got = torch.load(r.pop("weights_file"))
            r["max_weight_diff_vs_one_process"] = max(
                float((got[k] - ref[k]).abs().max()) for k in ref
            )
    params = sum(p.numel() for p in _model(args, "cpu").parameters())
    base = results.get("flat_all_reduce", {}).get("step_s")
    for r in results.values():
        if base:
            r["step_vs_flat_all_reduce"] = r["step_s"] / base
    return {
        "ranks": args.ranks, "device": args.device, "parameters": params,
        "micro_batches": args.micro_batches, "tokens_per_micro_batch": args.batch * args.tokens,
        "load_1m": os.getloadavg()[0], "strategies": results,
    }  # fmt: skip


def _main(args: argparse.Namespace) -> int:
    out = run(args)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(
        f"{out['parameters'] / 1e6:.1f} M parameters, {out['ranks']} ranks on {out['device']}, "
        f"{out['micro_batches']} micro-batches of {out['tokens_per_micro_batch']} tokens"
    )
    for name, r in out["strategies"].items():
        peaks = ", ".join(f"{p:.0f}" for p in r["peak_mib"])
        print(
            f"  {name:16s} step {r['step_s']:.3f} s  peak MiB per rank [{peaks}]  "
            f"weights vs one process {r['max_weight_diff_vs_one_process']:.2e}"
        )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--_rank"]:
        strategy, rank, world, port = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
        parser = bench_parser(None, "data-parallel", help="", doc=None, json=JSON)
        _add_arguments(parser)
        _rank(strategy, rank, world, port, parser.parse_args(argv[5:]))
        return 0
    parser = bench_parser(None, "data-parallel", help="", doc=__doc__, json=JSON)
    _add_arguments(parser)
    return _main(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
