"""A GRPO-shaped workload on the embedded engine: prompts prefilled once per group and once
per episode.

``agentenv bench engine --grpo`` runs, each measurement in a fresh process:

* ``G`` groups of 8 samples (``G`` = 4 and 16): ``G`` distinct 200-token prompts, each
  sent 8 times at once (seeded, temperature 1, EOS ignored, 64 new tokens). The engine
  with its prefix cache and without it (``prefix_cache=False``: every prompt computed
  whole): prompt tokens computed, generated tokens/s, peak RSS; against Hugging Face
  ``generate`` with ``num_return_sequences=8`` on the same ``G`` prompts (one batch).
* A 5-turn tool episode: a 200-token prompt, 32 new tokens a turn, then a 30-token tool
  answer appended (the transcript only appends); seconds per turn and prompt tokens
  computed, with the cache (each turn reuses the last) and without.

Time runs from submitting the prompts to the last token, prefill included, after one
untimed run of the same workload (the steady state of a run's rollouts). ::

    python -m benchmarks.engine_grpo --groups 4 16
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import anyio

from agentenv import SamplingParams
from benchmarks import run_child

SAMPLES = 8
PROMPT_TOKENS = 200
NEW_TOKENS = 64
TURNS = 5
TURN_TOKENS = 32
TOOL_TOKENS = 30


def grpo_prompts(tokenizer: Any, n: int, length: int = PROMPT_TOKENS) -> list[list[int]]:
    """``n`` distinct chat prompts of exactly ``length`` tokens."""
    out = []
    for i in range(n):
        words = " ".join(f"clue {i}.{j} is {(i * 7919 + j * 104729) % 997}" for j in range(80))
        text = f"<|im_start|>user\nPuzzle {i}: {words}"
        ids = tokenizer.encode(text, add_special_tokens=False).ids[: length - 3]
        tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n").ids
        out.append((ids + tail)[:length] if len(ids + tail) >= length else ids + tail)
        if len(out[-1]) != length:
            raise RuntimeError(f"prompt {i} has {len(out[-1])} tokens, not {length}")
    return out


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _engine(model_dir: Path, device: str, cache: bool, running: int) -> Any:
    from agentenv.engine import Engine

    return Engine(model_dir, device=device, max_running=running, prefix_cache=cache)


def measure_groups(model_dir: Path, device: str, groups: int, cache: bool) -> dict[str, Any]:
    from tokenizers import Tokenizer

    # The second half warms the engine up (the first steps of a run: CUDA graphs captured
    # for the batch sizes the workload reaches) on other prompts; the first is measured.
    prompts = grpo_prompts(Tokenizer.from_file(str(model_dir / "tokenizer.json")), 2 * groups)

    async def main() -> dict[str, Any]:
        async with _engine(model_dir, device, cache, groups * SAMPLES) as engine:

            async def one(g: int, s: int) -> None:
                params = SamplingParams(
                    max_new_tokens=NEW_TOKENS, temperature=1.0, ignore_eos=True, seed=g * 100 + s
                )
                c = await engine.generate(prompts[g], params)
                if len(c.output_ids) != NEW_TOKENS:
                    raise RuntimeError(f"{len(c.output_ids)} tokens, not {NEW_TOKENS}")

            async def workload(first: int) -> None:
                async with anyio.create_task_group() as tg:
                    for g in range(first, first + groups):
                        for s in range(SAMPLES):
                            tg.start_soon(one, g, s)

            await workload(groups)
            await engine.flush_cache()
            computed = engine.prefill_computed
            start = time.perf_counter()
            await workload(0)
            elapsed = time.perf_counter() - start
            return {
                "prefill_tokens_computed": engine.prefill_computed - computed,
                "prompt_tokens": groups * SAMPLES * PROMPT_TOKENS,
                "tokens_per_s": round(groups * SAMPLES * NEW_TOKENS / elapsed, 2),
                "seconds": round(elapsed, 3),
                "peak_rss_mb": round(_rss_mb()),
            }

    return anyio.run(main)


def measure_hf(model_dir: Path, device: str, groups: int) -> dict[str, Any]:
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    prompts = grpo_prompts(Tokenizer.from_file(str(model_dir / "tokenizer.json")), groups)
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    model = model.to(device).eval()
    ids = torch.tensor(prompts, device=device)  # same length: no padding

    def run(n: int) -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids[:n],
                attention_mask=torch.ones_like(ids[:n]),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                num_return_sequences=SAMPLES,
                pad_token_id=0,
            )
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        if out.shape != (n * SAMPLES, PROMPT_TOKENS + NEW_TOKENS):
            raise RuntimeError(f"HF generate made {tuple(out.shape)}")
        return time.perf_counter() - start

    run(groups)  # warm-up, as the engine's
    elapsed = run(groups)
    return {
        "tokens_per_s": round(groups * SAMPLES * NEW_TOKENS / elapsed, 2),
        "seconds": round(elapsed, 3),
        "peak_rss_mb": round(_rss_mb()),
    }


def measure_episode(model_dir: Path, device: str, cache: bool) -> dict[str, Any]:
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    prompt = grpo_prompts(tokenizer, 1)[0]
    tool = (tokenizer.encode(" ".join(["result"] * 60)).ids * 2)[:TOOL_TOKENS]

    async def main() -> dict[str, Any]:
        async with _engine(model_dir, device, cache, 8) as engine:
            await engine.generate([1, 2, 3, 4], SamplingParams(max_new_tokens=2, seed=0))
            await engine.flush_cache()
            computed = engine.prefill_computed
            transcript = list(prompt)
            times = []
            for turn in range(TURNS):
                params = SamplingParams(
                    max_new_tokens=TURN_TOKENS, temperature=1.0, ignore_eos=True, seed=turn
                )
                start = time.perf_counter()
                c = await engine.generate(transcript, params)
                times.append(time.perf_counter() - start)
                transcript += c.output_ids + tool
            return {
                "seconds_per_turn": [round(t, 3) for t in times],
                "mean_seconds_per_turn": round(sum(times) / len(times), 3),
                "prefill_tokens_computed": engine.prefill_computed - computed,
                "final_transcript_tokens": len(transcript),
            }

    return anyio.run(main)


def bench(
    *,
    model_dir: Path,
    device: str = "cpu",
    groups: Sequence[int] = (4, 16),
    hf: bool = True,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> dict[str, Any]:
    """Every measurement in a child process; the JSON-ready result."""

    def child(*argv: str) -> dict[str, Any]:
        args = ["--measure", *argv, "--model", str(model_dir), "--device", device]
        return run_child("benchmarks.engine_grpo", args, timeout=3600, one_thread=False)

    result: dict[str, Any] = {
        "prompt_tokens": PROMPT_TOKENS,
        "samples_per_prompt": SAMPLES,
        "new_tokens": NEW_TOKENS,
        "groups": {},
    }
    for g in groups:
        row: dict[str, Any] = {}
        for name in ("shared", "unshared", "hf"):
            if name == "hf" and not hf:
                continue
            row[name] = child(name, "--groups", str(g))
            progress(f"{g:>2} x {SAMPLES} {name:>8}: {json.dumps(row[name])}")
        shared = row["shared"]
        shared["prefilled_once"] = shared["prefill_tokens_computed"] == g * PROMPT_TOKENS
        if "hf" in row:
            row["speedup_vs_hf"] = round(shared["tokens_per_s"] / row["hf"]["tokens_per_s"], 3)
        result["groups"][str(g)] = row
    episode = {name: child("episode", "--cache", name) for name in ("on", "off")}
    for name, r in episode.items():
        progress(f"5-turn episode, cache {name}: {json.dumps(r)}")
    result["episode"] = episode
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--groups", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--measure", choices=["shared", "unshared", "hf", "episode"])
    parser.add_argument("--cache", choices=["on", "off"], default="on")
    args = parser.parse_args(argv)
    from agentenv.engine import resolve_model

    model_dir = Path(resolve_model(args.model))
    if args.measure == "hf":
        out = measure_hf(model_dir, args.device, args.groups[0])
    elif args.measure == "episode":
        out = measure_episode(model_dir, args.device, args.cache == "on")
    elif args.measure:
        out = measure_groups(model_dir, args.device, args.groups[0], args.measure == "shared")
    else:
        out = bench(model_dir=model_dir, device=args.device, groups=args.groups, hf=not args.no_hf)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
