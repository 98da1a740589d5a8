"""The embedded engine on CUDA: captured decode graphs compute what eager steps compute,
logprobs match a plain forward, greedy output matches HF ``generate``, and an in-place
weight update reaches the graphs. A small random Llama keeps it quick; skipped without
a GPU (CI has none: results are recorded in docs/benchmarks.md)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentenv import SamplingParams
from agentenv.engine import Engine
from benchmarks.cuda_check import NumberTokenizer, tiny_llama
from tests._gpu import gpu_test
from tests.agentenv.engine.plain_forward import plain_logprobs

# AGENTENV_TEST_CUDA_DEVICE=cuda:1 runs these on another GPU (graphs must follow it).
DEVICE = os.environ.get("AGENTENV_TEST_CUDA_DEVICE", "cuda")

pytestmark = [
    gpu_test(1 + int(DEVICE.partition(":")[2] or 0)),
    pytest.mark.anyio,
    pytest.mark.timeout(600),
]
PROMPTS = [[1 + (i * 7 + j) % 500 for j in range(5 + 9 * i)] for i in range(11)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return tiny_llama(root / "a", 0), tiny_llama(root / "b", 1)


async def _run(engine: Engine, params: SamplingParams) -> list[Any]:
    results: list[Any] = [None] * len(PROMPTS)

    async def one(i: int) -> None:
        results[i] = await engine.generate(PROMPTS[i], dataclasses.replace(params, seed=i))

    async with anyio.create_task_group() as tg:
        for i in range(len(PROMPTS)):
            tg.start_soon(one, i)
    return results


def _engine(
    path: Path,
    graphs: bool,
    dtype: torch.dtype = torch.float32,
    residual_dtype: torch.dtype | None = None,
) -> Engine:
    return Engine(
        path,
        device=DEVICE,
        dtype=dtype,
        residual_dtype=residual_dtype,
        max_running=16,
        context_length=1024,
        tokenizer=NumberTokenizer(),
        cuda_graphs=graphs,
    )


async def test_graphs_match_eager_steps_and_a_plain_forward(tiny: tuple[Path, Path]) -> None:
    params = SamplingParams(temperature=1.0, max_new_tokens=300, ignore_eos=True)
    async with _engine(tiny[0], True) as graphed:
        with_graphs = await _run(graphed, params)
        assert graphed.model.graphs is not None and graphed.model.graphs.captures > 0
        # Sequences grew past the first attended lengths mid-run: graphs of several lengths.
        assert len({length for _, length in graphed.model.graphs._graphs}) > 1
        worst = 0.0
        for prompt, c in zip(PROMPTS, with_graphs, strict=True):
            plain = plain_logprobs(graphed.model, prompt + c.output_ids)[len(prompt) - 1 :]
            worst = max(worst, max(abs(a - b) for a, b in zip(plain, c.logprobs, strict=True)))
        assert worst < 1e-3, worst
        # Every bucket's graph writes its logits into the one shared buffer (a graph's
        # own output would stay allocated in the pool, one [b, V] tensor per bucket).
        graphs = graphed.model.graphs
        assert len(graphs._graphs) > 1
        for _, out in graphs._graphs.values():
            assert out.data_ptr() == graphs._logits.data_ptr()
    async with _engine(tiny[0], False) as eager:
        without = await _run(eager, params)
    for a, b in zip(with_graphs, without, strict=True):
        assert a.output_ids == b.output_ids
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-4


async def test_greedy_matches_hf_generate(tiny: tuple[Path, Path]) -> None:
    from transformers import AutoModelForCausalLM

    hf: Any = AutoModelForCausalLM.from_pretrained(str(tiny[0]), dtype=torch.float32)
    hf = hf.to(DEVICE).eval()
    params = SamplingParams(temperature=0.0, max_new_tokens=40, ignore_eos=True)
    async with _engine(tiny[0], True) as engine:
        ours = await _run(engine, params)
    for prompt, c in zip(PROMPTS, ours, strict=True):
        ids = torch.tensor([prompt], device=DEVICE)
        ref = hf.generate(ids, do_sample=False, max_new_tokens=40, pad_token_id=0)
        expected = ref[0, len(prompt) :].tolist()  # up to EOS, which HF stops at
        assert c.output_ids[: len(expected)] == expected


async def test_weight_update_reaches_the_graphs(tiny: tuple[Path, Path]) -> None:
    from safetensors.torch import load_file

    params = SamplingParams(temperature=1.0, max_new_tokens=30, ignore_eos=True)
    async with _engine(tiny[0], True) as engine:
        before = await _run(engine, params)
        await engine.update_weights(load_file(str(tiny[1] / "model.safetensors")))
        after = await _run(engine, params)
    async with _engine(tiny[1], False) as reference:
        expected = await _run(reference, params)
    assert [c.output_ids for c in after] == [c.output_ids for c in expected]
    assert [c.output_ids for c in after] != [c.output_ids for c in before]


async def test_mixed_precision_graphs_match_eager_steps_and_hf_under_autocast(
    tiny: tuple[Path, Path],
) -> None:
    """bf16 matrices with an fp32 residual stream (what the trainer's bf16-autocast
    samples from): graphed and eager decode agree, and the log-probs are those of the fp32
    HF model under ``torch.autocast("cuda", torch.bfloat16)`` up to bf16 noise."""
    from transformers import AutoModelForCausalLM

    mixed = (torch.bfloat16, torch.float32)
    params = SamplingParams(temperature=1.0, max_new_tokens=60, ignore_eos=True)
    async with _engine(tiny[0], True, *mixed) as graphed:
        assert graphed.model.norm.dtype == torch.float32
        assert graphed.model.lm_head.dtype == torch.bfloat16
        with_graphs = await _run(graphed, params)
        assert graphed.model.graphs is not None and graphed.model.graphs.captures > 0
    async with _engine(tiny[0], False, *mixed) as eager:
        without = await _run(eager, params)
    for a, b in zip(with_graphs, without, strict=True):
        assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs, strict=True)) < 1e-2
    hf: Any = AutoModelForCausalLM.from_pretrained(str(tiny[0]), dtype=torch.float32)
    hf = hf.to(DEVICE).eval()
    gaps: list[float] = []
    for prompt, c in zip(PROMPTS, with_graphs, strict=True):
        ids = torch.tensor([prompt + c.output_ids], device=DEVICE)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()
        lp = torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt) :, None])[:, 0]
        gaps += (lp.cpu().double() - torch.tensor(c.logprobs, dtype=torch.float64)).abs().tolist()
    assert sum(gaps) / len(gaps) < 0.05 and max(gaps) < 1.0, (sum(gaps) / len(gaps), max(gaps))
