"""The torch backend (fp32, CPU): its log-probs reproduce the embedded engine's rollout
log-probs (at T = 1 and at the rollout's temperature), the first step on fresh data has
ratio exactly 1, and a step moves the policy the way the advantages say -- on a tiny random
Llama, and the log-probs once on SmolLM2-135M itself."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from agentenv import ChatTokenizer, ConfigError, Sample
from agentenv._generator import SamplingParams
from agentenv.engine import Engine
from trainer import LossConfig, OptimConfig, TorchBackend, compute_advantages

pytestmark = [pytest.mark.timeout(600)]


def _sample(
    model: str | Path, tokenizer: ChatTokenizer, temperatures: tuple[float, ...]
) -> dict[float, list[Sample]]:
    """At each temperature: four completions of two prompts, with the engine's log-probs."""
    import anyio

    async def go() -> dict[float, list[Sample]]:
        out: dict[float, list[Sample]] = {t: [] for t in temperatures}
        async with Engine(model, device="cpu", dtype=torch.float32) as engine:
            for (k, question), t in itertools.product(
                enumerate(["What is 2 + 2?", "Name a colour."]), out
            ):
                text = tokenizer.render(
                    [{"role": "user", "content": question}], add_generation_prompt=True
                )
                prompt = tokenizer.encode(text)
                for j in range(2):
                    params = SamplingParams(max_new_tokens=12, temperature=t, seed=10 * k + j)
                    c = await engine.generate(prompt, params)
                    out[t].append(
                        Sample(
                            prompt_ids=prompt,
                            completion_ids=c.output_ids,
                            rollout_logprobs=c.logprobs,
                            reward=float(j),
                            group_id=f"g{k}",
                        )
                    )
        return out

    return anyio.run(go)


def make_backend(model: str | Path, **optim: Any) -> TorchBackend:
    torch.manual_seed(0)
    return TorchBackend(
        model,
        optim=OptimConfig(**{"lr": 1e-5, "grad_clip": 1.0, **optim}),
        loss=LossConfig(eps_clip=0.2, eps_clip_high=0.28),
        max_tokens_per_micro_batch=64,  # several micro-batches
        logit_chunk=7,  # several chunks per micro-batch
    )


def max_logprob_gap(
    backend: TorchBackend, samples: list[Sample], temperature: float = 1.0
) -> float:
    """The largest trainer-vs-rollout log-prob difference of any token."""
    gaps = []
    for s, lp in zip(samples, backend.logprobs(samples, temperature=temperature), strict=True):
        assert s.rollout_logprobs is not None
        gaps.append(float((lp.double() - torch.tensor(list(s.rollout_logprobs))).abs().max()))
    return max(gaps)


@pytest.mark.slow
def test_trainer_logprobs_reproduce_the_engines_on_smollm2(smollm2: ChatTokenizer) -> None:
    """On the real model (its 30 layers, tied embeddings and chat template): what the
    other tests show on a tiny random Llama holds where the numbers are a real policy's."""
    rollouts = _sample("smollm2-135m", smollm2, (1.0,))[1.0]
    assert max_logprob_gap(make_backend("smollm2-135m"), rollouts) <= 1e-4


# -- the same properties on a tiny random Llama (SmolLM2's tokenizer) ---------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.trainer.test_loop import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def sampled(tiny: Path, smollm2: ChatTokenizer) -> dict[float, list[Sample]]:
    """At temperatures 1 and 0.7: four completions of two prompts, with the engine's
    log-probs."""
    return _sample(tiny, smollm2, (1.0, 0.7))


@pytest.fixture(scope="module")
def rollouts(sampled: dict[float, list[Sample]]) -> list[Sample]:
    return sampled[1.0]


def test_trainer_logprobs_reproduce_the_engines(tiny: Path, rollouts: list[Sample]) -> None:
    assert max_logprob_gap(make_backend(tiny), rollouts) <= 1e-4


def test_at_temperature_0_7_the_logprobs_still_match_and_the_first_ratio_is_one(
    tiny: Path, sampled: dict[float, list[Sample]]
) -> None:
    """Rollouts sampled at T = 0.7 report log-probs of softmax(logits / 0.7); a backend
    asked at that temperature reproduces them as closely as at T = 1, and the first
    step's ratio is exactly 1 with the same small trainer-vs-rollout difference."""
    hot = sampled[0.7]
    backend = make_backend(tiny)
    at_one = max_logprob_gap(backend, sampled[1.0])
    # At T = 1 the T = 0.7 tokens' log-probs are another distribution's, far off.
    assert max_logprob_gap(backend, hot) > 0.1
    gap = max_logprob_gap(backend, hot, temperature=0.7)
    assert gap <= max(2 * at_one, 1e-4), (gap, at_one)
    adv = compute_advantages([s.reward for s in hot], [s.group_id for s in hot])
    metrics = backend.train_step(hot, adv, temperature=0.7)
    assert metrics["ratio_max"] == 1.0 and metrics["ratio_min"] == 1.0
    assert metrics["train/rollout_train_logprob_abs_diff"] <= 1e-4


def test_first_step_ratio_is_one_and_the_update_follows_the_advantages(
    tiny: Path, smollm2: ChatTokenizer
) -> None:
    # Completions of disjoint tokens: the tiny model samples nearly the same ones for both
    # of a group, and pushing one down would push the other with it.
    backend = make_backend(tiny)
    rollouts = []
    for k, question in enumerate(["What is 2 + 2?", "Name a colour."]):
        text = smollm2.render([{"role": "user", "content": question}], add_generation_prompt=True)
        prompt = smollm2.encode(text)
        for j in range(2):
            first = 1000 + 8 * j + 2 * k  # among the tokens the tiny model speaks
            completion = [first, first + 1, first + 2, first + 3] * 3
            rollouts.append(
                Sample(prompt_ids=prompt, completion_ids=completion, reward=float(j),
                       group_id=f"g{k}")
            )  # fmt: skip
    before = backend.logprobs(rollouts)
    for sample, lp in zip(rollouts, before, strict=True):
        sample.rollout_logprobs = lp.tolist()
    adv = compute_advantages([s.reward for s in rollouts], [s.group_id for s in rollouts])
    metrics = backend.train_step(rollouts, adv)
    assert metrics["ratio_max"] == 1.0 and metrics["ratio_min"] == 1.0
    assert metrics["clipfrac"] == 0.0 and metrics["micro_batches"] > 1
    assert metrics["train/rollout_train_logprob_abs_diff"] <= 1e-4
    assert metrics["grad_norm"] > 0
    after = backend.logprobs(rollouts)
    # Positive-advantage completions became more likely, negative ones less.
    for a, b0, b1 in zip(adv.tolist(), before, after, strict=True):
        moved = float(b1.sum() - b0.sum())
        assert moved * a > 0, (a, moved)


def test_response_positions_padded_and_packed() -> None:
    from trainer.backends._backend import Item, response_positions

    def item(n: int, start: int) -> Item:
        return Item(torch.arange(100, 100 + n), start, torch.ones(n - start, dtype=torch.float64))

    batch = [item(5, 3), item(4, 1)]
    rows, cols, target, sizes = response_positions(batch)
    assert rows.tolist() == [0, 0, 1, 1, 1] and cols.tolist() == [2, 3, 0, 1, 2]
    assert target.tolist() == [103, 104, 101, 102, 103] and sizes == [2, 3]
    # Packed: one row, the second item starts after the first's 5 tokens.
    rows, cols, target, sizes = response_positions(batch, packed=True)
    assert rows.tolist() == [0] * 5 and cols.tolist() == [2, 3, 5, 6, 7]
    assert target.tolist() == [103, 104, 101, 102, 103] and sizes == [2, 3]


def test_bf16_weights_keep_small_updates_through_fp32_master_weights(tmp_path: Path) -> None:
    """At lr 1e-4 an Adam update (~1e-4) is below half the bf16 spacing of a weight of 1
    (2**-8): bf16 weights updated in place never move. The fp32 master copies accumulate
    the updates and the model gets them rounded; a checkpoint restores them exactly."""
    from tests.trainer.test_loop import tiny_llama

    root = tiny_llama(tmp_path / "m")
    samples = [
        Sample(prompt_ids=[1, 5, 6], completion_ids=[1000 + i, 1001, 2], reward=float(i % 2),
               group_id="g")
        for i in range(4)
    ]  # fmt: skip
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples])
    optim = OptimConfig(lr=1e-4, grad_clip=0.0)
    norm = "model.norm.weight"  # starts at exactly 1.0

    def run(master: bool, steps: int) -> TorchBackend:
        b = TorchBackend(root, precision="bf16", optim=optim, master_weights=master)
        for _ in range(steps):
            b.train_step(samples, adv)
        return b

    plain = run(False, 5)
    assert torch.equal(plain.state_dict()[norm], torch.ones_like(plain.state_dict()[norm]))
    kept = run(True, 5)
    assert kept.master is not None
    names = [n for n, _ in kept.model.named_parameters()]
    master_norm = dict(zip(names, kept.master, strict=True))[norm]
    moved = (master_norm - 1).abs()
    assert float(moved.max()) > 3e-4  # five updates of ~1e-4 accumulated in fp32
    assert torch.equal(kept.state_dict()[norm], master_norm.to(torch.bfloat16))
    kept.save_checkpoint(tmp_path / "ckpt", {})
    again = TorchBackend(root, precision="bf16", optim=optim)
    again.load_checkpoint(tmp_path / "ckpt")
    assert again.master is not None
    assert all(torch.equal(a, b) for a, b in zip(again.master, kept.master, strict=True))


def test_one_step_takes_the_old_logprobs_from_its_training_forward(tmp_path: Path) -> None:
    """Without old log-probs (one optimizer step per rollout) the step takes them from its
    own training forward, detached, instead of a separate no-grad pass: the same loss,
    gradient norm, metrics and updated weights as the step given that pass's log-probs,
    with one forward per micro-batch instead of two."""
    from tests.trainer.test_loop import tiny_llama

    model = tiny_llama(tmp_path / "tiny")
    gen = torch.Generator().manual_seed(1)
    samples = [
        Sample(
            prompt_ids=torch.randint(1000, 1016, (5 + i % 3,), generator=gen).tolist(),
            completion_ids=torch.randint(1000, 1016, (4 + i % 5,), generator=gen).tolist(),
            rollout_logprobs=(-torch.rand(4 + i % 5, generator=gen) * 3).tolist(),
            reward=float(i % 2),
            group_id=f"g{i // 4}",
        )
        for i in range(8)
    ]
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples])

    def make() -> TorchBackend:
        return TorchBackend(
            model,
            optim=OptimConfig(lr=1e-2),
            loss=LossConfig(use_tis=True),
            max_tokens_per_micro_batch=30,  # several micro-batches
            entropy_metric=True,
        )

    with_pass, without = make(), make()
    reference = with_pass.train_step(samples, adv, old_logprobs=with_pass.logprobs(samples))
    calls = 0
    forward = without._forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        nonlocal calls
        calls += 1
        return forward(*args, **kwargs)

    without._forward = counted  # type: ignore[method-assign]
    metrics = without.train_step(samples, adv)
    assert calls == metrics["micro_batches"] > 1  # no old-log-prob pass
    assert metrics["ratio_max"] == metrics["ratio_min"] == 1.0
    for name in ("loss", "pg_loss", "grad_norm", "tis_weight", "entropy", "clipfrac"):
        assert metrics[name] == pytest.approx(reference[name], rel=1e-6, abs=1e-7), name
    mismatch = "train/rollout_train_logprob_abs_diff"
    assert (
        metrics[mismatch] == pytest.approx(reference[mismatch], rel=1e-6)
        and metrics[mismatch] > 0.1
    )
    for (name, a), b in zip(
        with_pass.state_dict().items(), without.state_dict().values(), strict=True
    ):
        assert torch.allclose(a, b, rtol=0, atol=1e-6), name


def test_gradient_checkpointing_recomputes_the_layers_and_changes_no_number(
    tmp_path: Path,
) -> None:
    """With gradient checkpointing each decoder layer runs again in the backward, and the
    step's loss, gradient norm and updated weights are those of the step without it."""
    from tests.trainer.test_loop import tiny_llama

    model = tiny_llama(tmp_path / "tiny")
    gen = torch.Generator().manual_seed(2)
    samples = [
        Sample(
            prompt_ids=torch.randint(1000, 1016, (6,), generator=gen).tolist(),
            completion_ids=torch.randint(1000, 1016, (3 + i % 4,), generator=gen).tolist(),
            reward=float(i % 2),
            group_id=f"g{i // 4}",
        )
        for i in range(8)
    ]
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples])
    plain, checkpointed = (
        TorchBackend(model, optim=OptimConfig(lr=1e-2), gradient_checkpointing=on)
        for on in (False, True)
    )
    runs = {"plain": 0, "checkpointed": 0}
    saved = {"plain": 0, "checkpointed": 0}
    for name, backend in (("plain", plain), ("checkpointed", checkpointed)):
        mlp = backend.model.get_decoder().layers[0].mlp
        forward = mlp.forward

        def counted(*args: Any, name: str = name, forward: Any = forward) -> Any:
            runs[name] += 1
            return forward(*args)

        mlp.forward = counted

    def step(name: str, backend: TorchBackend) -> dict[str, float]:
        def pack(t: torch.Tensor) -> torch.Tensor:
            saved[name] += 1
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            return backend.train_step(samples, adv)

    a, b = step("plain", plain), step("checkpointed", checkpointed)
    assert runs["checkpointed"] == 2 * runs["plain"] == 2 * a["micro_batches"]
    assert saved["checkpointed"] < saved["plain"] / 2  # what the backward keeps
    for name in ("loss", "pg_loss", "grad_norm"):
        assert b[name] == pytest.approx(a[name], rel=1e-6, abs=1e-7), name
    for (name, x), y in zip(
        plain.state_dict().items(), checkpointed.state_dict().values(), strict=True
    ):
        assert torch.allclose(x, y, rtol=0, atol=1e-6), name


def test_gradient_checkpointing_is_the_torch_backends_flag() -> None:
    from trainer import TrainConfig

    assert TrainConfig(
        env="arithmetic", gradient_checkpointing=True
    ).parallel.gradient_checkpointing
    with pytest.raises(ValueError, match="--recompute-granularity"):
        TrainConfig(env="arithmetic", backend="megatron", gradient_checkpointing=True)


def test_the_cpu_defaults_keep_memory_low_and_compile_only_on_cuda(tmp_path: Path) -> None:
    """On CPU: gradient checkpointing on, 1,024-token micro-batches, 256-token logit
    chunks, no compiling (refused there with the reason); the config refuses ``--compile``
    off CUDA and with megatron before anything loads."""
    from tests.trainer.test_loop import tiny_llama
    from trainer import TrainConfig
    from trainer.config import default_micro_batch_tokens as micro_batch_tokens

    model = tiny_llama(tmp_path / "tiny")
    backend = TorchBackend(model)
    assert (backend.compile, backend.gradient_checkpointing) == (False, True)
    assert (backend.max_tokens, backend.logit_chunk) == (1024, 256)
    assert TorchBackend(model, max_tokens_per_micro_batch=64, logit_chunk=9).max_tokens == 64
    assert (micro_batch_tokens(None, "cuda:1"), micro_batch_tokens(7, "cpu")) == (4096, 7)
    with pytest.raises(ConfigError, match="compile needs a CUDA device, not 'cpu'"):
        TorchBackend(model, compile=True)
    with pytest.raises(ConfigError, match="--compile needs --device cuda"):
        TrainConfig(env="arithmetic", compile=True)
    with pytest.raises(ConfigError, match="--compile is the torch backend's"):
        TrainConfig(env="arithmetic", device="cuda", backend="megatron", compile=True)
    config = TrainConfig(env="arithmetic", device="cuda")
    assert (config.parallel.compile, config.parallel.gradient_checkpointing) == (None, None)
