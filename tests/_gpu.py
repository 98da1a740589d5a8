"""The one rule for tests that need CUDA GPUs: ``@gpu_test(n)`` (or ``pytestmark =
gpu_test(n)``, or ``marks=gpu_test(n)`` on a parameter) marks a test ``gpu`` and has it
skipped, with the count, on a machine with fewer than ``n`` CUDA devices (``tests/conftest.py``
applies it at collection)."""

from __future__ import annotations

import functools

import pytest

__all__ = ["cuda_devices", "gpu_test"]


def gpu_test(n: int = 1) -> pytest.MarkDecorator:
    """Marks a test that needs ``n`` CUDA GPUs (``-m gpu`` selects them)."""
    if n < 1:
        raise ValueError(f"gpu_test needs at least 1 GPU, got {n}")
    return pytest.mark.gpu(n)


@functools.cache
def cuda_devices() -> int:
    """How many CUDA devices this machine has (0 without torch or CUDA)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def needs(item: pytest.Item) -> int:
    """How many GPUs ``item`` asks for (0: it is no GPU test)."""
    mark = item.get_closest_marker("gpu")
    if mark is None:
        return 0
    return int(mark.args[0]) if mark.args else 1
