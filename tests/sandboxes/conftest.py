"""One warm sandbox per backend for a whole test module (starting containers is slow)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sandboxes import Limits, Sandbox


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module", params=["docker", "bwrap"])
async def sandbox(request: pytest.FixtureRequest) -> AsyncIterator[Sandbox]:
    """A started sandbox of each backend, with small limits so the attacks end fast."""
    if request.param == "docker":
        request.applymarker(pytest.mark.docker)
    limits = Limits(timeout_s=5, memory_mb=256, pids=64, tmpfs_mb=32, output_bytes=1 << 16)
    async with Sandbox(request.param, size=2, limits=limits) as s:
        yield s
