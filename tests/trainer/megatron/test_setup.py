"""The megatron backend's options (trainer.megatron._setup.resolve_options), checked
without megatron or a GPU: the default micro-batch format and each refusal."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from agentenv import ConfigError
from tests.trainer.megatron.tiny import TINY
from trainer.megatron import ParallelConfig, resolve_options

RECOMPUTE = ParallelConfig(recompute_granularity="selective")


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps({**TINY, "architectures": ["LlamaForCausalLM"]})
    )
    return tmp_path


@pytest.mark.parametrize(
    ("kwargs", "qkv_format"),
    [
        ({}, "thd"),  # bf16, SDPA, no recomputation: packed
        ({"dtype": torch.float32}, "bshd"),
        ({"attention": "local"}, "bshd"),
        ({"parallel": RECOMPUTE}, "bshd"),
    ],
)
def test_packed_sequences_are_the_default_where_they_can_run(
    model_dir: Path, kwargs: dict[str, Any], qkv_format: str
) -> None:
    assert resolve_options(model_dir, **kwargs).qkv_format == qkv_format


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"attention": "flash"}, r"attention must be 'sdpa' or 'local', got 'flash'"),
        ({"qkv_format": "sbhd"}, r"qkv_format must be 'bshd' or 'thd', got 'sbhd'"),
        ({"qkv_format": "thd", "dtype": torch.float32}, r"needs bfloat16"),
        ({"qkv_format": "thd", "parallel": RECOMPUTE}, r"--recompute-granularity"),
        ({"qkv_format": "thd", "attention": "local"}, r"needs attention 'sdpa'"),
        ({"parallel": ParallelConfig(context_parallel_size=2)}, r"Transformer Engine"),
    ],
)
def test_each_bad_combination_is_named(
    model_dir: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        resolve_options(model_dir, **kwargs)


def test_the_options_travel_to_the_other_ranks(model_dir: Path) -> None:
    import pickle

    options = resolve_options(model_dir, num_gpus=2)
    assert pickle.loads(pickle.dumps(options)) == options
    assert options.data_parallel_size == 2 and not options.wants_reference
