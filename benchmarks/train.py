"""``agentenv bench train``: the torch backend's training step against a plain Hugging Face
step, and the in-process weight sync to the embedded engine.

A random-initialised Llama of about ``--params`` parameters (SmolLM2's vocabulary) trains
on ``--samples`` samples of ``--tokens`` tokens (half prompt, half completion) per step.
``ours``: :meth:`trainer.TorchBackend.train_step` (old log-probs given, so one forward and
backward), the output layer in checkpointed chunks. ``hf``: the model's own forward with
full-vocabulary fp32 ``log_softmax``, the same GRPO loss, AdamW -- the plain way. Reported
per side: seconds per step, tokens/s, MFU (6·N·tokens / time / peak) and peak memory; then
the seconds to install the trained weights in an :class:`~agentenv.engine.Engine`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import bench_parser

__all__ = ["add_parser"]

# bf16 FLOP/s that MFU is measured against: on the H200 the dense matmul rate measured
# there (about 790 TFLOP/s; the data sheet says 989); elsewhere the data sheet.
PEAKS = {"H200": 790e12, "H100": 989e12, "A100": 312e12}


def add_parser(sub: Any) -> None:
    parser = bench_parser(
        sub, "train", help="training step (ours vs plain HF) and weight sync", doc=__doc__
    )
    parser.add_argument("--device", default="cuda", metavar="DEVICE", help="cuda (default) or cpu")
    parser.add_argument(
        "--hidden", type=int, metavar="N", default=2048, help="hidden size (2048: ~0.9B)"
    )
    parser.add_argument("--layers", type=int, metavar="N", default=16, help="decoder layers")
    parser.add_argument("--samples", type=int, metavar="N", default=8, help="samples per step")
    parser.add_argument("--tokens", type=int, metavar="N", default=1024, help="tokens per sample")
    parser.add_argument(
        "--varied-lengths",
        action="store_true",
        help="samples of tokens/8 to tokens tokens (seeded), as rollouts are; the plain HF "
        "step (one equal-length batch) is then left out",
    )
    parser.add_argument("--steps", type=int, metavar="N", default=5, help="timed steps per side")
    parser.add_argument(
        "--logit-chunk", type=int, metavar="N", default=2048, help="ours: logit chunk rows"
    )
    parser.add_argument(
        "--entropy",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="ours: also compute the entropy metric (the HF side does not)",
    )
    parser.add_argument(
        "--precision",
        choices=("fp32", "bf16-autocast", "bf16"),
        default=None,
        help="ours: the torch backend's precision (default: bf16-autocast on CUDA, fp32 on CPU)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="ours: compile each decoder layer (TorchBackend(compile=True); agentenv train's "
        "default on CUDA)",
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="ours: recompute each decoder layer in the backward (agentenv train's default on "
        "CUDA; off here, so that MFU counts no recomputation)",
    )
    parser.add_argument(
        "--megatron",
        action="store_true",
        help="also time the megatron backend's step on the same model (needs megatron-core)",
    )
    parser.add_argument(
        "--tokenizer-dir", metavar="DIR", help="where tokenizer.json is (default: smollm2-135m's)"
    )
    parser.set_defaults(handler=_main)


def _model_dir(root: Path, hidden: int, layers: int, tokenizer_dir: str | None) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agentenv.engine import resolve_model

    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=hidden,
        intermediate_size=int(hidden * 8 / 3) // 64 * 64,
        num_hidden_layers=layers,
        num_attention_heads=hidden // 64,
        num_key_value_heads=max(1, hidden // 256),
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model: Any = LlamaForCausalLM(config)
    model = model.to(torch.bfloat16)
    model.save_pretrained(root, safe_serialization=True)
    # The engine wants a tokenizer beside the weights.
    source = Path(tokenizer_dir) if tokenizer_dir else resolve_model("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (source / name).exists():
            (root / name).write_bytes((source / name).read_bytes())
    return root


def _samples(n: int, tokens: int, varied: bool = False) -> list[Any]:
    import torch

    from agentenv import Sample

    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(n):
        if varied:
            length = int(torch.randint(max(2, tokens // 8), tokens + 1, (1,), generator=g))
        else:
            length = tokens
        half = length // 2
        out.append(
            Sample(
                prompt_ids=torch.randint(3, 49152, (half,), generator=g).tolist(),
                completion_ids=torch.randint(3, 49152, (length - half,), generator=g).tolist(),
                reward=float(i % 2),
                group_id=f"g{i // 4}",
            )
        )
    return out


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _peak_mem(device: str) -> float:
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.startswith("cuda") else 0.0


def _hf_step(model: Any, optimizer: Any, batch: Any, adv: Any, start: int) -> None:
    import torch

    logits = model(input_ids=batch).logits  # [B, T, V], bf16
    logp = torch.log_softmax(logits.float(), dim=-1)  # full-vocabulary fp32
    target = batch[:, start:]
    token_logp = logp[:, start - 1 : -1].gather(-1, target[..., None])[..., 0]
    ratio = torch.exp(token_logp - token_logp.detach())
    loss = -(adv[:, None] * ratio).mean()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
    import anyio
    import torch

    from trainer import OptimConfig, TorchBackend, compute_advantages

    device = args.device
    out: dict[str, Any] = {"bench": "train", "device": device}
    if device.startswith("cuda"):
        name = torch.cuda.get_device_name()
        out["gpu"] = name
        peak = next((v for k, v in PEAKS.items() if k in name), None)
    else:
        peak = None
    samples = _samples(args.samples, args.tokens, args.varied_lengths)
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples])
    tokens_per_step = sum(len(s.prompt_ids) + len(s.completion_ids) for s in samples)
    out["tokens_per_step"] = tokens_per_step
    with tempfile.TemporaryDirectory() as tmp:
        root = _model_dir(Path(tmp), args.hidden, args.layers, args.tokenizer_dir)
        # -- ours --
        backend = TorchBackend(
            root, device=device, precision=args.precision, optim=OptimConfig(lr=1e-6),
            max_tokens_per_micro_batch=tokens_per_step, logit_chunk=args.logit_chunk,
            entropy_metric=args.entropy, compile=args.compile,
            gradient_checkpointing=args.gradient_checkpointing,
        )  # fmt: skip
        n_params = sum(p.numel() for p in backend.model.parameters())
        out["params"] = n_params
        out["precision"] = backend.precision.name
        out["compile"] = args.compile
        out["gradient_checkpointing"] = args.gradient_checkpointing
        if device.startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        ours = _median_step(backend, samples, adv, args.steps, device)
        out["ours"] = _side(ours, tokens_per_step, n_params, peak, _peak_mem(device))
        if args.megatron:
            del backend  # the device to the megatron side
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            from trainer.megatron import MegatronBackend

            mega_times: dict[str, float] = {}
            mega_sides: dict[str, dict[str, Any]] = {
                "megatron": {"qkv_format": "bshd"},  # padded rows
                "megatron_packed": {"qkv_format": "thd"},
                "megatron_local_attention": {"attention": "local"},
            }
            for side, kwargs in mega_sides.items():
                mega = MegatronBackend(
                    root, device=device, optim=OptimConfig(lr=1e-6), **kwargs,
                    max_tokens_per_micro_batch=tokens_per_step, entropy_metric=args.entropy,
                )  # fmt: skip
                mega_times[side] = _median_step(mega, samples, adv, args.steps, device)
                out[side] = _side(
                    mega_times[side], tokens_per_step, n_params, peak, _peak_mem(device)
                )
                del mega
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            out["megatron_vs_ours"] = round(ours / mega_times["megatron"], 3)
            packed = mega_times["megatron_packed"]
            out["megatron_packed_vs_padded"] = round(mega_times["megatron"] / packed, 3)
            out["megatron_packed_vs_ours"] = round(ours / packed, 3)
            backend = TorchBackend(root, device=device, precision=args.precision)  # for the sync
        # -- weight sync into the engine on the same device --
        from agentenv.engine import Engine

        weights, (dtype, residual) = backend.state_dict(), backend.precision.engine_dtypes()

        async def sync(weights: dict[str, Any] = weights) -> float:
            async with Engine(
                root, device=device, dtype=dtype, residual_dtype=residual, cuda_graphs=False
            ) as e:
                await e.update_weights(weights, weight_version="warm")
                _sync(device)
                t = time.perf_counter()
                await e.update_weights(weights, weight_version="1")
                _sync(device)
                return time.perf_counter() - t

        try:
            out["weight_sync_s"] = round(anyio.run(sync), 3)
        except Exception as e:  # report it (and where), keep the step numbers
            import traceback

            frame = traceback.extract_tb(e.__traceback__)[-1]
            where = f"{Path(frame.filename).name}:{frame.lineno} {frame.line or ''}".strip()
            out["weight_sync_error"] = f"{type(e).__name__}: {e} (at {where})"
        del backend, weights  # free the device for the HF side
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if args.varied_lengths:
            return out
        # -- plain HF --
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.bfloat16).to(device)
        model.train()
        batch = torch.tensor([[*s.prompt_ids, *s.completion_ids] for s in samples], device=device)
        advantages = adv.to(device)
        # The plain way (torch's default AdamW), then the same with the fused AdamW that
        # ours uses on CUDA: the strongest plain alternative.
        variants = (
            [("hf", False), ("hf_fused_adamw", True)]
            if device.startswith("cuda")
            else [("hf", False)]
        )
        for label, fused in variants:
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=fused)
            times = []
            try:
                for i in range(args.steps + 1):
                    _sync(device)
                    t = time.perf_counter()
                    _hf_step(model, optimizer, batch, advantages, args.tokens // 2)
                    _sync(device)
                    if i:
                        times.append(time.perf_counter() - t)
                hf = sorted(times)[len(times) // 2]
                out[label] = _side(hf, tokens_per_step, n_params, peak, _peak_mem(device))
                out[f"speedup_vs_{label}"] = round(hf / ours, 3)
            except torch.OutOfMemoryError:
                out[label] = "out of memory"
            del optimizer
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
    return out


def _median_step(backend: Any, samples: Any, adv: Any, steps: int, device: str) -> float:
    """The median seconds of ``steps`` train steps after one warm-up (old log-probs given,
    so one forward and backward per step)."""
    import torch

    old = backend.logprobs(samples)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(steps + 1):
        _sync(device)
        t = time.perf_counter()
        backend.train_step(samples, adv, old_logprobs=old)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def _side(
    seconds: float, tokens: int, params: int, peak: float | None, mem_gib: float
) -> dict[str, Any]:
    side: dict[str, Any] = {
        "step_s": round(seconds, 4),
        "tokens_per_s": round(tokens / seconds, 1),
        "peak_memory_gib": round(mem_gib, 2),
    }
    if peak:
        side["mfu"] = round(6 * params * tokens / seconds / peak, 4)
    return side


def _main(args: argparse.Namespace) -> int:
    result = run(args)
    print(json.dumps(result, indent=None if args.json else 1), file=sys.stdout)
    return 0
