"""The key/value pool and the prefix cache in the engine: outputs bit for bit those of the
engine without the cache (CPU, fp32), prompts prefilled once per group and once per
episode, admission control under memory pressure, the pool's bad inputs, and invalidation
by weight updates and ``flush_cache``."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentenv import ConfigError, ContextLengthError, SamplingParams
from agentenv.engine import Engine
from benchmarks.cuda_check import NumberTokenizer, tiny_llama

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

SYSTEM = [1, 504, 345, 314, 253, 134, 28, 281, 122, 30, 2]  # ids of the tiny models (512)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return tiny_llama(root / "a", 0, hidden=64, layers=2), tiny_llama(
        root / "b", 1, hidden=64, layers=2
    )


def _prompt(i: int, n: int) -> list[int]:
    return [1 + (i * 31 + j * 7) % 500 for j in range(n)]


async def _episode(engine: Engine, seed: int, turns: int = 3) -> list[Any]:
    """A multi-turn episode: each turn's prompt is the last one, its completion and a
    tool's answer (the transcript only appends)."""
    prompt = [*SYSTEM, 400 + seed, 401, 402]
    out = []
    for turn in range(turns):
        params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=seed * 10 + turn)
        c = await engine.generate(prompt, params)
        out.append(c)
        prompt = prompt + c.output_ids + [30, 2, 450 + turn, 461, 2]
    return out


async def _workload(engine: Engine) -> list[Any]:
    """GRPO-shaped: a group of 4 samples of one prompt, arriving one after the other, a
    group of 4 arriving at once, and two 3-turn episodes running side by side."""
    results: list[Any] = []
    for i in range(4):
        p = SamplingParams(max_new_tokens=5, temperature=1.0, seed=i)
        results.append(await engine.generate([*SYSTEM, 77, 78, 79], p))
    together: list[Any] = [None] * 4
    episodes: list[Any] = [None] * 2

    async def one(i: int) -> None:
        p = SamplingParams(max_new_tokens=5, temperature=1.0, seed=50 + i)
        together[i] = await engine.generate([*SYSTEM, 90, 91], p)

    async def episode(i: int) -> None:
        episodes[i] = await _episode(engine, i)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
    async with anyio.create_task_group() as tg:
        for i in range(2):
            tg.start_soon(episode, i)
    return results + together + [c for e in episodes for c in e]


async def test_outputs_are_bitwise_those_without_the_prefix_cache(tiny: tuple[Path, Path]) -> None:
    model, numbers = tiny[0], NumberTokenizer()
    async with Engine(model, tokenizer=numbers, context_length=256, prefix_cache=False) as plain:
        expected = await _workload(plain)
        assert plain.cached_tokens == 0
        computed_plain = plain.prefill_computed
    async with Engine(model, tokenizer=numbers, context_length=256) as cached:
        got = await _workload(cached)
        assert cached.prefill_computed < computed_plain
    for a, b in zip(expected, got, strict=True):
        assert a.output_ids == b.output_ids
        assert a.logprobs == b.logprobs  # bit for bit, not approximately
    # The samples after the first of the sequential group found the prompt cached (all
    # but its last token, whose logits they need).
    assert [c.cached_tokens for c in got[:4]] == [0] + [len(SYSTEM) + 2] * 3
    # The group arriving at once: one prefill, three copies; its system prompt was cached.
    assert sorted(c.cached_tokens for c in got[4:8]) == [len(SYSTEM)] + [len(SYSTEM) + 2] * 3
    # Each next turn reuses the whole previous turn (its prompt and completion).
    for e in (got[8:11], got[11:14]):
        for before, turn in itertools.pairwise(e):
            assert turn.cached_tokens >= before.prompt_tokens + len(before.output_ids) - 1


async def test_a_group_prefills_its_prompt_once(tiny: tuple[Path, Path]) -> None:
    prompt = _prompt(0, 200)
    async with Engine(tiny[0], tokenizer=NumberTokenizer(), max_total_tokens=4096) as engine:
        for i in range(8):
            params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=i)
            await engine.generate(prompt, params)
        # The first computes 200 tokens; each of the 7 others only the prompt's last one.
        assert engine.prefill_computed == 200 + 7
        assert engine.prefill_cached == 7 * 199


async def test_a_pool_smaller_than_one_request_is_refused_at_start(
    tiny: tuple[Path, Path],
) -> None:
    with pytest.raises(ConfigError, match=r"holds 100 tokens .* context length 256") as e:
        Engine(tiny[0], tokenizer=NumberTokenizer(), context_length=256, max_total_tokens=100)
    assert "--max-total-tokens" in str(e.value)
    # Without a context length the pool's size is the context: longer requests are refused.
    async with Engine(tiny[0], tokenizer=NumberTokenizer(), max_total_tokens=100) as engine:
        assert engine.context_length == 100
        with pytest.raises(ContextLengthError, match="pool holds 100 tokens"):
            await engine.generate(_prompt(1, 120), SamplingParams(max_new_tokens=1))
        with pytest.raises(ContextLengthError, match="pool holds 100 tokens"):
            await engine.generate(_prompt(1, 60), SamplingParams(max_new_tokens=60))


async def _run(
    engine: Engine, prompts: Sequence[list[int]], params: Sequence[SamplingParams]
) -> list[Any]:
    out: list[Any] = [None] * len(prompts)

    async def one(i: int) -> None:
        out[i] = await engine.generate(prompts[i], params[i])

    async with anyio.create_task_group() as tg:
        for i in range(len(prompts)):
            tg.start_soon(one, i)
    return out


async def test_a_thousand_waiting_requests_under_memory_pressure_all_complete(
    tiny: tuple[Path, Path],
) -> None:
    """1,000 requests at once against a pool of 200 tokens (room for a dozen or so): they
    wait their turn in the queue, the pool never holds more than its size, all complete,
    and each gives exactly what it gives with room to spare."""
    prompts = [_prompt(i % 37, 8 + i % 13) for i in range(1000)]
    params = [
        SamplingParams(max_new_tokens=1 + i % 4, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(1000)
    ]
    tight = Engine(tiny[0], tokenizer=NumberTokenizer(), max_running=32, max_total_tokens=200)
    most = 0
    async with tight:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal most
                while True:
                    most = max(most, tight.waiting)
                    assert tight.pool.size - tight.pool.available <= 200
                    await anyio.sleep(0.01)

            tg.start_soon(watch)
            got = await _run(tight, prompts, params)
            tg.cancel_scope.cancel()
        assert most > 500 and tight.running == 0
    assert all(len(c.output_ids) == p.max_new_tokens for c, p in zip(got, params, strict=True))
    sample = list(range(0, 1000, 25))
    async with Engine(tiny[0], tokenizer=NumberTokenizer(), max_total_tokens=20000) as roomy:
        expected = await _run(roomy, [prompts[i] for i in sample], [params[i] for i in sample])
    for i, e in zip(sample, expected, strict=True):
        assert got[i].output_ids == e.output_ids and got[i].logprobs == e.logprobs


async def test_a_full_pool_retracts_a_request_which_resumes_unchanged(
    tiny: tuple[Path, Path],
) -> None:
    """Three long requests against a pool with room for two prompts and their expected
    growth: the third waits; the two running outgrow the pool and the newer is retracted
    (its keys and values kept in the prefix cache) and resumed later; every output is
    what it is with room to spare, bit for bit."""
    prompts = [_prompt(i, 10) for i in range(3)]
    params = [
        SamplingParams(max_new_tokens=295, temperature=1.0, seed=i, ignore_eos=True)
        for i in range(3)
    ]
    async with Engine(tiny[0], tokenizer=NumberTokenizer(), max_total_tokens=600) as tight:
        got = await _run(tight, prompts, params)
        assert tight.retractions > 0
    async with Engine(tiny[0], tokenizer=NumberTokenizer(), max_total_tokens=4000) as roomy:
        expected = await _run(roomy, prompts, params)
        assert roomy.retractions == 0
    for a, b in zip(got, expected, strict=True):
        assert a.output_ids == b.output_ids and a.logprobs == b.logprobs


async def test_a_weight_update_drops_every_cached_key(tiny: tuple[Path, Path]) -> None:
    from safetensors.torch import load_file

    prompt = _prompt(3, 40)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=3)
    new = load_file(str(tiny[1] / "model.safetensors"))
    async with Engine(tiny[1], tokenizer=NumberTokenizer()) as reference:
        expected = await reference.generate(prompt, params)
    async with Engine(tiny[0], tokenizer=NumberTokenizer()) as engine:
        await engine.generate(prompt, params)
        assert (await engine.generate(prompt, params)).cached_tokens == len(prompt) - 1
        await engine.update_weights(new)
        after = await engine.generate(prompt, params)
        assert after.cached_tokens == 0  # nothing computed with the old weights is reused
        assert after.output_ids == expected.output_ids
        assert after.logprobs == expected.logprobs
        # From disk and in buckets (partial) the same.
        await engine.update_weights_from_disk(tiny[0])
        assert (await engine.generate(prompt, params)).cached_tokens == 0
        await engine.update_weights(dict(list(new.items())[:3]), partial=True)
        assert (await engine.generate(prompt, params)).cached_tokens == 0
        # flush_cache: refused while a request runs, then the cache is empty.
        assert engine.cached_tokens > 0
        assert await engine.flush_cache()
        assert engine.cached_tokens == 0 and engine.pool.available == engine.pool.size
        assert (await engine.generate(prompt, params)).cached_tokens == 0


async def test_requests_running_through_an_update_recompute_their_keys(
    tiny: tuple[Path, Path],
) -> None:
    """A request running when new weights arrive keeps its tokens so far and continues
    with the new weights only: what it makes after the update is what the new model makes
    from the same transcript, bit for bit (its keys and values were recomputed)."""
    from safetensors.torch import load_file

    prompt = _prompt(4, 30)
    greedy = SamplingParams(max_new_tokens=40, temperature=0, ignore_eos=True)
    result: dict[str, Any] = {}
    async with Engine(tiny[0], tokenizer=NumberTokenizer()) as engine:

        async def run() -> None:
            result["c"] = await engine.generate(prompt, greedy)

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            with anyio.fail_after(60):
                while engine.steps < 10:  # noqa: ASYNC110 - polling the step counter
                    await anyio.sleep(0.005)
            await engine.pause("in_place")
            refused = await engine.flush_cache()
            await engine.update_weights(
                load_file(str(tiny[1] / "model.safetensors")), weight_version="v2"
            )
            await engine.resume()
    assert not refused
    c = result["c"]
    spans = c.version_spans
    assert [v for v, _ in spans] == ["default", "v2"]
    k = spans[0][1]
    async with Engine(tiny[1], tokenizer=NumberTokenizer()) as reference:
        rest = await reference.generate(
            prompt + c.output_ids[:k], dataclasses.replace(greedy, max_new_tokens=40 - k)
        )
    assert c.output_ids[k:] == rest.output_ids
    assert c.logprobs[k:] == rest.logprobs
