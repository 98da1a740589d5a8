"""The torch backend's precisions on a tiny model on CPU (CPU autocast runs bf16 too):
with ``bf16-autocast`` the engine samples from the trainer's numerics (its log-probs agree
with the trainer's to bf16 noise, the first ratio is 1) and gets fp32 weights; at an RL
learning rate fp32 weights under autocast move where bf16 weights do not."""

from __future__ import annotations

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import torch

from agentenv import ConfigError, Sample, SamplingParams
from agentenv.engine import Engine
from tests._gpu import gpu_test
from tests.agentenv.engine.plain_forward import plain_logprobs
from tests.trainer.test_loop import tiny_llama
from trainer import (
    PRECISIONS,
    InProcessSync,
    LossConfig,
    OptimConfig,
    TorchBackend,
    TrainConfig,
    compute_advantages,
)
from trainer.backends._precision import resolve_precision
from trainer.run._config import ParallelismConfig

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

PROMPTS = [[1, 5, 6, 7], [1, 9, 8, 7, 6, 5]]


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("precision") / "m", hidden=64)


def _backend(
    root: Path, precision: str | None, device: str = "cpu", **kwargs: object
) -> TorchBackend:
    torch.manual_seed(0)
    return TorchBackend(
        root, device=device, precision=precision, optim=OptimConfig(lr=5e-6, grad_clip=0.0),
        loss=LossConfig(eps_clip=0.2), max_tokens_per_micro_batch=40, logit_chunk=7,
        **kwargs,  # type: ignore[arg-type]
    )  # fmt: skip


def test_defaults_and_bad_settings() -> None:
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = resolve_precision(None, cuda)
    assert auto.name == "bf16-autocast" and auto.weights == torch.float32
    assert auto.compute == torch.bfloat16 and auto.autocast and not auto.master
    assert auto.engine_dtypes() == (torch.bfloat16, torch.float32)
    assert resolve_precision(None, cpu).name == "fp32"
    assert resolve_precision("bf16", cpu).engine_dtypes() == (torch.bfloat16, torch.bfloat16)
    assert resolve_precision("bf16", cpu).master
    with pytest.raises(ConfigError, match="precision must be one of fp32, bf16-autocast, bf16"):
        resolve_precision("fp16", cpu)
    field = ParallelismConfig.model_fields["precision"].annotation
    assert typing.get_args(typing.get_args(field)[0]) == PRECISIONS  # the flag's choices
    base = {"env": "arithmetic"}
    assert TrainConfig(**base).parallel.precision is None
    assert TrainConfig(**base, precision="bf16").parallel.precision == "bf16"
    with pytest.raises(ValueError, match="--backend megatron trains bf16 weights"):
        TrainConfig(**base, backend="megatron", precision="bf16-autocast")


def test_master_weights_are_for_bf16_weights(root: Path) -> None:
    with pytest.raises(ConfigError, match="master_weights is for bf16 weights"):
        _backend(root, "bf16-autocast", master_weights=True)


async def _rollouts(engine: Engine) -> list[Sample]:
    samples = []
    for i, prompt in enumerate(PROMPTS):
        for j in range(3):
            params = SamplingParams(max_new_tokens=12, temperature=1.0, seed=10 * i + j)
            c = await engine.generate(prompt, params)
            samples.append(
                Sample(prompt_ids=prompt, completion_ids=c.output_ids,
                       rollout_logprobs=c.logprobs, reward=float(j % 2), group_id=f"g{i}")
            )  # fmt: skip
    return samples


def _gaps(backend: TorchBackend, samples: list[Sample]) -> torch.Tensor:
    out = []
    for s, lp in zip(samples, backend.logprobs(samples), strict=True):
        out.append((lp.double() - torch.tensor(list(s.rollout_logprobs or ()))).abs())
    return torch.cat(out)


CUDA = pytest.param("cuda", marks=gpu_test())


@pytest.mark.anyio
@pytest.mark.parametrize("device", ["cpu", CUDA])
async def test_the_engine_samples_from_the_trainers_autocast_numerics(
    root: Path, device: str
) -> None:
    # bf16-autocast: the CUDA default (asked for on CPU).
    backend = _backend(root, None if device == "cuda" else "bf16-autocast", device)
    assert backend.precision.name == "bf16-autocast"
    assert backend.compute_dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in backend.model.parameters())
    assert backend.master is None  # fp32 weights: no master copies
    dtype, residual = backend.precision.engine_dtypes()
    async with Engine(root, device=device, dtype=dtype, residual_dtype=residual) as engine:
        sync = InProcessSync(engine)
        await sync(backend, 0)
        norm = backend.state_dict()["model.norm.weight"].clone()
        assert norm.dtype == torch.float32 and torch.equal(engine.model.norm, norm)
        assert engine.model.layers[0].qkv.dtype == torch.bfloat16
        samples = await _rollouts(engine)
        # The engine's plain forward (prefill) is the trainer's autocast forward.
        for s, lp in zip(samples, backend.logprobs(samples), strict=True):
            plain = plain_logprobs(engine.model, s.prompt_ids + s.completion_ids)
            want = torch.tensor(plain[len(s.prompt_ids) - 1 :], dtype=torch.float64)
            assert torch.allclose(lp.double(), want, atol=1e-3 if device == "cpu" else 5e-2), (
                lp,
                want,
            )
        # Decoded tokens: the decode attention rounds its scores to bf16, a little noise.
        gaps = _gaps(backend, samples)
        assert float(gaps.mean()) < 0.02 and float(gaps.max()) < 0.5, gaps
        adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples])
        metrics = backend.train_step(samples, adv)
        assert metrics["ratio_max"] == 1.0 and metrics["ratio_min"] == 1.0
        assert metrics["train/rollout_train_logprob_abs_diff"] < 0.02
        # An update of 5e-6 reaches the engine's fp32 norms (bf16 ones would not move).
        await sync(backend, 1)
        moved = backend.state_dict()["model.norm.weight"]
        assert not torch.equal(moved, norm) and torch.equal(engine.model.norm, moved)
        assert engine.weight_version == "1"


def _moved_share(backend: TorchBackend, weights: list[torch.Tensor]) -> float:
    """One step at lr 5e-6: the share of the entries with a gradient (> 1e-7) that changed
    in ``weights`` (the model's, or its master copies)."""
    samples = [
        Sample(prompt_ids=[1, 5, 6], completion_ids=[1000 + i, 1001 + i, 2], reward=float(i % 2),
               group_id="g")
        for i in range(4)
    ]  # fmt: skip
    adv = compute_advantages([s.reward for s in samples], [s.group_id for s in samples])
    params = [p for p in backend.model.parameters() if p.requires_grad]
    got: dict[int, torch.Tensor] = {}
    hooks = [
        p.register_post_accumulate_grad_hook(
            lambda p, i=i: got.__setitem__(i, got.get(i, 0) + p.grad.abs().float())  # type: ignore[union-attr]
        )
        for i, p in enumerate(params)
    ]
    before = [w.detach().clone() for w in weights]
    backend.train_step(samples, adv)
    for h in hooks:
        h.remove()
    moved = total = 0
    for i, (b, w) in enumerate(zip(before, weights, strict=True)):
        mask = got[i] > 1e-7 if i in got else torch.zeros_like(b, dtype=torch.bool)
        moved += int((w.detach() != b)[mask].sum())
        total += int(mask.sum())
    assert total > 10_000
    return moved / total


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_at_an_rl_learning_rate_fp32_weights_move_and_bf16_weights_do_not(
    root: Path, device: str
) -> None:
    autocast = _backend(root, "bf16-autocast", device)
    assert _moved_share(autocast, list(autocast.model.parameters())) > 0.99
    # bf16 weights without master copies: an update of 5e-6 is below half the spacing of
    # almost every weight (~1e-4 at |w| = 0.02; 2**-8 at the norms' 1.0) and is lost.
    plain = _backend(root, "bf16", device, master_weights=False)
    assert _moved_share(plain, list(plain.model.parameters())) < 0.2
    # With master copies the updates accumulate in fp32, but the bf16 weights that the
    # forward and the engine use still mostly stay where they were.
    kept = _backend(root, "bf16", device)
    assert kept.master is not None
    assert _moved_share(kept, list(kept.model.parameters())) < 0.2
    again = _backend(root, "bf16", device)
    assert again.master is not None
    assert _moved_share(again, again.master) > 0.99


def test_agentenv_train_runs_with_each_precision(root: Path, tmp_path: Path) -> None:
    for precision in ("bf16-autocast", "bf16"):
        out = subprocess.run(
            [sys.executable, "-m", "agentenv", "train",
             "--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint", str(root),
             "--num-rollout", "2", "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
             "--rollout-max-response-len", "6", "--n-eval", "0", "--lr", "5e-6",
             "--precision", precision, "--save", str(tmp_path / precision), "--json"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr[-2000:]
        assert json.loads(out.stdout.splitlines()[-1])["precision"] == precision
        lines = (tmp_path / precision / "metrics.jsonl").read_text().splitlines()
        assert len(lines) == 2
