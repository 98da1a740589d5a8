"""Fixtures: each tiny architecture, tied and untied."""

from __future__ import annotations

from typing import Any

import pytest

from tests.trainer.megatron.tiny import tiny_model


@pytest.fixture(
    params=[("llama", False), ("llama", True), ("qwen2", False), ("qwen2", True)],
    ids=["llama-untied", "llama-tied", "qwen2-untied", "qwen2-tied"],
)
def hf_model(request: pytest.FixtureRequest) -> Any:
    arch, tied = request.param
    return tiny_model(arch, tied)
