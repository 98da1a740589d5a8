"""Shared fixtures: the SmolLM2 tokenizer and the same tokenizer with other template families;
the skip of tests that need more CUDA GPUs than this machine has (``tests._gpu``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from agentenv import ChatTokenizer
from tests import _gpu

TEMPLATES = Path(__file__).parent / "templates"

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test marked ``gpu_test(n)`` is skipped where fewer than ``n`` CUDA GPUs are."""
    for item in items:
        need = _gpu.needs(item)
        if need and _gpu.cuda_devices() < need:
            have = _gpu.cuda_devices()
            item.add_marker(pytest.mark.skip(reason=f"needs {need} CUDA GPU(s), found {have}"))


@pytest.fixture(scope="session")
def smollm2() -> ChatTokenizer:
    """SmolLM2-135M-Instruct's own tokenizer and ChatML template (no tool support)."""
    return ChatTokenizer.load("smollm2-135m")


@pytest.fixture(scope="session")
def chatml_tools(smollm2: ChatTokenizer) -> ChatTokenizer:
    """SmolLM2's tokenizer with a Qwen2.5-style ChatML template that renders tools."""
    return smollm2.with_template((TEMPLATES / "chatml_tools.jinja").read_text())


@pytest.fixture(scope="session")
def llama3(smollm2: ChatTokenizer) -> ChatTokenizer:
    """SmolLM2's tokenizer with Llama-3 header/eot special tokens and template."""
    return smollm2.with_template(
        (TEMPLATES / "llama3.jinja").read_text(),
        special_tokens=LLAMA3_SPECIALS,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )


@pytest.fixture(scope="session")
def thinking(smollm2: ChatTokenizer) -> ChatTokenizer:
    """A ChatML template that strips earlier <think> blocks (it rewrites history)."""
    return smollm2.with_template((TEMPLATES / "thinking.jinja").read_text())


@pytest.fixture(params=["smollm2", "chatml_tools", "llama3"])
def any_template(request: pytest.FixtureRequest) -> ChatTokenizer:
    """Each template family that keeps history intact."""
    tok: ChatTokenizer = request.getfixturevalue(request.param)
    return tok


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"
