"""Checkpoints written in the background (docs/trainer.md, "Checkpoint and resume"): the
step's state is copied to CPU memory on the training thread (:func:`cpu_copy`), then
written by a thread of its own while the next steps go on (:class:`CheckpointWriter`),
replacing the previous checkpoint atomically. At most one write is in flight; a failed
write fails the run at the next step, save or the end. ``keep=N`` keeps the N - 1 before
the newest as ``NAME.step-K`` (hard links: setting one aside copies nothing).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
import anyio.abc
import torch

from agentenv import ConfigError

__all__ = [
    "CheckpointWriter",
    "WriteCheckpoint",
    "checkpoint_meta",
    "checkpoint_step",
    "cpu_copy",
    "kept_checkpoints",
    "link_model",
]

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
    """Writes the loop's checkpoints, one at a time, in tasks of ``task_group``, keeping
    the ``keep`` newest (at least the newest: a resume needs it)."""

    def __init__(self, task_group: anyio.abc.TaskGroup, *, keep: int = 1) -> None:
        self.task_group = task_group
        self.keep = max(keep, 1)
        self._done: anyio.Event | None = None
        self._error: BaseException | None = None

    async def save(self, backend: Any, directory: str | os.PathLike[str], extra: Any) -> float:
        """Snapshot ``backend``'s state now and write it into ``directory`` in the
        background (a backend without :meth:`~trainer.Backend.checkpoint_snapshot`
        writes in the foreground). Returns the seconds the caller spent: waiting for the
        previous write, and the snapshot."""
        start = time.perf_counter()
        await self.wait()
        if self.keep > 1:
            await anyio.to_thread.run_sync(_set_aside, directory)
        write: WriteCheckpoint | None = await anyio.to_thread.run_sync(
            backend.checkpoint_snapshot, extra
        )
        if write is None:
            await anyio.to_thread.run_sync(backend.save_checkpoint, directory, extra)
            await anyio.to_thread.run_sync(_prune, directory, self.keep)
            return time.perf_counter() - start
        done = self._done = anyio.Event()

        async def run() -> None:
            try:
                await anyio.to_thread.run_sync(write, directory)
                await anyio.to_thread.run_sync(_prune, directory, self.keep)
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


def checkpoint_step(directory: str | os.PathLike[str]) -> int | None:
    """The step of the complete checkpoint in ``directory`` (``None``: there is none)."""
    try:
        meta = json.loads((Path(directory) / "checkpoint.json").read_text())
        return int(meta["extra"]["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def checkpoint_meta(directory: str | os.PathLike[str], identity: dict[str, Any]) -> dict[str, Any]:
    """``directory``'s ``checkpoint.json``, refused (naming what differs) unless its model
    is ``identity``."""
    root = Path(directory)
    try:
        meta: dict[str, Any] = json.loads((root / "checkpoint.json").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{str(root)!r} is not a trainer checkpoint: {e}") from None
    saved = meta.get("model") or {}
    if saved != identity:
        diff = {k: (saved.get(k), v) for k, v in identity.items() if saved.get(k) != v}
        raise ConfigError(
            f"checkpoint {str(root)!r} is from another model or layout (checkpoint vs this: {diff})"
        )
    return meta


def kept_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """The older checkpoints kept beside ``directory`` (``NAME.step-K``), oldest first."""
    final = Path(directory)
    found = []
    for p in final.parent.glob(f"{final.name}.step-*"):
        step = p.name.rpartition(".step-")[2]
        if step.isdigit() and p.is_dir():
            found.append((int(step), p))
    return [p for _, p in sorted(found)]


def _set_aside(directory: str | os.PathLike[str]) -> None:
    """Keep the complete checkpoint in ``directory`` as ``NAME.step-K`` (its step), by
    hard links: the write about to replace ``directory`` then leaves its files there."""
    final = Path(directory)
    step = checkpoint_step(final)
    if step is None:
        return  # no complete checkpoint there yet
    kept = final.with_name(f"{final.name}.step-{step}")
    if kept.exists():
        return
    tmp = kept.with_name(kept.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(final, tmp, copy_function=_link)
    tmp.rename(kept)


def _link(source: str, target: str) -> None:
    """A hard link (no bytes copied); a copy where the filesystem has none."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _prune(directory: str | os.PathLike[str], keep: int) -> None:
    """Remove the kept checkpoints beyond the ``keep - 1`` newest (``directory`` itself,
    now complete, is the newest)."""
    old = kept_checkpoints(directory)
    for p in old[: max(len(old) - (keep - 1), 0)]:
        with contextlib.suppress(FileNotFoundError):
            shutil.rmtree(p)


def link_model(
    checkpoint: str | os.PathLike[str], directory: str | os.PathLike[str], step: int
) -> bool:
    """Make ``directory`` (replaced atomically) the HF model in ``checkpoint`` by hard
    links, if ``checkpoint`` is complete, of step ``step`` and holds one (the torch
    backend's ``model``): a run's final model and its last checkpoint then share their
    weight files on disk instead of holding them twice. ``False``: it is not; save the
    model instead."""
    from trainer._resources import replace_dir

    root = Path(checkpoint)
    if checkpoint_step(root) != step or not (root / "model" / "config.json").is_file():
        return False
    with replace_dir(directory) as tmp:
        shutil.copytree(root / "model", tmp, dirs_exist_ok=True, copy_function=_link)
    return True
