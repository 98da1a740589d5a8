"""Rank management: the ranks of a multi-GPU trainer, each holding a *worker* (its share
of the model), driven from the calling process.

:class:`Ranks` is the seam: start the ranks, call a method on every rank's worker, see a
rank that died, shut down. The backend (:class:`~trainer.megatron.MegatronBackend`)
knows nothing else about where its ranks run. One implementation, :class:`ProcessRanks`:
the calling process is rank 0 and holds its worker itself; it starts ranks 1..N-1 (no
``torchrun`` needed), each a ``python -m trainer.megatron._follower`` process that
builds the same worker on its own device and then waits for calls. A call is
broadcast first (its method's name and arguments, on a gloo channel), then every rank
runs it; the caller gets rank 0's result.

    ranks = ProcessRanks("pkg.mod:Worker", spec, devices=[0, 1])  # Worker(spec, rendezvous)
    result = ranks.call(Worker.step, batch)   # every rank runs worker.step(batch)
    ranks.close()                             # the followers exit; rank 0's worker shuts down

A follower that dies takes the run down at once (the driver would otherwise wait in a
collective forever): a watchdog thread in the driver reports its exit status and ends the
driver's process.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, cast

from agentenv import ClosedResourceError, ConfigError, resolve_name
from trainer._files import free_port

__all__ = ["FOLLOWER_DEVICE", "ProcessRanks", "Ranks", "Rendezvous", "Worker", "follow"]

P = ParamSpec("P")
R = TypeVar("R")

_CLOSE = "__close__"

#: Set in a follower's environment: its device (a CUDA index or ``cpu``).
FOLLOWER_DEVICE = "AGENTENV_MEGATRON_DEVICE"


@dataclasses.dataclass(frozen=True, slots=True)
class Rendezvous:
    """What a rank's worker needs to join the others: its rank, the world size, its
    device (a CUDA index or ``cpu``) and torch.distributed's rendezvous address."""

    rank: int
    world_size: int
    device: int | str
    port: int
    address: str = "127.0.0.1"

    @property
    def init_method(self) -> str:
        """For ``torch.distributed.init_process_group(init_method=...)``."""
        return f"tcp://{self.address}:{self.port}"


class Worker(Protocol):
    """A rank's share of the work: built by ``factory(spec, rendezvous)`` on every rank,
    its methods run by :meth:`Ranks.call`, and :meth:`shutdown` at the end."""

    def shutdown(self) -> None:
        """This rank's part of closing (process groups it set up)."""


W = TypeVar("W", bound=Worker, covariant=True)
V = TypeVar("V", bound=Worker)


class Ranks(Protocol[W]):
    """Every rank's worker, driven from this process (the seam between a backend and
    where its ranks run). A launcher starts them (:class:`ProcessRanks`' constructor
    here); the caller then only calls, watches and closes."""

    @property
    def world_size(self) -> int:
        """Ranks in all."""

    @property
    def local(self) -> W | None:
        """Rank 0's worker when it runs in this process, else ``None``."""

    def call(
        self, method: Callable[Concatenate[W, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """Run ``method`` (a worker method, e.g. ``Worker.step``) with these arguments on
        every rank; rank 0's result. A :class:`~agentenv.ConfigError` (bad input, found
        on every rank before any collective) reaches the caller and the ranks go on."""

    def exited(self) -> dict[int, int]:
        """The ranks that have stopped, with their exit status (empty while all run)."""

    def close(self) -> None:
        """End the other ranks and shut every worker down; idempotent. A call afterwards
        raises :class:`~agentenv.ClosedResourceError`."""


class _Channel:
    """The call channel: a gloo group of all ranks with no practical timeout (opened by
    every rank, in the same order, after its worker set up torch.distributed). Between
    calls the other ranks wait in a broadcast for as long as rank 0 runs rollouts or
    evaluations; on NCCL's default group its watchdog would end them after 10 minutes."""

    def __init__(self) -> None:
        import datetime

        import torch.distributed as dist

        self._group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj``, on every rank."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self._group)
        return box[0]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the rank gets SIGKILL when rank 0's process dies, whatever killed it."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _use_device(device: int | str) -> None:
    """Make a CUDA rank's device current: calls come on worker threads too, whose current
    device is 0, and collectives and megatron's own allocations use the current one."""
    if isinstance(device, int):
        import torch

        torch.cuda.set_device(device)


class ProcessRanks(Generic[V]):
    """Rank 0 in this process, ranks 1..N-1 in child processes on this machine, calls
    over a gloo channel (:class:`Ranks`).

    Args:
        factory: what every rank builds, ``module:callable`` taking ``(spec,
            rendezvous)`` (a worker class); importable by the followers.
        spec: its first argument (pickled for the followers).
        devices: each rank's device (a CUDA index, or ``cpu``); one rank per entry.
    """

    def __init__(self, factory: str, spec: Any, devices: Sequence[int | str]) -> None:
        self._devices = list(devices)
        self._closed = False
        self._channel: _Channel | None = None
        self._dir: tempfile.TemporaryDirectory[str] | None = None
        self.procs: list[subprocess.Popen[bytes]] = []
        port = free_port()
        if self.world_size > 1:
            self._start_followers(factory, spec, port)
            atexit.register(self.close)
        try:
            _use_device(self._devices[0])
            build = resolve_name(factory, what="rank factory", kind="Class")
            self._local: V = build(spec, Rendezvous(0, self.world_size, self._devices[0], port))
            if self.world_size > 1:
                self._channel = _Channel()
        except BaseException:
            self._abort()
            raise

    def _start_followers(self, factory: str, spec: Any, port: int) -> None:
        self._dir = tempfile.TemporaryDirectory(prefix="agentenv-ranks-")
        path = Path(self._dir.name) / "spec.pkl"
        path.write_bytes(pickle.dumps((factory, spec)))
        for rank in range(1, self.world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
                FOLLOWER_DEVICE: str(self._devices[rank]),
            }
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "trainer.megatron._follower", str(path)],
                    env=env,
                    preexec_fn=_die_with_parent,
                )
            )
        threading.Thread(target=self._watch, daemon=True).start()

    @property
    def world_size(self) -> int:
        return len(self._devices)

    @property
    def local(self) -> V:
        """Rank 0's worker (in this process)."""
        return self._local

    def call(
        self, method: Callable[Concatenate[V, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        name = method.__name__
        if self._closed:
            raise ClosedResourceError(f"cannot call {name}: the ranks were closed")
        _use_device(self._devices[0])
        if self._channel is not None:
            self._channel.broadcast((name, args, kwargs))
        return cast("R", getattr(self._local, name)(*args, **kwargs))

    def exited(self) -> dict[int, int]:
        return {
            rank: code
            for rank, proc in enumerate(self.procs, start=1)
            if (code := proc.poll()) is not None
        }

    def _watch(self) -> None:
        while not self._closed:
            for rank, code in self.exited().items():
                if not self._closed:
                    sys.stderr.write(
                        f"agentenv: megatron rank {rank} exited with status {code}; the "
                        "other ranks cannot go on without it, stopping\n"
                    )
                    sys.stderr.flush()
                    os._exit(1)
            time.sleep(0.5)

    def _abort(self) -> None:
        """Rank 0 failed to start: its followers cannot go on (they would wait for it)."""
        self._closed = True
        for proc in self.procs:
            proc.kill()
            proc.wait()
        if self._dir is not None:
            self._dir.cleanup()

    def close(self, timeout: float = 60.0) -> None:
        """Tell the followers to exit, wait for them, then shut rank 0's worker down."""
        if self._closed:
            return
        try:
            if self._channel is not None:
                self._channel.broadcast((_CLOSE, (), {}))
        finally:
            self._closed = True
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self._dir is not None:
            self._dir.cleanup()
        self._channel = None
        self._local.shutdown()


def follow(path: Path) -> None:
    """A follower's life: build the worker, then run each broadcast call until close."""
    factory, spec = pickle.loads(path.read_bytes())
    raw = os.environ[FOLLOWER_DEVICE]
    device: int | str = int(raw) if raw.isdigit() else raw
    _use_device(device)
    rendezvous = Rendezvous(
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        device,
        int(os.environ["MASTER_PORT"]),
        os.environ["MASTER_ADDR"],
    )
    worker = resolve_name(factory, what="rank factory", kind="Class")(spec, rendezvous)
    channel = _Channel()
    while True:
        name, args, kwargs = channel.broadcast(None)
        if name == _CLOSE:
            break
        try:
            getattr(worker, name)(*args, **kwargs)
        except ConfigError:
            # Bad input is found on every rank before any collective; rank 0 reports it
            # to its caller, and the run may go on.
            continue
    worker.shutdown()
