"""The embedded engine: consistency with transformers, continuous batching, sampling,
stops, abort, pause, weight updates; and SGLangClient against `agentenv serve` over
real loopback HTTP (conformance)."""

from __future__ import annotations

import threading
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import anyio
import pytest
import torch

from agentenv import ClosedResourceError, ConfigError, ContextLengthError, SamplingParams
from agentenv.engine import Engine, EngineServer, resolve_model
from agentenv.sglang import SGLangClient, SGLangError

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

PROMPT = [1, 504, 3458, 314, 253, 1345, 28, 2817, 5122, 30]


async def _until_step(engine: Engine, n: int) -> None:
    with anyio.fail_after(120):  # (a bound against a hang, not a timing)
        while engine.steps < n:  # noqa: ASYNC110 - polling the engine's step counter
            await anyio.sleep(0.01)


class Gate:
    """Holds the engine's model thread before each scheduler step until the test lets it
    take one (:meth:`allow`), so that an abort, a pause or a new request lands at a known
    step however fast or slow the machine is. Open for good on exit."""

    def __init__(self, engine: Engine) -> None:
        self.engine, self._step = engine, engine._step
        self._cond = threading.Condition()
        self._allowed, self._open, self._through = 0, False, False

    def __enter__(self) -> Gate:
        self.engine._step = self._gated  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.open()

    def _gated(self, candidates: Any) -> Any:
        with self._cond:
            self._cond.wait_for(lambda: self._open or self._through or self._allowed > 0)
            if not (self._open or self._through):
                self._allowed -= 1
        return self._step(candidates)

    async def allow(self, n: int = 1) -> None:
        """Let the engine take ``n`` more steps, and wait until it has."""
        target = self.engine.steps + n
        with self._cond:
            self._allowed += n
            self._cond.notify_all()
        await _until_step(self.engine, target)

    async def pause(self, mode: Literal["abort", "retract", "in_place"]) -> None:
        """:meth:`Engine.pause`, which waits for the step in progress: a step held here is
        let through (whether the engine was held in one or between two)."""
        self._let_through(True)
        try:
            await self.engine.pause(mode)
        finally:
            self._let_through(False)

    def _let_through(self, through: bool) -> None:
        with self._cond:
            self._through = through
            self._cond.notify_all()

    def open(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return resolve_model("smollm2-135m")


@pytest.fixture
async def engine(model_dir: Path) -> AsyncIterator[Engine]:
    async with Engine(model_dir, context_length=256) as e:
        yield e


async def test_logprobs_match_a_plain_forward_and_greedy_matches_hf(
    engine: Engine, model_dir: Path
) -> None:
    from transformers import AutoModelForCausalLM

    c = await engine.generate(PROMPT, SamplingParams(max_new_tokens=24, temperature=0))
    assert c.logprobs is not None and len(c.output_ids) == 24
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT + c.output_ids])).logits[0].float()
        greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=24, do_sample=False)
    lp = torch.log_softmax(logits[len(PROMPT) - 1 : -1], dim=-1)
    ref = lp.gather(1, torch.tensor(c.output_ids).unsqueeze(1)).squeeze(1)
    diff = (ref - torch.tensor(c.logprobs)).abs().max().item()
    print(f"max |logprob - HF forward| = {diff:.2e}")
    assert diff <= 1e-4
    assert greedy[0, len(PROMPT) :].tolist() == c.output_ids


@pytest.fixture(scope="module")
def random_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama of 512 ids, every weight random: batching, not the model, is tested."""
    from benchmarks.cuda_check import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("random") / "model", 0, hidden=64, layers=2)


async def test_concurrent_requests_batch_and_equal_their_solo_runs(random_llama: Path) -> None:
    from benchmarks.cuda_check import NumberTokenizer

    async with Engine(random_llama, tokenizer=NumberTokenizer(), context_length=256) as engine:
        await _batched_equals_solo(engine)


async def _batched_equals_solo(engine: Engine) -> None:
    params = [
        SamplingParams(max_new_tokens=6 + 3 * i, temperature=0.8, seed=100 + i) for i in range(6)
    ]
    prompts = [[7 * j % 500 + 1 for j in range(4 + i)] for i in range(6)]
    solo = [await engine.generate(p, sp) for p, sp in zip(prompts, params, strict=True)]
    steps = engine.steps
    together: list[Any] = [None] * 6

    async def one(i: int) -> None:
        together[i] = await engine.generate(prompts[i], params[i])

    with Gate(engine) as gate:
        async with anyio.create_task_group() as tg:
            for i in range(6):  # staggered: each joins the batch a step after the one before
                tg.start_soon(one, i)
                await gate.allow(1)
            gate.open()
    assert engine.steps - steps < sum(len(c.output_ids) for c in solo)  # shared steps
    for a, b in zip(solo, together, strict=True):
        assert a.output_ids == b.output_ids  # seeded: the batch does not change results
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert a.finish_reason == b.finish_reason
    assert any(len(set(c.output_ids)) > 2 for c in solo)  # sampled, not one token over again


async def test_a_group_sharing_a_prompt_prefills_it_once(engine: Engine) -> None:
    # A GRPO group: the same prompt n times, at once. One prefill; the copies report the
    # prompt as cached, and every sample equals its solo run.
    params = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=7 + i) for i in range(4)]
    solo = [await engine.generate(PROMPT, p) for p in params]
    # One after the other, the prefix cache serves all but the prompt's last token.
    assert [c.cached_tokens for c in solo] == [0] + [len(PROMPT) - 1] * 3
    assert await engine.flush_cache()
    group: list[Any] = [None] * 4

    async def one(i: int) -> None:
        group[i] = await engine.generate(PROMPT, params[i])

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(one, i)
    assert sorted(c.cached_tokens for c in group) == [0, len(PROMPT), len(PROMPT), len(PROMPT)]
    for a, b in zip(solo, group, strict=True):
        assert a.output_ids == b.output_ids
        assert a.logprobs == pytest.approx(b.logprobs, abs=1e-4)
    assert len({tuple(c.output_ids) for c in group}) > 1  # own seeds, own samples


async def test_stops_lengths_and_min_new_tokens(engine: Engine) -> None:
    greedy = SamplingParams(max_new_tokens=20, temperature=0)
    ref = await engine.generate(PROMPT, greedy)
    target = ref.output_ids[4]
    by_id = await engine.generate(PROMPT, greedy.replace(stop_token_ids=(target,)))
    assert by_id.output_ids == ref.output_ids[:5]
    assert by_id.finish_reason.type == "stop" and by_id.finish_reason.matched == target
    text = engine.tokenizer.decode(ref.output_ids[:6], skip_special_tokens=False)
    stop = text[-3:]
    by_text = await engine.generate(PROMPT, greedy.replace(stop=(stop,)))
    assert by_text.finish_reason.matched == stop
    assert stop in engine.tokenizer.decode(by_text.output_ids, skip_special_tokens=False)
    early = await engine.generate(PROMPT, greedy.replace(stop_token_ids=(ref.output_ids[0],)))
    assert len(early.output_ids) == 1
    held = await engine.generate(
        PROMPT, greedy.replace(stop_token_ids=(ref.output_ids[0],), min_new_tokens=3)
    )
    assert len(held.output_ids) >= 3 and ref.output_ids[0] not in held.output_ids[:3]
    none = await engine.generate(PROMPT, greedy.replace(max_new_tokens=0))
    assert none.output_ids == [] and none.finish_reason.type == "length"


async def test_top_k_one_is_greedy_and_seeds_repeat(engine: Engine) -> None:
    ref = await engine.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=0))
    k1 = await engine.generate(PROMPT, SamplingParams(max_new_tokens=8, top_k=1))
    assert k1.output_ids == ref.output_ids
    p = SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.9, min_p=0.05, seed=7)
    a, b = await engine.generate(PROMPT, p), await engine.generate(PROMPT, p)
    assert a.output_ids == b.output_ids


async def test_bad_input(engine: Engine) -> None:
    with pytest.raises(ConfigError, match="input_ids cannot be empty"):
        await engine.generate([], SamplingParams())
    with pytest.raises(ConfigError, match="token ids in"):
        await engine.generate([10**9], SamplingParams())
    with pytest.raises(ContextLengthError, match="longer than the model's context length"):
        await engine.generate([1] * 300, SamplingParams())
    with pytest.raises(ContextLengthError, match="exceeds the model's maximum context length"):
        await engine.generate([1] * 200, SamplingParams(max_new_tokens=100))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer: scheduling, not the model, is tested."""
    from tests.trainer.test_loop import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


async def test_abort_pause_and_weight_updates(tiny_dir: Path) -> None:
    long = SamplingParams(max_new_tokens=200, temperature=0, ignore_eos=True)
    result: dict[str, Any] = {}
    model_dir = tiny_dir
    async with Engine(model_dir, context_length=256) as engine:

        async def run() -> None:
            result["c"] = await engine.generate(PROMPT, long, rid="ep/1")

        with Gate(engine) as gate:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await gate.allow(3)  # three tokens, and the fourth step is held
                engine.abort("nobody")  # unknown: a no-op
                engine.abort("ep/1")
                gate.open()
        c = result["c"]
        assert c.finish_reason.type == "abort" and 0 < len(c.output_ids) < 200

        # In-place pause, new weights and version, resume: the spans say which made what.
        with Gate(engine) as gate:
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                await gate.allow(8)
                await gate.pause("in_place")  # after eight or nine tokens: either will do
                await engine.update_weights_from_disk(model_dir, weight_version="v2")
                gate.open()
                await engine.resume()
        c = result["c"]
        assert c.finish_reason.type == "length" and len(c.output_ids) == 200
        assert [v for v, _ in c.version_spans] == ["default", "v2"]
        assert c.versions == ["default", "v2"] and c.weight_version == "v2"
        with pytest.raises(ConfigError, match="not a directory"):
            await engine.update_weights_from_disk(model_dir / "nope")
        # A refused update (wrong shape) leaves every weight as it was.
        before = engine.model.embed.clone()
        bad = {"model.embed_tokens.weight": torch.zeros(3, 3)}
        with pytest.raises(ConfigError, match="have no tensor"):
            await engine.update_weights(bad)
        from safetensors.torch import load_file

        weights = load_file(str(model_dir / "model.safetensors"))
        weights["model.norm.weight"] = torch.zeros(7)
        embed = weights["model.embed_tokens.weight"]
        weights["model.embed_tokens.weight"] = torch.zeros_like(embed)
        with pytest.raises(ConfigError, match="keep the architecture"):
            await engine.update_weights(weights)
        assert torch.equal(engine.model.embed, before)


async def test_calls_after_close_raise_instead_of_hanging(model_dir: Path) -> None:
    engine = Engine(model_dir, context_length=256)
    async with engine:
        pass
    with anyio.fail_after(60):  # (a bound against a hang, not a timing)
        with pytest.raises(ClosedResourceError):
            await engine.update_weights_from_disk(model_dir)
        with pytest.raises(ClosedResourceError):
            await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))


@pytest.fixture
async def served(model_dir: Path) -> AsyncIterator[tuple[Engine, SGLangClient]]:
    async with (
        Engine(model_dir, context_length=256) as engine,
        EngineServer(engine) as server,
        SGLangClient(server.url, retries=0) as client,
    ):
        yield engine, client


async def test_client_against_agentenv_serve(served: tuple[Engine, SGLangClient]) -> None:
    engine, client = served
    await client.wait_healthy(timeout=10)
    params = SamplingParams(max_new_tokens=10, temperature=0)
    local = await engine.generate(PROMPT, params)
    remote = await client.generate(PROMPT, params, rid="e/0/agent/0")
    assert remote.output_ids == local.output_ids
    assert remote.logprobs == pytest.approx(local.logprobs, abs=1e-6)
    assert remote.finish_reason == local.finish_reason and remote.weight_version == "default"
    batch = await client.generate_batch([PROMPT, PROMPT[:5]], params, rid="b")
    assert batch[0].output_ids == local.output_ids and len(batch) == 2
    streamed = await client.generate_streamed(PROMPT, params)
    assert streamed.output_ids == local.output_ids

    with pytest.raises(SGLangError, match=r"400: top_p must be in \(0, 1\], got 1.5") as info:
        # Past the client's own check: what the server answers a raw request.
        await client._request(
            "POST", "/generate", body={"input_ids": PROMPT, "sampling_params": {"top_p": 1.5}}
        )
    assert info.value.status == 400
    with pytest.raises(SGLangError, match="400: The input"):
        await client.generate([1] * 300, params)
    with pytest.raises(SGLangError, match="400: input_ids cannot be empty"):
        await client._request("POST", "/generate", body={"input_ids": []})

    info_ = await client.model_info()
    assert info_["is_generation"] is True and info_["weight_version"] == "default"
    assert (await client.server_info())["context_length"] == 256
    await client.update_weights_from_disk(info_["model_path"], weight_version="3")
    assert await client.weight_version() == "3"
    await client.update_weight_version("4")
    assert (await client.generate(PROMPT, params)).weight_version == "4"
    with pytest.raises(SGLangError, match="Failed to update weights"):
        await client.update_weights_from_disk("/no/such/dir")
    await client.abort("unknown-rid")
    await client.pause("in_place")
    await client.resume()
    await client.flush_cache()


async def test_abort_over_http_returns_the_partial_output(
    served: tuple[Engine, SGLangClient],
) -> None:
    engine, client = served
    result: dict[str, Any] = {}

    async def run() -> None:
        result["c"] = await client.generate(
            PROMPT, SamplingParams(max_new_tokens=200, ignore_eos=True), rid="slow"
        )

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await _until_step(engine, 3)
        with pytest.raises(SGLangError, match="400: Cache not flushed"):
            await client.flush_cache()
        await client.abort("slow")
    c = result["c"]
    assert c.finish_reason.type == "abort" and c.finish_reason.message == "Aborted"
    assert 0 < len(c.output_ids) < 200 and c.logprobs is not None


async def test_released_memory_is_freed_and_comes_back_with_the_weights(
    engine: Engine, model_dir: Path
) -> None:
    """On CPU a release frees the key/value pool (the prefix cache with it) and the weights:
    generation is refused until the memory is resumed and the weights are loaded again (a
    partial update cannot load them), then the engine gives the tokens and log-probs it gave
    before. The weights it loads are its own copy, not the caller's tensors."""
    from safetensors.torch import load_file

    from agentenv import GenerationError

    params = SamplingParams(max_new_tokens=5, temperature=0.0, ignore_eos=True)
    before = await engine.generate([1, 2, 3], params)
    assert engine.cached_tokens > 0
    await engine.release_memory()
    assert engine.released == {"weights", "kv_cache", "cuda_graph"}
    assert engine.pool.kv.numel() == 0 and engine.cached_tokens == 0
    assert not engine.model.has_weights
    with pytest.raises(GenerationError, match=r"memory is released .*resume it"):
        await engine.generate([1, 2, 3], params)
    await engine.resume_memory(["kv_cache"])
    assert engine.released == {"weights", "cuda_graph"}
    assert engine.pool.size == engine.max_total_tokens and engine.pool.available == engine.pool.size
    await engine.resume_memory()
    assert engine.released == frozenset()
    with pytest.raises(GenerationError, match="weights were released and not loaded again"):
        await engine.generate([1, 2, 3], params)
    weights = load_file(str(model_dir / "model.safetensors"))
    embed = weights["model.embed_tokens.weight"]
    with pytest.raises(ConfigError, match="a partial update needs them in place"):
        await engine.update_weights({"model.embed_tokens.weight": embed}, partial=True)
    await engine.update_weights(weights, weight_version="2")
    assert engine.model.embed.data_ptr() != embed.data_ptr()  # a copy of its own
    after = await engine.generate([1, 2, 3], params)
    assert after.output_ids == before.output_ids and after.logprobs == before.logprobs
    assert after.weight_version == "2"
    await engine.resume_memory()  # resuming what is not released: a no-op
