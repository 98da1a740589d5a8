"""One local Ray cluster for the whole test session, with logical GPUs (none are real)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # started by another part of the suite
        yield
        return
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
