"""One local Ray cluster for the session's tests: 8 logical CPUs and 4 logical GPUs on
this CPU machine (bundles ask for GPUs; the ranks run on CPU over gloo)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[Any]:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():  # started by another part of the suite
        yield ray
        return
    ray.init(num_cpus=8, num_gpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray
    finally:
        ray.shutdown()
