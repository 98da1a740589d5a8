"""The megatron backend against the torch backend on one GPU, with SmolLM2-135M's
architecture (random weights): the same log-probs, loss, gradient norm and update.

Run on a GPU machine with megatron-core installed (prints the numbers):
    python -m pytest -s -q tests/trainer/megatron/test_backend_gpu.py
    AGENTENV_GPU_TEST_MODEL=DIR python -m pytest ...   # another model, e.g. real weights
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest
import torch

from agentenv import Sample
from tests._gpu import gpu_test
from trainer import OptimConfig, TorchBackend, compute_advantages

pytestmark = [
    gpu_test(),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
    pytest.mark.timeout(600),
]


@pytest.fixture(scope="module")
def smollm2_shape(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A random model with SmolLM2-135M's configuration (30 layers, hidden 576, 9 heads,
    3 KV heads, FFN 1536, vocabulary 49,152, tied embeddings) -- or, with
    ``AGENTENV_GPU_TEST_MODEL=DIR``, that HF directory (e.g. the real SmolLM2-135M)."""
    pytest.importorskip("megatron.core", exc_type=ImportError)
    if os.environ.get("AGENTENV_GPU_TEST_MODEL"):
        yield Path(os.environ["AGENTENV_GPU_TEST_MODEL"])
        return
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("smollm2_shape")
    config = LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
        num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)
    yield root
    shutil.rmtree(root, ignore_errors=True)


def _samples(n: int = 8, seed: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = torch.randint(
            3, 49152, (int(torch.randint(20, 60, (1,), generator=g)),), generator=g
        )
        completion = torch.randint(
            3, 49152, (int(torch.randint(10, 40, (1,), generator=g)),), generator=g
        )
        out.append(
            Sample(
                prompt_ids=prompt.tolist(),
                completion_ids=completion.tolist(),
                reward=float(i % 3),
                group_id=f"g{i // 4}",
            )
        )
    return out


@pytest.mark.parametrize("attention", ["sdpa", "local"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_logprobs_match_the_torch_backend(
    smollm2_shape: Path, dtype: torch.dtype, attention: str
) -> None:
    """fp32: megatron equals the torch backend. bf16: both are compared with the fp32
    torch backend, and megatron's rounding error must be of the size of the torch
    backend's own (bf16 differences depend on the weights: on trained weights and random
    tokens they reach tenths of a nat for either backend)."""
    from trainer.megatron import MegatronBackend

    def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([(x - y).abs() for x, y in zip(a, b, strict=True)])

    samples = _samples()
    exact = TorchBackend(smollm2_shape, device="cuda", precision="fp32").logprobs(samples)
    # Closed: the process group it set up goes with it (test_model.py sets up its own).
    with closing(MegatronBackend(smollm2_shape, dtype=dtype, attention=attention)) as mega:
        mine = mega.logprobs(samples)
    diff = gap(mine, exact)
    if dtype == torch.float32:
        print(f"\nlogprob parity fp32 {attention}: max {diff.max():.3g} mean {diff.mean():.3g}")
        assert float(diff.max()) < 1e-3 and float(diff.mean()) < 1e-4
        return
    theirs = gap(
        TorchBackend(smollm2_shape, device="cuda", precision="bf16").logprobs(samples), exact
    )
    print(
        f"\nbf16 {attention} against fp32: megatron max {diff.max():.3g} mean {diff.mean():.3g}; "
        f"torch backend max {theirs.max():.3g} mean {theirs.mean():.3g}"
    )
    assert float(diff.mean()) < 1.5 * float(theirs.mean()) + 1e-3
    assert float(diff.max()) < 2.5 * float(theirs.max()) + 1e-2


def test_loss_gradient_and_update_match_the_torch_backend(smollm2_shape: Path) -> None:
    from trainer.megatron import MegatronBackend

    samples = _samples(seed=1)
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples])
    optim = OptimConfig(optimizer="sgd", lr=1.0, grad_clip=0.0)
    torch_side = TorchBackend(smollm2_shape, device="cuda", precision="fp32", optim=optim)
    old = torch_side.logprobs(samples)
    before = {k: v.detach().clone() for k, v in torch_side.state_dict().items()}
    theirs = torch_side.train_step(samples, adv, old_logprobs=old)
    torch_delta = {k: torch_side.state_dict()[k] - v for k, v in before.items()}
    del torch_side
    with closing(MegatronBackend(smollm2_shape, dtype=torch.float32, optim=optim)) as mega:
        mine = mega.train_step(samples, adv, old_logprobs=old)
        after = mega.state_dict()
    errors = {
        k: float(
            (after[k] - before[k] - torch_delta[k]).norm() / torch_delta[k].norm().clamp_min(1e-12)
        )
        for k in after
        if float(torch_delta[k].norm()) > 0
    }
    worst = max(errors, key=errors.__getitem__)
    print(
        f"\nloss {mine['loss']:.6g} vs {theirs['loss']:.6g}; grad norm {mine['grad_norm']:.6g} "
        f"vs {theirs['grad_norm']:.6g}; worst relative update error {errors[worst]:.3g} ({worst})"
    )
    assert mine["loss"] == pytest.approx(theirs["loss"], rel=1e-4, abs=1e-6)
    assert mine["grad_norm"] == pytest.approx(theirs["grad_norm"], rel=1e-3)
    assert errors[worst] < 1e-2


def test_packed_sequences_match_padded_rows(smollm2_shape: Path) -> None:
    """``thd`` (samples packed into one row, variable-length flash attention) against
    ``bshd`` (padded rows), bf16: the same log-probs and the same step."""
    from trainer.megatron import MegatronBackend

    samples = _samples(n=12, seed=2)
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples])
    results = {}
    for fmt in ("bshd", "thd"):
        backend = MegatronBackend(smollm2_shape, qkv_format=fmt, max_tokens_per_micro_batch=400)
        with closing(backend):
            before = backend.logprobs(samples)
            step = backend.train_step(samples, adv)
            results[fmt] = (before, step, backend.logprobs(samples))
    (b0, s0, a0), (b1, s1, a1) = results["bshd"], results["thd"]
    diff = max(float((x - y).abs().max()) for x, y in zip(b0, b1, strict=True))
    after = max(float((x - y).abs().max()) for x, y in zip(a0, a1, strict=True))
    print(
        f"\npacked vs padded, bf16: log-probs max diff {diff:.3g}, after a step {after:.3g}; "
        f"grad norm {s1['grad_norm']:.6g} vs {s0['grad_norm']:.6g}"
    )
    assert diff < 0.05 and after < 0.05
    assert s1["grad_norm"] == pytest.approx(s0["grad_norm"], rel=2e-2)
