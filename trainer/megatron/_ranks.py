"""Rank management for the megatron backend: the :class:`Ranks` seam
(:mod:`trainer.distributed`'s) and its two launchers. One GPU: the rank runs in this
process (:class:`LocalRanks`, no Ray). More: one Ray actor per rank
(:class:`trainer.distributed.RankGroup`), on a placement of the run's
(:func:`ray_launcher`) or, by default, one of ``num_gpus`` GPUs on the cluster Ray finds
(a running one, else a new one on this machine).

    ranks = LocalRanks(MegatronWorker, options, device=0)
    result = ranks.call(MegatronWorker.train_step, samples, advantages)
    ranks.close()
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Concatenate, Generic, ParamSpec, TypeVar

from agentenv import ClosedResourceError
from trainer._resources import free_port
from trainer.distributed import Ranks, Rendezvous, Worker

__all__ = ["LocalRanks", "Ranks", "Rendezvous", "Worker"]

P = ParamSpec("P")
R = TypeVar("R")
V = TypeVar("V", bound=Worker)


class LocalRanks(Generic[V]):
    """One rank, in this process (:class:`Ranks`): ``factory(spec, rendezvous)`` on
    ``device`` (a CUDA index, or ``cpu``), a world of one."""

    def __init__(
        self, factory: Callable[[Any, Rendezvous], V], spec: Any, device: int | str
    ) -> None:
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
