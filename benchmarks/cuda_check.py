"""A check of the key/value pool, the prefix cache and CUDA graphs on a GPU (minutes).

    python -m benchmarks.cuda_check [--device cuda:0]

On a small random Llama (fp32, so that graphed and eager steps agree to 1e-4): decode
graphs against eager steps, with the prefix cache on and off; a GRPO group and a 3-turn
episode reuse their prompts (``cached_tokens``); a pool of 600 tokens retracts and
resumes requests and gives what a roomy pool gives; a weight update drops the cache; the
default pool's size from ``mem_fraction_static``. Prints one JSON object (``ok`` and each
check's numbers) and exits 1 when a check fails. Also run
``pytest tests/agentenv/engine/test_cuda.py`` there.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio

from agentenv import SamplingParams


class NumberTokenizer:
    """Decodes ids as their numbers (no stop strings are used with it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return " ".join(map(str, ids))


def tiny_llama(path: Path, seed: int, *, hidden: int = 128, layers: int = 3) -> Path:
    """A random Llama of 512 ids with peaked distributions (weights of std 0.15), saved
    at ``path`` (also the engine tests' model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.15)
    model.save_pretrained(str(path))
    return path


async def _run(engine: Any, prompts: Sequence[list[int]], params: Sequence[Any]) -> list[Any]:
    out: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        out[i] = await engine.generate(prompts[i], params[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out


def _gap(a: list[Any], b: list[Any]) -> tuple[bool, float]:
    same = all(x.output_ids == y.output_ids for x, y in zip(a, b, strict=True))
    gap = max(
        abs(p - q)
        for x, y in zip(a, b, strict=True)
        for p, q in zip(x.logprobs, y.logprobs, strict=True)
    )
    return same, gap


async def check(device: str, root: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    from agentenv.engine import Engine

    a, b = tiny_llama(root / "a", 0), tiny_llama(root / "b", 1)
    system = [1 + (j * 7) % 500 for j in range(60)]
    prompts = [[*system, 400 + i, 401] for i in range(4) for _ in range(4)]
    params = [
        SamplingParams(max_new_tokens=200, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    results: dict[str, Any] = {}

    def engine(path: Path, graphs: bool, cache: bool = True, **kw: Any) -> Engine:
        kw.setdefault("context_length", 1024)
        return Engine(
            path, device=device, dtype=__import__("torch").float32, tokenizer=NumberTokenizer(),
            max_running=32, cuda_graphs=graphs, prefix_cache=cache, **kw,
        )  # fmt: skip

    runs = {}
    for name, graphs, cache in (
        ("graphs_cache", True, True),
        ("eager_cache", False, True),
        ("graphs_nocache", True, False),
    ):
        async with engine(a, graphs, cache) as e:
            runs[name] = await _run(e, prompts, params)
            if graphs:
                assert e.model.graphs is not None
                results[f"{name}_graphs"] = e.model.graphs.captures  # type: ignore[attr-defined]
            results[f"{name}_cached_tokens"] = sum(c.cached_tokens for c in runs[name])
            results[f"{name}_pool_tokens"] = e.max_total_tokens
    same, gap = _gap(runs["graphs_cache"], runs["eager_cache"])
    results["graphs_vs_eager"] = {"same_tokens": same, "max_logprob_gap": gap}
    same2, gap2 = _gap(runs["graphs_cache"], runs["graphs_nocache"])
    results["cache_vs_none"] = {"same_tokens": same2, "max_logprob_gap": gap2}

    # A 3-turn episode reuses each turn.
    async with engine(a, True) as e:
        prompt, cached = list(system), []
        for turn in range(3):
            c = await e.generate(prompt, SamplingParams(max_new_tokens=20, seed=turn))
            cached.append(c.cached_tokens)
            prompt = prompt + c.output_ids + [30, 31, 32]
        results["episode_cached_tokens"] = cached
        # A weight update drops the cache.
        await e.update_weights(load_file(str(b / "model.safetensors")))
        after = await e.generate(system, SamplingParams(max_new_tokens=5, seed=0))
        results["cached_after_update"] = after.cached_tokens
    # A small pool: retractions, same results as a roomy one.
    long = [SamplingParams(max_new_tokens=295, seed=i, ignore_eos=True) for i in range(3)]
    three = [[1 + i, 2, 3, 4, 5, 6, 7, 8, 9, 10] for i in range(3)]
    async with engine(a, True, max_total_tokens=600, context_length=320) as e:
        tight = await _run(e, three, long)
        results["retractions"] = e.retractions
    async with engine(a, True, max_total_tokens=4000, context_length=320) as e:
        roomy = await _run(e, three, long)
    same3, gap3 = _gap(tight, roomy)
    results["retracted_vs_roomy"] = {"same_tokens": same3, "max_logprob_gap": gap3}
    results["ok"] = bool(
        same
        and gap < 1e-4
        and same2
        and gap2 < 1e-4
        and all(c > 0 for c in cached[1:])
        and results["graphs_cache_cached_tokens"] > 0
        and results["cached_after_update"] == 0
        and results["retractions"] > 0
        and same3
        and gap3 < 1e-4
    )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as root:
        result = anyio.run(check, args.device, Path(root))
    print(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
