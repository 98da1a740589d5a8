"""One trainer on several GPUs: the calling process drives, one follower process per
other GPU joins every collective call.

The process that builds a :class:`~trainer.megatron.MegatronBackend` with ``num_gpus > 1``
is rank 0 (the *driver*): it runs the training loop as with one GPU. It starts ranks
1..N-1 itself (no ``torchrun`` needed), each a ``python -m trainer.megatron._follower``
process that builds the same backend on its own GPU and then waits for calls. Every
public method of the backend that needs all ranks (a training step, log-probs, weight
export, checkpoints) is *collective*: on the driver it first broadcasts its name and
arguments, then all ranks run it together; the driver gets the result.

A follower that dies takes the run down at once (the driver would otherwise wait in a
collective forever): a watchdog thread in the driver reports its exit status and ends the
driver's process.
"""

from __future__ import annotations

import contextlib
import functools
import os
import pickle
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from agentenv import ConfigError

__all__ = ["FOLLOWER_DEVICE", "Followers", "collective", "follow", "open_channel"]

F = TypeVar("F", bound=Callable[..., Any])

_CLOSE = "__close__"

#: Set in a follower's environment: its CUDA device index (and that it is not rank 0).
FOLLOWER_DEVICE = "AGENTENV_MEGATRON_DEVICE"


def collective(method: F) -> F:
    """Marks a backend method that every rank runs: the driver broadcasts the call first
    (unless it is already inside a collective call)."""

    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Calls come on worker threads too, whose current CUDA device is 0: collectives and
        # megatron's own allocations use the current device.
        if self.device.type == "cuda":
            import torch

            torch.cuda.set_device(self.device)
        followers: Followers | None = getattr(self, "followers", None)
        if followers is None or followers.inside:
            return method(self, *args, **kwargs)
        followers.broadcast((method.__name__, args, kwargs))
        followers.inside = True
        try:
            return method(self, *args, **kwargs)
        finally:
            followers.inside = False

    return call  # type: ignore[return-value]


_channel: Any = None  # the gloo group the calls travel on (see open_channel)


def open_channel() -> None:
    """The call channel: a gloo group of all ranks with no practical timeout (called by
    every rank after ``init_process_group``). Between calls the other ranks wait in a
    broadcast for as long as rank 0 runs rollouts or evaluations; on NCCL's default group
    its watchdog would end them after 10 minutes."""
    global _channel
    import datetime

    import torch.distributed as dist

    if _channel is None and dist.get_world_size() > 1:
        _channel = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=365))


def _broadcast_object(obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=_channel)
    return box[0]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the rank gets SIGKILL when rank 0's process dies, whatever killed it."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Followers:
    """The follower processes of a driver (rank 0) and the call channel to them.

    Args:
        world_size: ranks in all (GPUs), the driver included.
        factory: what each follower builds, ``module:callable`` (the backend's class).
        backend_kwargs: its keyword arguments (pickled for the followers).
        devices: each rank's device (a CUDA index, or ``cpu``).
        master_port: the rendezvous port (the driver's default process group uses it too).
    """

    def __init__(
        self,
        world_size: int,
        factory: str,
        backend_kwargs: dict[str, Any],
        devices: Sequence[int | str],
        master_port: int,
    ) -> None:
        self.world_size = world_size
        self.inside = False
        self._closed = False
        self._dir = tempfile.TemporaryDirectory(prefix="agentenv-ranks-")
        spec = Path(self._dir.name) / "backend.pkl"
        spec.write_bytes(pickle.dumps((factory, backend_kwargs)))
        self.procs: list[subprocess.Popen[bytes]] = []
        for rank in range(1, world_size):
            env = {
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": str(world_size),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(master_port),
                FOLLOWER_DEVICE: str(devices[rank]),
            }
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, "-m", "trainer.megatron._follower", str(spec)],
                    env=env,
                    preexec_fn=_die_with_parent,
                )
            )
        self._watchdog = threading.Thread(target=self._watch, daemon=True)
        self._watchdog.start()

    def _watch(self) -> None:
        while not self._closed:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._closed:
                    sys.stderr.write(
                        f"agentenv: megatron rank {rank} exited with status {code}; the "
                        "other ranks cannot go on without it, stopping\n"
                    )
                    sys.stderr.flush()
                    os._exit(1)
            time.sleep(0.5)

    def broadcast(self, call: tuple[str, tuple[Any, ...], dict[str, Any]]) -> None:
        if self._closed:
            raise RuntimeError("the megatron backend was closed")
        _broadcast_object(call)

    def close(self, timeout: float = 60.0) -> None:
        """Tell the followers to exit and wait for them."""
        if self._closed:
            return
        try:
            _broadcast_object((_CLOSE, (), {}))
        finally:
            self._closed = True
        for proc in self.procs:
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
        self._dir.cleanup()


def follow(spec: Path) -> None:
    """A follower's life: build the backend, then run each broadcast call until close."""
    import torch

    from agentenv import resolve_name

    factory, kwargs = pickle.loads(spec.read_bytes())
    device = os.environ[FOLLOWER_DEVICE]
    if device.isdigit():
        torch.cuda.set_device(int(device))
    backend = resolve_name(factory, what="backend factory", kind="Class")(**kwargs)
    while True:
        name, args, call_kwargs = _broadcast_object(None)
        if name == _CLOSE:
            break
        try:
            getattr(backend, name)(*args, **call_kwargs)
        except ConfigError:
            # Bad input is found on every rank before any collective; rank 0 reports it
            # to its caller, and the run may go on.
            continue
    backend.shutdown()
