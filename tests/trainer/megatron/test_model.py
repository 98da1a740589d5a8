"""Converted weights in megatron-core's own GPTModel: names and shapes match exactly.

GPTModel can be *built* on CPU (``use_cpu_initialization``; a one-process gloo group), so
this runs wherever megatron-core imports (Python >= 3.12, with triton). Its forward pass
needs CUDA (rotary embeddings): the logit parity with HF is a ``gpu`` test.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tests._gpu import gpu_test
from tests.trainer.megatron.tiny import tiny_model
from trainer.megatron import (
    MegatronModelConfig,
    WeightShapeError,
    hf_to_megatron,
    load_weights,
    megatron_to_hf,
    model_provider,
    vocab_parallel_logprobs,
)

with warnings.catch_warnings():  # megatron warns at import about optional packages
    warnings.simplefilter("ignore")
    core = pytest.importorskip("megatron.core", exc_type=ImportError)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def world_of_one() -> Iterator[None]:
    """torch.distributed and megatron's parallel state for one process, TP = PP = 1."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    core.parallel_state.initialize_model_parallel(1, 1)
    if torch.cuda.is_available():
        core.tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    core.parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _build(cfg: MegatronModelConfig, **overrides: Any) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model_provider(cfg, **overrides)()


def test_converted_weights_load_strictly_into_gpt_model(hf_model: Any, world_of_one: None) -> None:
    hf = {k: v.detach() for k, v in hf_model.state_dict().items()}
    cfg = MegatronModelConfig.from_hf(hf_model.config, make_vocab_size_divisible_by=8)
    model = _build(cfg, use_cpu_initialization=True)
    state = hf_to_megatron(hf, cfg)
    own = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    assert {k: tuple(v.shape) for k, v in own.items()} == {
        k: tuple(v.shape) for k, v in state.items()
    }
    load_weights(model, state)
    back = megatron_to_hf([[model.state_dict()]], cfg)
    for name, tensor in back.items():
        assert torch.equal(tensor, hf[name]), name


def test_a_mismatched_shape_is_named(world_of_one: None) -> None:
    small = tiny_model("llama", tied=False)
    cfg = MegatronModelConfig.from_hf(small.config, make_vocab_size_divisible_by=8)
    state = hf_to_megatron({k: v.detach() for k, v in small.state_dict().items()}, cfg)
    wide = tiny_model("llama", tied=False, intermediate_size=64)
    model = _build(
        MegatronModelConfig.from_hf(wide.config, make_vocab_size_divisible_by=8),
        use_cpu_initialization=True,
    )
    with pytest.raises(
        WeightShapeError, match=r"decoder.layers.0.mlp.linear_fc1.weight.*\(96, 32\)"
    ):
        load_weights(model, state)


@gpu_test()
# megatron's own RowParallelLinear calls a function without its process group (0.19.2).
@pytest.mark.filterwarnings("ignore:.*tp_group is None:DeprecationWarning")
def test_logits_and_logprobs_match_hf_on_cuda(hf_model: Any, world_of_one: None) -> None:
    """megatron's fp32 logits and log-probs are as close to an fp64 HF reference as HF's
    own fp32 forward is, within a few times (every weight is N(0, 1), so fp32 rounding
    shows at ~1e-4 and varies with the order of summation)."""
    hf_model = hf_model.cuda()
    hf = {k: v.detach() for k, v in hf_model.state_dict().items()}
    cfg = MegatronModelConfig.from_hf(hf_model.config, make_vocab_size_divisible_by=8)
    model = _build(cfg).cuda().eval()
    load_weights(model, hf_to_megatron(hf, cfg))
    ids = torch.randint(0, cfg.vocab_size, (2, 12), device="cuda")
    positions = torch.arange(12, device="cuda").expand(2, -1)

    def logprobs(logits: torch.Tensor) -> torch.Tensor:
        return torch.log_softmax(logits[:, :-1].double(), -1).gather(-1, ids[:, 1:, None])[..., 0]

    with torch.no_grad():
        logits = model(ids, positions, attention_mask=None)
        assert logits.shape == (2, 12, cfg.padded_vocab_size)
        logp = vocab_parallel_logprobs(logits[:, :-1], ids[:, 1:], vocab_size=cfg.vocab_size)
        hf32 = hf_model(ids).logits
        ref = copy.deepcopy(hf_model).double()(ids).logits
    hf_error = float((hf32.double() - ref).abs().max())
    error = float((logits[..., : cfg.vocab_size].double() - ref).abs().max())
    assert error <= 4 * hf_error + 1e-6, (error, hf_error)  # a mapping error is O(1)
    hf_lp_error = float((logprobs(hf32) - logprobs(ref)).abs().max())
    lp_error = float((logp.double() - logprobs(ref)).abs().max())
    assert lp_error <= 4 * hf_lp_error + 1e-6, (lp_error, hf_lp_error)
    assert logp.dtype == torch.float32 and float(logp.max()) <= 0


@gpu_test(2)
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("tied", ["tied", "untied"])
def test_tensor_parallel_shards_match_hf_on_two_gpus(arch: str, tied: str) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "-m", "tests.trainer.megatron.tp_parity", arch, tied],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.count("ok=True") == 2, out.stdout
