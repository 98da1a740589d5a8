"""Checkpoints written in the background: the training step's state is copied to CPU
memory (:func:`cpu_copy`, on the training thread, quickly), then written by a thread of
its own while the next steps go on (:class:`CheckpointWriter`).

A write replaces the previous checkpoint atomically (:func:`trainer._files.replace_dir`:
a crash mid-write keeps the previous one whole). At most one write is in flight: the next
save waits for the previous one. An error in a write fails the run with that error (at
the next step, save or the end: :meth:`CheckpointWriter.check`), and
:meth:`CheckpointWriter.wait` returns only once the last write is complete.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.abc
import torch

__all__ = ["CheckpointWriter", "WriteCheckpoint", "cpu_copy"]

T = TypeVar("T")

#: Writes a snapshot of the trainer's state into a checkpoint directory, atomically.
WriteCheckpoint = Callable[[str | os.PathLike[str]], None]


def cpu_copy(obj: T) -> T:
    """``obj`` (tensors in dicts, lists and tuples: a state dict, an optimizer's) with every
    tensor copied to CPU memory, detached: training can go on changing the originals.
    Tensors that are the same view of one storage (tied weights) stay one copy, so a
    writer sees the same sharing. Other leaves (numbers, strings) are kept as they are."""
    memo: dict[tuple[Any, ...], torch.Tensor] = {}

    def copy(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            t = x.detach()
            key = (
                t.device, t.untyped_storage().data_ptr(), t.storage_offset(),
                tuple(t.shape), tuple(t.stride()), t.dtype,
            )  # fmt: skip
            if key not in memo:
                memo[key] = t.to("cpu", copy=True)
            return memo[key]
        if isinstance(x, dict):
            return type(x)((k, copy(v)) for k, v in x.items())
        if isinstance(x, list):
            return [copy(v) for v in x]
        if isinstance(x, tuple):
            return tuple(copy(v) for v in x)
        return x

    out: T = copy(obj)
    return out


class CheckpointWriter:
    """Writes the loop's checkpoints, one at a time, in tasks of ``task_group``."""

    def __init__(self, task_group: anyio.abc.TaskGroup) -> None:
        self.task_group = task_group
        self._done: anyio.Event | None = None
        self._error: BaseException | None = None

    async def save(self, backend: Any, directory: str | os.PathLike[str], extra: Any) -> float:
        """Snapshot ``backend``'s state now and write it into ``directory`` in the
        background (a backend without :meth:`~trainer.Backend.checkpoint_snapshot`
        writes in the foreground). Returns the seconds the caller spent: waiting for the
        previous write, and the snapshot."""
        start = time.perf_counter()
        await self.wait()
        write: WriteCheckpoint | None = await anyio.to_thread.run_sync(
            backend.checkpoint_snapshot, extra
        )
        if write is None:
            await anyio.to_thread.run_sync(backend.save_checkpoint, directory, extra)
            return time.perf_counter() - start
        done = self._done = anyio.Event()

        async def run() -> None:
            try:
                await anyio.to_thread.run_sync(write, directory)
            except Exception as e:  # raised in the loop, by check() or wait()
                self._error = e
            finally:
                done.set()

        self.task_group.start_soon(run)
        return time.perf_counter() - start

    def check(self) -> None:
        """Raise the error of a write that failed."""
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    async def wait(self) -> None:
        """Until the write in flight, if any, is complete; then :meth:`check`."""
        if self._done is not None:
            await self._done.wait()
        self.check()
