"""Weight sync: after each update, the engines generate with the trainer's new weights.

Two ways, one interface (``await sync(backend, version)``):

* :class:`InProcessSync` -- the embedded :class:`~agentenv.engine.Engine` in this process
  receives the HF-named tensors directly (a copy between two decode steps).
* :class:`DiskSync` -- the trainer writes an HF safetensors directory and asks every
  server (SGLang, or ``agentenv serve``) to load it with ``POST /update_weights_from_disk``.
  The servers must see the same filesystem. Only the newest directory is kept.

Either way the new weight version (the trainer's step) is stamped on every token generated
afterwards, so samples say which policy produced them.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

import anyio

from trainer._backend import Backend
from trainer._files import replace_dir

__all__ = ["DiskSync", "InProcessSync", "WeightSync"]


class WeightSync(Protocol):
    """Pushes ``backend``'s weights to the engines as ``version``."""

    async def __call__(self, backend: Backend, version: int) -> None: ...


class InProcessSync:
    """Copies the weights into an embedded engine (anything with ``update_weights``)."""

    def __init__(self, engine: Any) -> None:
        if not hasattr(engine, "update_weights"):
            raise TypeError(
                f"{type(engine).__name__} has no update_weights: in-process sync needs an "
                "embedded agentenv.engine.Engine (use DiskSync for servers)"
            )
        self.engine = engine

    async def __call__(self, backend: Backend, version: int) -> None:
        await self.engine.update_weights(backend.state_dict(), weight_version=str(version))


class DiskSync:
    """Saves HF safetensors under ``directory`` and has each client load them.

    Args:
        clients: :class:`~agentenv.sglang.SGLangClient` s (servers or a router's workers).
        directory: where ``step_N`` directories are written (visible to the servers).
    """

    def __init__(self, clients: Sequence[Any], directory: str | os.PathLike[str]) -> None:
        if not clients:
            raise ValueError("DiskSync needs at least one client")
        self.clients = list(clients)
        self.directory = Path(directory)
        self._last: Path | None = None

    async def __call__(self, backend: Backend, version: int) -> None:
        path = self.directory / f"step_{version}"
        await anyio.to_thread.run_sync(_save, backend, path)
        async with anyio.create_task_group() as tg:
            for client in self.clients:
                tg.start_soon(_load, client, str(path.resolve()), str(version))
        if self._last is not None and self._last != path:
            await anyio.to_thread.run_sync(shutil.rmtree, self._last, True)
        self._last = path


def _save(backend: Backend, path: Path) -> None:
    with replace_dir(path) as tmp:  # a server never sees a half-written directory
        backend.save_hf(tmp)


async def _load(client: Any, path: str, version: str) -> None:
    await client.update_weights_from_disk(path, weight_version=version)
