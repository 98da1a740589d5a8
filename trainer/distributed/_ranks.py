"""Trainer ranks behind one seam (:class:`Ranks`): as Ray actors (:class:`RankGroup`),
one actor per rank, each in its bundle of the placement, each building a *worker* (its
share of the model) and running the calls fanned out to all of them, the weights leaving
from a rank's actor (:class:`RankSender`); or one rank in this process (:class:`LocalRanks`).

    group = RankGroup(TorchRank, spec, placed)      # rank r in placed.trainer[r]
    metrics = group.call(TorchRank.train_step, batch, advantages)   # every rank; rank 0's
    group.close()

Rank 0 publishes its node's address and a free port; every rank then initialises
torch.distributed from them (the worker does, from its :class:`Rendezvous`: NCCL on GPUs,
gloo on CPU). A rank that dies, or fails in a way the others cannot follow, stops the
group at once (the others would wait in a collective): :class:`TrainerRankError` names
the rank and its node, and every actor is ended. A :class:`~agentenv.ConfigError` (bad
input, found by every rank before any collective) reaches the caller and the ranks go on.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar, cast

from agentenv import AgentEnvError, ClosedResourceError, ConfigError
from trainer.distributed._cluster import node_address

if TYPE_CHECKING:
    from trainer.backends import TensorMeta, Transport
    from trainer.distributed._placement import Bundle, Placed

__all__ = [
    "LocalRanks",
    "RankGroup",
    "RankSender",
    "Ranks",
    "Rendezvous",
    "TrainerRankError",
    "Worker",
]

P = ParamSpec("P")
#: Seconds the other ranks of a failed call get to be reported dead by Ray: a rank whose
#: peer died fails at once, and the rank that died is then named as the cause. A rank that
#: failed alone (its peers wait in a collective for it) stops the group this much later.
PEER_GRACE_S = 30.0
R = TypeVar("R")


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

    @property
    def backend(self) -> str:
        """torch.distributed's backend for the device: ``nccl`` on CUDA, else ``gloo``."""
        return "nccl" if isinstance(self.device, int) else "gloo"


class Worker(Protocol):
    """A rank's share of the work: built by ``factory(spec, rendezvous)`` on every rank,
    its methods run by :meth:`Ranks.call`, and :meth:`shutdown` at the end."""

    def shutdown(self) -> None:
        """This rank's part of closing (process groups it set up)."""


W = TypeVar("W", bound=Worker, covariant=True)
V = TypeVar("V", bound=Worker)


class Ranks(Protocol[W]):
    """Every rank's worker, driven from this process (the seam between a backend and
    where its ranks run). A launcher starts them; the caller then only calls, watches
    and closes."""

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


class TrainerRankError(AgentEnvError, RuntimeError):
    """A trainer rank died or failed mid-collective: the group stopped (resume the run
    from its last checkpoint with ``--load``)."""

    def __init__(self, rank: int, where: str, what: str) -> None:
        super().__init__(
            f"trainer rank {rank} on {where} {what}; the other ranks cannot go on without "
            "it, so the run stops (resume it from its last checkpoint with --load)"
        )
        self.rank = rank
        self.where = where


class RankActor:
    """The body of a rank's Ray actor: its place, then its worker and the calls."""

    def __init__(self) -> None:
        self.worker: Any = None
        self.sender: Any = None  # the rank's weight sender, made at its first use

    def address(self) -> tuple[str, int]:
        """This node's address and a port free on it (rank 0 publishes these)."""
        from trainer._resources import free_port

        return node_address(), free_port()

    def start(self, factory: Callable[[Any, Rendezvous], Any], spec: Any, rdv: Rendezvous) -> None:
        if isinstance(rdv.device, int):
            import torch

            torch.cuda.set_device(rdv.device)
        self.worker = factory(spec, rdv)

    def run(self, method: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """A method of a class (``Worker.step``) runs as the worker's own method of that
        name (its class's override, as a call on the worker would); any other function
        is called with the worker first."""
        name = method.__name__
        if method.__qualname__.endswith("." + name) and "<locals>" not in method.__qualname__:
            return getattr(self.worker, name)(*args, **kwargs)
        return method(self.worker, *args, **kwargs)

    def weights(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """One call of this rank's weight sender (:class:`trainer.backends._sender.LocalSender`
        over the worker's ``state_dict``): the weights leave from here. ``rendezvous``:
        this node's address and a free port."""
        if op == "rendezvous":
            return self.address()
        if self.sender is None:
            from trainer.backends import LocalSender

            self.sender = LocalSender(self.worker.state_dict)
        return getattr(self.sender, op)(*args, **kwargs)

    def pid(self) -> int:
        import os

        return os.getpid()

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None


class RankGroup(Generic[V]):
    """One Ray actor per trainer rank of ``placed`` (:class:`Ranks`).

    Args:
        factory: what every rank builds, ``factory(spec, rendezvous)`` (a worker class).
        spec: its first argument (sent to every actor).
        placed: the reserved placement; rank r runs in ``placed.trainer[r]``.
        device: ``cuda`` (each rank on its bundle's GPU, NCCL) or ``cpu`` (gloo); default
            ``cuda`` when the bundles hold GPUs.
        start_timeout: seconds the ranks have to build their workers.
        release: give the placement back on :meth:`close` (the group's own placement).
    """

    def __init__(
        self,
        factory: Callable[[Any, Rendezvous], V],
        spec: Any,
        placed: Placed,
        *,
        device: str | None = None,
        start_timeout: float = 600.0,
        release: bool = False,
    ) -> None:
        import ray

        self._ray: Any = ray
        self._closed = False
        self._placed = placed if release else None
        kind = device or ("cuda" if placed.placement.gpus else "cpu")
        self.bundles: tuple[Bundle, ...] = placed.trainer
        remote: Any = ray.remote(RankActor)
        # Two threads: a weight broadcast waiting on a server can be aborted by a second
        # call (the driver makes one call at a time otherwise).
        self.actors: list[Any] = [
            remote.options(max_concurrency=2, **placed.actor_options(b)).remote()
            for b in self.bundles
        ]
        try:
            host, port = ray.get(self.actors[0].address.remote(), timeout=start_timeout)
            # Ray sets each GPU rank's CUDA_VISIBLE_DEVICES to its GPU: cuda:0 in the actor.
            rank_device: int | str = 0 if kind == "cuda" else "cpu"
            n = len(self.actors)
            self._wait(
                [
                    a.start.remote(factory, spec, Rendezvous(r, n, rank_device, port, host))
                    for r, a in enumerate(self.actors)
                ],
                timeout=start_timeout,
                doing="starting",
            )
        except BaseException:
            self._kill()
            raise

    @property
    def world_size(self) -> int:
        return len(self.actors)

    @property
    def local(self) -> None:
        """No rank runs in this process."""
        return None

    def where(self, rank: int) -> str:
        """Rank ``rank``'s node (and GPU), for messages."""
        return self.bundles[rank].where

    def call(
        self, method: Callable[Concatenate[V, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """``method`` on every rank with the same arguments; rank 0's result."""
        return self.call_each(method, [(args, dict(kwargs))] * self.world_size)[0]

    def call_each(
        self,
        method: Callable[..., R],
        per_rank: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
        *,
        timeout: float | None = None,
    ) -> list[R]:
        """``method`` on every rank, rank r with ``per_rank[r]``'s ``(args, kwargs)``;
        every rank's result, in rank order."""
        name = method.__name__
        if self._closed:
            raise ClosedResourceError(f"cannot call {name}: the trainer ranks were closed")
        refs = [
            a.run.remote(method, args, kwargs)
            for a, (args, kwargs) in zip(self.actors, per_rank, strict=True)
        ]
        return self._wait(refs, timeout=timeout, doing=f"running {name}")

    def weights(self, op: str, *args: Any, on: Sequence[int] = (0,), **kwargs: Any) -> Any:
        """``op(*args, **kwargs)`` of the weight sender of each rank of ``on``
        (:meth:`RankActor.weights`);
        the first's result. The sender's own errors (a server that refused the weights,
        a broadcast that timed out) are raised as they are and leave the ranks running;
        a rank that died stops the group."""
        from ray.exceptions import RayActorError, RayTaskError

        if self._closed:
            raise ClosedResourceError(f"cannot send the weights ({op}): the ranks were closed")
        refs = [self.actors[r].weights.remote(op, args, kwargs) for r in on]
        out = []
        for rank, ref in zip(on, refs, strict=True):
            try:
                out.append(self._ray.get(ref))
            except RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else e
                raise cause from None
            except RayActorError as e:
                self._kill()
                raise TrainerRankError(
                    rank, self.where(rank), f"died sending the weights ({type(e).__name__})"
                ) from None
        return out[0] if out else None

    def _wait(self, refs: list[Any], *, timeout: float | None, doing: str) -> list[Any]:
        """Every result; the first rank to fail decides: bad input (every rank's
        :class:`ConfigError`) is raised as it is, anything else stops the group."""
        ray = self._ray
        from ray.exceptions import RayActorError, RayTaskError

        rank_of = {ref: r for r, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=timeout)
            if not done:
                self._kill()
                raise TrainerRankError(
                    rank_of[pending[0]], self.where(rank_of[pending[0]]),
                    f"did not finish {doing} within {timeout:g} s",
                )  # fmt: skip
            ref = done[0]
            rank = rank_of[ref]
            try:
                ray.get(ref)
            except RayTaskError as e:
                cause = e.cause if isinstance(e.cause, BaseException) else None
                if isinstance(cause, ConfigError):
                    ray.wait(pending, num_returns=len(pending), timeout=timeout)
                    raise cause from None
                # A rank whose peer died fails its collective at once (gloo: the connection
                # closed), often before Ray reports the death: the rank that died is the
                # cause, so the others get a grace to be reported dead.
                dead = self._dead_among(pending, rank_of)
                self._kill()
                failure = f"{type(cause).__name__}: {cause}"
                if dead is not None:
                    raise TrainerRankError(
                        dead, self.where(dead),
                        f"died {doing} (rank {rank} failed with it: {failure})",
                    ) from None  # fmt: skip
                raise TrainerRankError(
                    rank, self.where(rank), f"failed {doing}: {failure}"
                ) from cause
            except RayActorError as e:
                self._kill()
                raise TrainerRankError(
                    rank, self.where(rank), f"died {doing} ({type(e).__name__})"
                ) from None
        return cast("list[Any]", ray.get(refs))

    def _dead_among(self, refs: list[Any], rank_of: dict[Any, int]) -> int | None:
        """The first rank of ``refs`` (calls still running) whose actor Ray reports dead
        within :data:`PEER_GRACE_S`; ``None`` if none."""
        from ray.exceptions import RayActorError

        ray = self._ray
        done, _ = ray.wait(refs, num_returns=len(refs), timeout=PEER_GRACE_S) if refs else ([], [])
        for ref in done:
            try:
                ray.get(ref)
            except RayActorError:
                return rank_of[ref]
            except Exception:  # failed in its collective too: not dead
                continue
        return None

    def exited(self) -> dict[int, int]:
        """The ranks whose actor is gone (status -1: Ray reports that an actor died, not
        an exit code)."""
        ray = self._ray
        from ray.exceptions import GetTimeoutError, RayActorError

        gone: dict[int, int] = {}
        for rank, actor in enumerate(self.actors):
            try:
                ray.get(actor.pid.remote(), timeout=10)
            except (RayActorError, GetTimeoutError):
                gone[rank] = -1
        return gone

    def _kill(self) -> None:
        self._closed = True
        for actor in self.actors:
            self._ray.kill(actor, no_restart=True)
        if self._placed is not None:
            self._placed.release()
            self._placed = None

    def close(self, timeout: float = 60.0) -> None:
        """Shut every worker down, then end the actors; idempotent."""
        if self._closed:
            return
        self._closed = True
        from ray.exceptions import GetTimeoutError, RayActorError

        with contextlib.suppress(RayActorError, GetTimeoutError):
            self._ray.get([a.shutdown.remote() for a in self.actors], timeout=timeout)
        self._kill()


class RankSender:
    """Rank ``rank``'s :class:`~trainer.backends.WeightSender`: every call runs in its actor
    (:meth:`RankGroup.weights`), so the weights leave from the rank's GPU, never through
    the driver. ``collective``: reading the weights is a collective
    of every rank (megatron gathers its shards to rank 0), so :meth:`prepare` runs on all
    of them and the others' share is empty; otherwise only this rank reads them (the torch
    backend's data-parallel ranks each hold all the weights)."""

    def __init__(self, ranks: RankGroup[Any], rank: int = 0, *, collective: bool = False) -> None:
        self.ranks = ranks
        self.rank = rank
        self.collective = collective

    def _call(self, op: str, *args: Any, every: bool = False, **kwargs: Any) -> Any:
        others = [r for r in range(self.ranks.world_size) if r != self.rank] if every else []
        return self.ranks.weights(op, *args, on=[self.rank, *others], **kwargs)

    def prepare(self, bucket_bytes: int, backend: Transport) -> list[list[TensorMeta]]:
        out: list[list[TensorMeta]] = self._call(
            "prepare", bucket_bytes, backend, every=self.collective
        )
        return out

    def rendezvous(self, address: str) -> tuple[str, int]:
        host, port = self._call("rendezvous")
        return str(host), int(port)

    def join(
        self, address: str, port: int, *, world_size: int, name: str, backend: Transport,
        timeout: float,
    ) -> None:  # fmt: skip
        self._call(
            "join", address, port, world_size=world_size, name=name, backend=backend,
            timeout=timeout,
        )  # fmt: skip

    def broadcast(self, index: int) -> None:
        self._call("broadcast", index)

    def finish(self) -> None:
        self._call("finish")

    def destroy(self) -> None:
        self._call("destroy")

    def abort(self) -> None:
        self._call("abort")

    def post_tensors(self, urls: Sequence[str], version: str, api_key: str | None) -> None:
        self._call("post_tensors", list(urls), version, api_key, every=self.collective)


class LocalRanks(Generic[V]):
    """One rank, in this process (:class:`Ranks`): ``factory(spec, rendezvous)`` on
    ``device`` (a CUDA index, or ``cpu``), a world of one."""

    def __init__(
        self, factory: Callable[[Any, Rendezvous], V], spec: Any, device: int | str
    ) -> None:
        from trainer._resources import free_port

        self._closed = False
        self._local: V = factory(spec, Rendezvous(0, 1, device, free_port()))

    @property
    def world_size(self) -> int:
        return 1

    @property
    def local(self) -> V:
        """The rank's worker (in this process)."""
        return self._local

    def call(
        self, method: Callable[Concatenate[V, P], R], /, *args: P.args, **kwargs: P.kwargs
    ) -> R:
        if self._closed:
            raise ClosedResourceError(f"cannot call {method.__name__}: the ranks were closed")
        return method(self._local, *args, **kwargs)

    def exited(self) -> dict[int, int]:
        return {}

    def close(self) -> None:
        """Shut the worker down; idempotent."""
        if not self._closed:
            self._closed = True
            self._local.shutdown()
