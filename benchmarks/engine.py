"""The embedded engine against Hugging Face ``generate``: generated tokens per second.

Both run the same model, in the same dtype, on the same device, over the same prompts with
the same sampling (temperature 1, no top-k/top-p, EOS ignored so every request makes
exactly ``max_new_tokens`` tokens). At concurrency ``c``, the engine gets ``c`` concurrent
``generate`` calls (continuous batching); HF gets one ``generate`` call on the ``c``
prompts, left-padded into one batch -- how HF is used for batched sampling. Time runs from
submitting the prompts to the last token, prefill included. Every measurement runs in a
fresh process (one per side and level), the sides alternating level by level. ::

    python -m benchmarks.engine --device cpu --levels 1 8 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import anyio

from agentenv import SamplingParams
from benchmarks import run_child

LEVELS = (1, 8, 32, 128)
_TOPICS = (
    "a lighthouse keeper",
    "the first snow of the year",
    "a robot learning to paint",
    "two rival bakers",
    "a map that redraws itself",
    "the last train home",
    "a cat who runs a library",
    "an orchard on the moon",
)


def make_prompts(tokenizer: Any, n: int) -> list[list[int]]:
    """``n`` chat prompts of different lengths (about 30 to 70 tokens)."""
    rng = random.Random(0)
    prompts = []
    for i in range(n):
        topic = _TOPICS[i % len(_TOPICS)]
        detail = " ".join(
            rng.choice(("quiet", "bright", "strange", "old", "tiny", "endless"))
            for _ in range(rng.randrange(1, 30))
        )
        text = (
            "<|im_start|>user\nWrite a short story about "
            f"{topic}, number {i}. Make it {detail}.<|im_end|>\n<|im_start|>assistant\n"
        )
        prompts.append(tokenizer.encode(text, add_special_tokens=False).ids)
    return prompts


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


async def _engine_level(engine: Any, prompts: Sequence[list[int]], new: int) -> float:
    async def one(i: int, ids: list[int]) -> None:
        params = SamplingParams(temperature=1.0, max_new_tokens=new, ignore_eos=True, seed=i)
        out = await engine.generate(ids, params)
        if len(out.output_ids) != new:
            raise RuntimeError(f"the engine made {len(out.output_ids)} tokens, not {new}")

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i, ids in enumerate(prompts):
            tg.start_soon(one, i, ids)
    return time.perf_counter() - start


class HFBaseline:
    """HF ``generate`` on a left-padded batch: the comparison."""

    def __init__(self, model_dir: Path, device: str, dtype: Any) -> None:
        from transformers import AutoModelForCausalLM

        model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
        self.model = model.to(device).eval()
        self.device = device

    def run(self, prompts: Sequence[list[int]], new: int) -> float:
        """Seconds to generate ``new`` tokens for each prompt, in one batch."""
        import torch

        pad = 0
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=self.device)
        mask = torch.tensor(
            [[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=self.device
        )
        _sync(self.device)
        start = time.perf_counter()
        with torch.inference_mode():
            result = self.model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=new,
                min_new_tokens=new,
                pad_token_id=pad,
            )
        _sync(self.device)
        elapsed = time.perf_counter() - start
        if result.shape[1] - ids.shape[1] != new:
            raise RuntimeError(
                f"HF generate made {result.shape[1] - ids.shape[1]} tokens, not {new}"
            )
        return elapsed


def measure(
    side: str,
    model_dir: Path,
    device: str,
    dtype: Any,
    concurrency: int,
    new: int,
    *,
    cuda_graphs: bool = True,
) -> float:
    """Tokens/s of one side (``engine`` or ``hf``) at one concurrency, after a warm-up."""
    from tokenizers import Tokenizer

    prompts = make_prompts(Tokenizer.from_file(str(model_dir / "tokenizer.json")), concurrency)
    if side == "hf":
        baseline = HFBaseline(model_dir, device, dtype)
        baseline.run(prompts[:2], 4)  # warm-up
        return concurrency * new / baseline.run(prompts, new)

    from agentenv.engine import Engine

    async def main() -> float:
        async with Engine(
            model_dir, device=device, dtype=dtype, max_running=concurrency, cuda_graphs=cuda_graphs
        ) as engine:
            await _engine_level(engine, prompts[:2], 4)  # warm-up
            return concurrency * new / await _engine_level(engine, prompts, new)

    return anyio.run(main)


def _measure_in_child(
    side: str, model_dir: Path, device: str, dtype: str, c: int, new: int, cuda_graphs: bool
) -> float:
    # A fresh process per measurement: torch gives every thread that calls it an OpenMP
    # team of its own, and a second team in the process (the other side's) slows the
    # first -- each side is measured alone, as it runs in production.
    argv = ["--measure", side, "--model", str(model_dir), "--device", device, "--dtype", dtype]
    argv += ["--levels", str(c), "--max-new-tokens", str(new)]
    if not cuda_graphs:
        argv.append("--no-cuda-graphs")
    result = run_child("benchmarks.engine", argv, timeout=3600, one_thread=False)
    rate: float = result["tokens_per_s"]
    return rate


def random_model(template: Path, dtype: Any) -> Path:
    """A model of ``template``'s shape (its config.json) with random weights, in a temporary
    directory beside its tokenizer: for machines without the model's package."""
    import tempfile

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(template))
    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(config, dtype=dtype)  # type: ignore[no-untyped-call]
    out = Path(tempfile.mkdtemp(prefix="agentenv-random-"))
    model.save_pretrained(str(out))
    for name in ("tokenizer.json", "generation_config.json"):
        if (template / name).exists():
            shutil.copy(template / name, out / name)
    return out


def bench(
    *,
    model: str = "smollm2-135m",
    device: str = "cpu",
    dtype: str | None = None,
    levels: Sequence[int] = LEVELS,
    max_new_tokens: int = 128,
    hf: bool = True,
    random_weights: bool = False,
    cuda_graphs: bool = True,
    progress: Callable[[str], None] = lambda line: print(line, file=sys.stderr),
) -> dict[str, Any]:
    """Run both and return the JSON-ready result (``levels[c]`` has ``engine_tokens_per_s``,
    ``hf_generate_tokens_per_s`` and ``speedup``)."""
    import torch
    from tokenizers import Tokenizer

    torch_dtype = (
        getattr(torch, dtype) if dtype else (torch.float32 if device == "cpu" else torch.bfloat16)
    )
    with _model_dir(model, random_weights, torch_dtype) as model_dir:
        tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
        prompts = make_prompts(tokenizer, max(levels))
        dtype_name = str(torch_dtype).removeprefix("torch.")
        engine: dict[int, float] = {}
        reference: dict[int, float] = {}
        # The two sides alternate level by level, so that a slow phase of a shared machine
        # does not fall on one of them only.
        for c in levels:
            for side, rates in (("engine", engine), ("hf", reference)):
                if side == "hf" and not hf:
                    continue
                rates[c] = _measure_in_child(
                    side, model_dir, device, dtype_name, c, max_new_tokens, cuda_graphs
                )
                name = "engine     " if side == "engine" else "HF generate"
                progress(f"{name} c={c:>3}: {rates[c]:>9,.1f} tok/s")
        result: dict[str, Any] = {
            "bench": "engine",
            "model": model,
            "random_weights": random_weights,
            "cuda_graphs": cuda_graphs and device.startswith("cuda"),
            "device": device,
            "dtype": dtype_name,
            "device_name": torch.cuda.get_device_name(device)
            if device.startswith("cuda")
            else "cpu",
            "torch_threads": torch.get_num_threads(),
            "max_new_tokens": max_new_tokens,
            "prompt_tokens": [len(p) for p in prompts[: max(levels)]][:8],
            "levels": {},
        }
        for c in levels:
            row: dict[str, Any] = {"engine_tokens_per_s": round(engine[c], 2)}
            if c in reference:
                row["hf_generate_tokens_per_s"] = round(reference[c], 2)
                row["speedup"] = round(engine[c] / reference[c], 3)
            result["levels"][str(c)] = row
        return result


@contextlib.contextmanager
def _model_dir(model: str, random_weights: bool, dtype: Any) -> Iterator[Path]:
    """The model's directory; with ``random_weights`` a temporary one, removed after."""
    from agentenv.engine import resolve_model

    if not random_weights:
        yield Path(resolve_model(model))
        return
    template = Path(model) if Path(model).is_dir() else Path(resolve_model(model))
    directory = random_model(template, dtype)
    try:
        yield directory
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--levels", type=int, nargs="+", default=list(LEVELS))
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--no-hf", action="store_true")
    parser.add_argument("--random-weights", action="store_true")
    parser.add_argument("--no-cuda-graphs", action="store_true")
    parser.add_argument("--measure", choices=["engine", "hf"], help="one side, one level")
    args = parser.parse_args(argv)
    if args.measure:
        import torch

        rate = measure(
            args.measure,
            Path(args.model),
            args.device,
            getattr(torch, args.dtype),
            args.levels[0],
            args.max_new_tokens,
            cuda_graphs=not args.no_cuda_graphs,
        )
        print(json.dumps({"tokens_per_s": rate}))
        return 0
    result = bench(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        levels=args.levels,
        max_new_tokens=args.max_new_tokens,
        hf=not args.no_hf,
        random_weights=args.random_weights,
        cuda_graphs=not args.no_cuda_graphs,
    )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
