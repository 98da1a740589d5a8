"""A standalone process group for broadcasting weights from a trainer to inference servers.

SGLang's distributed weight update (``/init_weights_update_group``,
``/update_weights_from_distributed``; the protocol: docs/trainer.md) joins the trainer
(rank 0) and the servers in a process group of their own; each bucket of tensors is
broadcast from rank 0 in the order its request lists them. :class:`WeightUpdateGroup` is
one rank of such a group: ``agentenv serve``'s end and :class:`trainer.DistributedSync`'s.

The group never touches torch's default process group (a trainer may already have one,
e.g. megatron's) and is not in torch's global group table: it is built from its own
``TCPStore`` (hosted by rank 0) with the keys laid out as SGLang's
``init_custom_process_group`` lays them out, so either end interoperates with SGLang
servers and slime-style trainers. Backends: ``nccl`` (CUDA tensors) and ``gloo`` (CPU).

Every call here blocks; async code runs them in a worker thread, except :meth:`abort`,
which may be called from any thread while a broadcast waits (it ends an NCCL broadcast at
once; gloo's, which cannot be interrupted, ends when the other ranks leave). A receiving
rank watches rank 0's store: when the trainer goes away mid-transfer, the broadcast is
aborted within about a second instead of waiting for NCCL's watchdog.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import os
import socket
import threading
from collections.abc import Container, Sequence
from typing import Any, Literal

import torch

from agentenv._errors import ConfigError

__all__ = [
    "DEFAULT_GROUP_NAME",
    "TRANSFER_TIMEOUT",
    "WeightUpdateGroup",
    "join_within",
    "parse_dtype",
]

DEFAULT_GROUP_NAME = "weight_update_group"  # SGLang's default
TRANSFER_TIMEOUT = 1800.0  # s a broadcast may wait for every rank (torch's default)
WATCH_INTERVAL = 0.5  # s between a receiving rank's checks that rank 0 is still there
UNBLOCK_INTERVAL = 0.2  # s between an abandoned join's unblockings
Backend = Literal["nccl", "gloo"]
BACKENDS: tuple[str, ...] = ("nccl", "gloo")


def parse_dtype(name: object) -> torch.dtype:
    """``"bfloat16"`` (or ``"torch.bfloat16"``) -> ``torch.bfloat16``, as SGLang reads the
    ``dtypes`` of ``/update_weights_from_distributed``."""
    value = getattr(torch, name.removeprefix("torch."), None) if isinstance(name, str) else None
    if not isinstance(value, torch.dtype):
        raise ConfigError(f"{name!r} is not a torch dtype (e.g. 'bfloat16', 'float32')")
    return value


class WeightUpdateGroup:
    """One rank of a weight-broadcast group (see the module docstring); build it with
    :meth:`join`.

    Attributes:
        name: the group's name (the key prefix in the store, as SGLang names it).
        backend: ``nccl`` or ``gloo``.
        rank, world_size: this rank (0: the trainer) and the number of ranks.
    """

    def __init__(
        self, name: str, backend: Backend, rank: int, world_size: int, pg: Any, store: Any
    ) -> None:
        self.name = name
        self.backend = backend
        self.rank = rank
        self.world_size = world_size
        self._pg = pg
        # Rank 0 hosts the store (it lives as long as the group); the others' connection
        # to it tells them whether rank 0 is still there.
        self._store = store
        self._aborted = False

    @classmethod
    def join(
        cls,
        master_address: str,
        master_port: int,
        *,
        rank: int,
        world_size: int,
        name: str = DEFAULT_GROUP_NAME,
        backend: Backend = "nccl",
        timeout: float = 60.0,
        transfer_timeout: float = TRANSFER_TIMEOUT,
    ) -> WeightUpdateGroup:
        """Form the group: blocks until all ``world_size`` ranks have joined.

        Rank 0 hosts the store at ``master_address:master_port``; the others connect to it.
        Raises :class:`ConfigError` for bad arguments and :class:`TimeoutError` when the
        ranks do not all arrive within ``timeout`` seconds. ``transfer_timeout`` bounds each
        later broadcast.
        """
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be nccl or gloo, got {backend!r}")
        if world_size < 2:
            raise ConfigError(
                f"world_size must be at least 2 (the trainer and a server), got {world_size}"
            )
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank must be in [0, {world_size}), got {rank}")
        if not name:
            raise ConfigError("the group name must not be empty")
        if timeout <= 0 or transfer_timeout <= 0:
            raise ConfigError("timeout and transfer_timeout must be positive")
        from torch.distributed import PrefixStore, TCPStore  # type: ignore[attr-defined]

        where = f"{master_address}:{master_port}"
        try:
            store = TCPStore(
                master_address,
                master_port,
                world_size,
                rank == 0,
                timeout=datetime.timedelta(seconds=timeout),
                wait_for_workers=True,
                multi_tenant=True,
            )
        except (RuntimeError, OSError) as e:  # torch's DistStoreError is a RuntimeError
            raise _late(name, where, rank, world_size, timeout, _first_line(e)) from None
        # The layout init_custom_process_group gives the keys (see the module docstring).
        device = "cpu" if backend == "gloo" else "cuda"
        # SGLang's layout: name, then name/, then cpu/ or cuda/ (gloo then adds its handshake).
        keys = PrefixStore(f"{device}/", PrefixStore(f"{name}/", PrefixStore(name, store)))
        try:
            # The ranks connect within the join's timeout; later broadcasts wait up to
            # transfer_timeout.
            pg = _backend(backend, keys, rank, world_size, name, timeout)
            pg._set_default_timeout(datetime.timedelta(seconds=transfer_timeout))
        except (RuntimeError, OSError) as e:
            raise TimeoutError(
                f"weight update group {name!r} at {where}: rank {rank} of {world_size} could "
                f"not connect to the others: {_first_line(e)}"
            ) from None
        return cls(name, backend, rank, world_size, pg, store)

    def broadcast(self, tensors: Sequence[torch.Tensor]) -> None:
        """Rank 0 sends ``tensors``; every other rank receives into its ``tensors`` (same
        shapes and dtypes, same order). Returns once every tensor has arrived."""
        if self._pg is None:
            raise ConfigError(f"weight update group {self.name!r} is destroyed")
        from torch.distributed import BroadcastOptions

        if not tensors:
            return
        device = tensors[0].device
        for t in tensors:
            if self.backend == "nccl" and t.device.type != "cuda":
                raise ConfigError(
                    f"the nccl backend broadcasts CUDA tensors, got one on {t.device} "
                    "(use the gloo backend for CPU tensors)"
                )
            if not t.is_contiguous():
                raise ConfigError("broadcast tensors must be contiguous")
        options = BroadcastOptions()
        options.rootRank = 0
        options.rootTensor = 0
        pg, store = self._pg, self._store if self.rank != 0 else None
        lost = threading.Event()  # rank 0 went away
        done = threading.Event()
        if store is not None:
            threading.Thread(target=self._watch, args=(store, lost, done), daemon=True).start()
        try:
            with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
                # All in flight at once, in order on every rank (as SGLang and slime do).
                works = [pg.broadcast([t], options) for t in tensors]
                for work in works:
                    work.wait()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
        except RuntimeError as e:
            if lost.is_set() or (store is not None and not _answers(store)):
                raise RuntimeError(
                    f"weight update group {self.name!r}: rank 0 (the trainer) went away "
                    f"during the transfer ({_first_line(e)})"
                ) from None
            if self._aborted:
                raise RuntimeError(
                    f"weight update group {self.name!r} was aborted during the transfer"
                ) from None
            raise
        finally:
            done.set()

    def _watch(self, store: Any, lost: threading.Event, done: threading.Event) -> None:
        """Until ``done``: check every :data:`WATCH_INTERVAL` s that rank 0's store still
        answers; if not, set ``lost`` and abort the group (the broadcast then fails)."""
        while not done.wait(WATCH_INTERVAL):
            if not _answers(store) and not done.is_set():
                lost.set()
                self.abort()
                return

    def destroy(self) -> None:
        """Leave the group (a no-op the second time); NCCL's communicator is shut down."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None and self.backend == "nccl":
            stop = getattr(pg, "shutdown", None) or getattr(pg, "abort", None)
            if stop is not None:
                stop()

    def abort(self) -> None:
        """Leave the group at once, from any thread (a no-op once left): on NCCL the
        communicator is aborted, so a broadcast waiting in another thread fails now, where
        :meth:`destroy` may wait for the other ranks."""
        pg, self._pg, self._store = self._pg, None, None
        if pg is not None:
            self._aborted = True
            abort = getattr(pg, "abort", None)
            if abort is not None:  # gloo's does nothing (torch 2.13)
                abort()

    @property
    def destroyed(self) -> bool:
        return self._pg is None

    def __repr__(self) -> str:
        return (
            f"WeightUpdateGroup({self.name!r}, backend={self.backend!r}, rank={self.rank}, "
            f"world_size={self.world_size})"
        )


def _backend(
    backend: Backend, store: Any, rank: int, world_size: int, name: str, timeout: float
) -> Any:
    """torch's backend object for the group (what ``_new_process_group_helper`` builds for
    ``backend``, without registering it anywhere)."""
    delta = datetime.timedelta(seconds=timeout)
    if backend == "gloo":
        from torch.distributed import ProcessGroupGloo

        pg: Any = ProcessGroupGloo(store, rank, world_size, delta)
    else:
        try:
            from torch.distributed import ProcessGroupNCCL
        except ImportError:
            raise ConfigError(
                "this torch build has no NCCL (a CPU build?): use the gloo backend"
            ) from None
        options: Any = ProcessGroupNCCL.Options()
        options.is_high_priority_stream = False
        options._timeout = delta
        options.global_ranks_in_group = []
        options.group_name = name
        pg = ProcessGroupNCCL(store, rank, world_size, options)
    # Rank 0 publishes a sequence number that the others wait for: both ends must do it.
    pg._set_sequence_number_for_group()
    return pg


async def join_within(
    master_address: str,
    master_port: int,
    *,
    timeout: float,  # noqa: ASYNC109 - the store's own timeout too
    **options: Any,
) -> WeightUpdateGroup:
    """:meth:`WeightUpdateGroup.join` for async code: over within ``timeout`` seconds (a
    :class:`TimeoutError` then) and cancellable at any time.

    torch's ``TCPStore`` does not bound every wait of its handshake by its timeout (a
    master that accepts the connection and never answers holds it for ever), and a thread
    blocked in C++ cannot be interrupted. So the join runs in a daemon thread of its own,
    which is abandoned at the deadline or on cancellation; until it ends, the connections
    it opens to the master are shut down (which ends its waits: the store gives up at its
    own deadline), and a group that forms after all is destroyed."""
    import anyio
    import anyio.from_thread
    import anyio.lowlevel

    token = anyio.lowlevel.current_token()
    done = anyio.Event()
    state = threading.Lock()
    outcome: list[WeightUpdateGroup | BaseException] = []
    abandoned = threading.Event()
    before = _sockets()

    def run() -> None:
        result: WeightUpdateGroup | BaseException
        try:
            result = WeightUpdateGroup.join(master_address, master_port, timeout=timeout, **options)
        except BaseException as e:  # handed to the waiting task
            result = e
        with state:
            late = abandoned.is_set()
            if not late:
                outcome.append(result)
        if late:
            if isinstance(result, WeightUpdateGroup):
                result.destroy()
            return
        with contextlib.suppress(RuntimeError):  # the loop is gone
            anyio.from_thread.run_sync(done.set, token=token)

    def abandon() -> None:
        with state:  # held by the thread for an instant at most
            abandoned.set()
            handed = list(outcome)  # a group formed just as the wait ended: not kept
        cleanup = functools.partial(_unblock, thread, before, master_address, master_port, handed)
        threading.Thread(target=cleanup, daemon=True).start()

    thread = threading.Thread(target=run, name=f"join {master_address}:{master_port}", daemon=True)
    thread.start()
    try:
        with anyio.move_on_after(timeout):
            await done.wait()
    except BaseException:  # cancelled: the server stops, or the request went away
        abandon()
        raise
    if not outcome:
        abandon()
        raise _late(
            options.get("name", DEFAULT_GROUP_NAME), f"{master_address}:{master_port}",
            options["rank"], options["world_size"], timeout, "the rendezvous did not complete",
        )  # fmt: skip
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _late(
    name: str, where: str, rank: int, world_size: int, timeout: float, detail: str
) -> TimeoutError:
    who = "the other ranks" if rank == 0 else "rank 0 (the trainer)"
    return TimeoutError(
        f"weight update group {name!r}: {who} did not join at {where} within {timeout:g} s "
        f"(this is rank {rank} of {world_size}): {detail}"
    )


def _sockets() -> dict[int, int]:
    """This process's sockets: inode -> descriptor (Linux; empty elsewhere)."""
    found = {}
    with contextlib.suppress(OSError):
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError, ValueError):
                link = os.readlink(f"/proc/self/fd/{fd}")
                if link.startswith("socket:["):
                    found[int(link[8:-1])] = int(fd)
    return found


def _unblock(
    thread: threading.Thread,
    before: Container[int],
    address: str,
    port: int,
    handed: list[WeightUpdateGroup | BaseException],
) -> None:
    """After a join is abandoned: destroy the group it handed over (if any); until
    ``thread`` (the join) ends, shut down the sockets opened since ``before`` that lead to
    the master at ``address:port``, so that its waits on them end."""
    for result in handed:
        if isinstance(result, WeightUpdateGroup):
            result.destroy()
    try:
        hosts = {info[4][0] for info in socket.getaddrinfo(address, port)}
    except OSError:
        hosts = set()  # the join cannot have connected either
    while thread.is_alive():
        for inode, fd in _sockets().items():
            if inode in before:
                continue
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(fd)) as s:
                if s.family not in (socket.AF_INET, socket.AF_INET6):
                    continue
                peer = s.getpeername()
                host = peer[0].removeprefix("::ffff:")  # an IPv4 peer of an IPv6 socket
                # Still the socket listed (a number may be reused), to the master.
                if os.fstat(s.fileno()).st_ino == inode and (
                    peer[1] == port and (host in hosts or peer[0] in hosts)
                ):
                    s.shutdown(socket.SHUT_RDWR)
        thread.join(UNBLOCK_INTERVAL)


def _answers(store: Any) -> bool:
    """Whether rank 0's store still answers (its process is alive)."""
    try:
        store.check(["rank0"])
    except Exception:  # DistNetworkError (a RuntimeError): the connection is gone
        return False
    return True


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
