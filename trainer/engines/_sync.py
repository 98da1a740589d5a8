"""Weight sync: after each update, the engines generate with the trainer's new weights.

Four ways, one interface (``await sync(backend, version)``; docs/trainer.md, "Weight sync
to servers"): :class:`InProcessSync` into the embedded engine in this process,
:class:`DiskSync` through an HF directory every server loads
(``/update_weights_from_disk``), :class:`DistributedSync` broadcast over a process group
of the servers' (``/update_weights_from_distributed``) and :class:`TensorSync` by handle
to servers on the trainer's own GPU (``/update_weights_from_tensor``). The new version
is stamped on every token generated afterwards.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import anyio
import torch

from agentenv import ClosedResourceError, ConfigError
from trainer._resources import replace_dir
from trainer.backends import Backend, TensorMeta, WeightSender, sender_of

__all__ = ["DiskSync", "DistributedSync", "InProcessSync", "TensorSync", "WeightSync"]


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


class TensorSync:
    """Hands the weights to servers on the trainer's own GPU (or, on CPU, its machine) by
    handle, SGLang's ``/update_weights_from_tensor``: no disk, no broadcast, no copy
    beyond the server's own into its weights. For colocated engines (``--colocate``).

    ``senders(backend, clients)`` says which of the backend's weight senders serves which
    servers (default: the backend's one sender serves them all); on Ray each engine gets
    the weights from the trainer rank on its GPU.

    Args:
        clients: :class:`~agentenv.sglang.SGLangClient` s of servers that can map the
            trainer's memory (the same GPU, or the same machine on CPU).
        api_key: the servers' API key.
    """

    def __init__(
        self,
        clients: Sequence[Any],
        *,
        api_key: str | None = None,
        senders: Callable[[Backend, Sequence[Any]], list[tuple[WeightSender, list[Any]]]]
        | None = None,
    ) -> None:
        if not clients:
            raise ConfigError("TensorSync needs at least one client")
        self.clients = list(clients)
        self.api_key = api_key
        self._senders = senders or _one_sender

    async def __call__(self, backend: Backend, version: int) -> None:
        async def post(sender: WeightSender, clients: list[Any]) -> None:
            urls = [c.url for c in clients]
            await anyio.to_thread.run_sync(sender.post_tensors, urls, str(version), self.api_key)

        plan = self._senders(backend, self.clients)
        await _all([functools.partial(post, sender, clients) for sender, clients in plan])


def _one_sender(backend: Backend, clients: Sequence[Any]) -> list[tuple[WeightSender, list[Any]]]:
    return [(sender_of(backend), list(clients))]


class DistributedSync:
    """Broadcasts the weights to every server over a process group: SGLang's distributed
    weight update, which ``agentenv serve`` speaks too.

    The tensors leave from where the weights are, the backend's
    :meth:`~trainer.Backend.weight_sender` (trainer rank 0's actor on Ray, never the
    driver). The first call forms the group (the sender rank 0, server ``i`` rank
    ``i + 1``); each call pauses generation on the servers (``retract``: none is lost),
    sends the state dict in buckets of about ``bucket_bytes``, each announced to every
    server as it is broadcast and answered before the next, and continues generation.
    The group stays up between calls; :meth:`aclose` destroys it on both sides. A refused
    bucket or a timeout raises at once (the trainer never waits on a refused broadcast),
    the group is aborted and the next call forms a new one (docs/trainer.md, "Weight sync
    to servers", has the protocol).

    Args:
        clients: :class:`~agentenv.sglang.SGLangClient` s, one per server; each server
            takes one rank (one GPU: tensor-parallel servers are not supported).
        backend: ``nccl`` (the trainer's weights on CUDA; each server on a GPU that the
            trainer does not use) or ``gloo`` (CPU).
        master_address: the address at which the servers reach this process.
        bucket_bytes: bytes per bucket (a larger tensor goes alone); also the extra memory
            a server needs while it receives.
        timeout: seconds the servers may take to join, and a bucket to be broadcast and
            acknowledged by all of them.
    """

    def __init__(
        self,
        clients: Sequence[Any],
        *,
        backend: Literal["nccl", "gloo"] = "nccl",
        master_address: str = "127.0.0.1",
        bucket_bytes: int = 512 << 20,
        timeout: float = 120.0,
    ) -> None:
        if not clients:
            raise ConfigError("DistributedSync needs at least one client")
        if backend not in ("nccl", "gloo"):
            raise ConfigError(f"backend must be nccl or gloo, got {backend!r}")
        if bucket_bytes < 1:
            raise ConfigError(f"bucket_bytes must be positive, got {bucket_bytes}")
        if timeout <= 0:
            raise ConfigError(f"timeout must be positive, got {timeout}")
        self.clients = list(clients)
        self.backend = backend
        self.master_address = master_address
        self.bucket_bytes = bucket_bytes
        self.group_name = "weight_update_group"  # the group's name on the servers
        self.timeout = timeout
        self._sender: WeightSender | None = None  # the backend's, and which backend
        self._sender_of: Backend | None = None
        self._formed = False
        self._closed = False
        self._busy = anyio.Lock()  # one sync at a time: a group's broadcasts go in order

    async def __aenter__(self) -> DistributedSync:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def __call__(self, backend: Backend, version: int) -> None:
        async with self._busy:
            await self._sync(backend, version)

    async def _sync(self, backend: Backend, version: int) -> None:
        if self._closed:
            raise ClosedResourceError("the DistributedSync is closed")
        if self._sender is None or self._sender_of is not backend:
            await self._teardown()  # another backend's group, if any
            self._sender = sender_of(backend)
            self._sender_of = backend
        sender = self._sender
        buckets = await anyio.to_thread.run_sync(sender.prepare, self.bucket_bytes, self.backend)
        try:
            if not self._formed:
                await self._form(sender)
            await _all([functools.partial(c.pause, "retract") for c in self.clients])
            for i, bucket in enumerate(buckets):
                await self._send(sender, bucket, str(version), i, len(buckets))
        except BaseException:
            with anyio.CancelScope(shield=True):
                await _settle([c.resume for c in self.clients], self.timeout)
                # Aborted, not shut down: a broadcast of ours may still be waiting for a
                # server that refused its bucket or went away.
                await self._teardown(abort=True)
            raise
        finally:
            await anyio.to_thread.run_sync(sender.finish)
        await _all([c.resume for c in self.clients])

    async def aclose(self) -> None:
        """Destroy the group on the servers (best effort) and here; later calls raise
        :class:`~agentenv.ClosedResourceError`."""
        if self._closed:
            return
        self._closed = True
        with anyio.CancelScope(shield=True):
            async with self._busy:
                await self._teardown()

    async def _form(self, sender: WeightSender) -> None:
        address, port = await anyio.to_thread.run_sync(sender.rendezvous, self.master_address)
        world = 1 + len(self.clients)
        join = functools.partial(
            sender.join, address, port, world_size=world, name=self.group_name,
            backend=self.backend, timeout=self.timeout,
        )  # fmt: skip
        formed: list[bool] = []

        async def own() -> None:
            # Abandoned (it ends at its own timeout) when a server refuses to join.
            await anyio.to_thread.run_sync(join, abandon_on_cancel=True)
            formed.append(True)

        joined: list[Any] = []  # the servers that said they joined

        async def invite(client: Any, rank: int) -> None:
            await client.init_weights_update_group(
                address, port, rank, world, group_name=self.group_name, backend=self.backend,
            )  # fmt: skip
            joined.append(client)

        invites = [functools.partial(invite, c, i + 1) for i, c in enumerate(self.clients)]
        try:
            await _all([own, *invites])
        except BaseException:
            with anyio.CancelScope(shield=True):
                if formed:
                    await anyio.to_thread.run_sync(sender.destroy)
                # Only where it was formed: a server that refused may hold another
                # trainer's group of that name.
                await self._leave_servers(joined)
            raise
        self._formed = True

    async def _send(
        self, sender: WeightSender, bucket: list[TensorMeta], version: str, index: int,
        count: int,
    ) -> None:  # fmt: skip
        flush = index == count - 1  # the servers' caches hold old keys and values: drop once
        post = functools.partial(
            _post, names=[m.name for m in bucket], dtypes=[m.dtype for m in bucket],
            shapes=[list(m.shape) for m in bucket], name=self.group_name, version=version,
            flush=flush,
        )  # fmt: skip
        posts = [functools.partial(post, c) for c in self.clients]

        async def broadcast() -> None:
            # Abandoned when a server answers first with a refusal: this call raises the
            # server's message at once, and the broadcast ends when the group is aborted
            # (NCCL) or the servers leave it (gloo).
            await anyio.to_thread.run_sync(sender.broadcast, index, abandon_on_cancel=True)

        size = sum(math.prod(m.shape) * getattr(torch, m.dtype).itemsize for m in bucket) / 2**20
        try:
            with anyio.fail_after(self.timeout):
                await _all([*posts, broadcast])
        except TimeoutError:
            raise TimeoutError(
                f"bucket {index + 1} of {count} ({len(bucket)} tensors, {size:.1f} MiB) was not "
                f"received by every server within {self.timeout:g} s"
            ) from None

    async def _teardown(self, *, abort: bool = False) -> None:
        sender, formed = self._sender, self._formed
        self._formed = False
        if sender is None or not formed:
            return

        async def leave_here() -> None:
            if abort:
                await anyio.to_thread.run_sync(sender.abort)
                return
            with anyio.move_on_after(self.timeout):
                await anyio.to_thread.run_sync(sender.destroy, abandon_on_cancel=True)

        # Both ends at once: NCCL's communicator shutdown may wait for every rank.
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._leave_servers, self.clients)
            tg.start_soon(leave_here)

    async def _leave_servers(self, clients: Sequence[Any]) -> None:
        def leave(client: Any) -> Callable[[], Awaitable[object]]:
            return functools.partial(client.destroy_weights_update_group, self.group_name)

        await _settle([leave(c) for c in clients], self.timeout)


async def _post(
    client: Any,
    *,
    names: list[str],
    dtypes: list[str],
    shapes: list[list[int]],
    name: str,
    version: str,
    flush: bool,
) -> None:
    await client.update_weights_from_distributed(
        names, dtypes, shapes, group_name=name, weight_version=version, flush_cache=flush
    )


async def _all(calls: Sequence[Callable[[], Awaitable[object]]]) -> None:
    """Run ``calls`` at once; the first to fail cancels the others and is raised as itself."""
    errors: list[Exception] = []
    async with anyio.create_task_group() as tg:

        async def one(call: Callable[[], Awaitable[object]]) -> None:
            try:
                await call()
            except Exception as e:
                errors.append(e)
                tg.cancel_scope.cancel()

        for call in calls:
            tg.start_soon(one, call)
    if errors:
        raise errors[0]


async def _settle(calls: Sequence[Callable[[], Awaitable[object]]], seconds: float) -> None:
    """Run ``calls`` at once for ``seconds`` at most, ignoring their failures (clean-up
    after an error, or of a server that may be gone)."""

    async def one(call: Callable[[], Awaitable[object]]) -> None:
        with contextlib.suppress(Exception):
            await call()

    with anyio.move_on_after(seconds):
        async with anyio.create_task_group() as tg:
            for call in calls:
                tg.start_soon(one, call)
