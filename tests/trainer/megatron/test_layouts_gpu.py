"""The megatron backend's parallel layouts against one GPU: tensor parallel 2 (with and
without sequence parallelism), pipeline parallel 2, data parallel 2 with the distributed
optimizer. Each layout runs in its own processes (``layout_case.py``: megatron's parallel
state is per process); fp32, a small random Llama with tied embeddings.

Run on a machine with 2 GPUs and megatron-core (prints the differences):
    python -m pytest -s -q tests/trainer/megatron/test_layouts_gpu.py
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests._gpu import gpu_test

pytestmark = [
    gpu_test(2),
    pytest.mark.timeout(900),
]

LAYOUTS = {
    "tp2": ["--gpus", "2", "--tp", "2"],
    "tp2-sp": ["--gpus", "2", "--tp", "2", "--sequence-parallel"],
    "pp2": ["--gpus", "2", "--pp", "2"],
    "dp2-distopt": ["--gpus", "2", "--distributed-optimizer"],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("megatron.core", exc_type=ImportError)
    from transformers import LlamaConfig, LlamaForCausalLM

    root = tmp_path_factory.mktemp("layout_model")
    config = LlamaConfig(
        vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=512,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)
    return root


def _run(model_dir: Path, out: Path, args: list[str]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "tests.trainer.megatron.layout_case", str(model_dir), str(out)]
    subprocess.run([*cmd, *args], check=True, timeout=600)
    result: dict[str, Any] = torch.load(out, weights_only=False)
    return result


@pytest.fixture(scope="module")
def single(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _run(model_dir, tmp_path_factory.mktemp("single") / "r.pt", [])


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(float((x - y).abs().max()) for x, y in zip(a, b, strict=True))


def test_single_gpu_resume_is_exact(single: dict[str, Any]) -> None:
    assert _max_diff(single["after2"], single["after2_resumed"]) == 0.0
    assert single["step2"]["loss"] == single["step2_resumed"]["loss"]
    assert _max_diff(single["before"], single["after"]) > 1e-3  # the step changed the model


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_layout_matches_one_gpu(
    layout: str, model_dir: Path, single: dict[str, Any], tmp_path: Path
) -> None:
    mine = _run(model_dir, tmp_path / "r.pt", LAYOUTS[layout])
    diffs = {
        "logprobs before": _max_diff(single["before"], mine["before"]),
        "logprobs after step": _max_diff(single["after"], mine["after"]),
        "logprobs after 2 steps": _max_diff(single["after2"], mine["after2"]),
        "loss (ratio != 1)": abs(single["step2"]["loss"] - mine["step2"]["loss"]),
        "ratio mean": abs(single["step2"]["ratio_mean"] - mine["step2"]["ratio_mean"]),
        "entropy": abs(single["step1"]["entropy"] - mine["step1"]["entropy"]),
        "grad norm (relative)": abs(single["step1"]["grad_norm"] / mine["step1"]["grad_norm"] - 1),
        "one-sample step grad norm (relative)": abs(
            single["single"]["grad_norm"] / mine["single"]["grad_norm"] - 1
        ),
        "weights": max(
            float((single["weights"][k] - mine["weights"][k]).abs().max())
            for k in single["weights"]
        ),
        "resume": _max_diff(mine["after2"], mine["after2_resumed"]),
    }
    print(f"\n{layout}: " + ", ".join(f"{k} {v:.3g}" for k, v in diffs.items()))
    assert set(mine["weights"]) == set(single["weights"])
    assert diffs["logprobs before"] < 1e-4
    assert diffs["logprobs after step"] < 1e-4
    assert diffs["logprobs after 2 steps"] < 1e-4
    assert diffs["loss (ratio != 1)"] < 1e-6 and diffs["ratio mean"] < 1e-6
    assert diffs["entropy"] < 1e-4
    assert diffs["grad norm (relative)"] < 1e-4
    assert diffs["one-sample step grad norm (relative)"] < 1e-4
    assert diffs["weights"] < 1e-5
    assert diffs["resume"] < 1e-6
