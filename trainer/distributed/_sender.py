"""Weights that leave from a trainer rank's actor: :class:`RankSender`, the
:class:`~trainer.backends._sender.WeightSender` of a backend whose ranks are Ray actors. Every call
runs in the rank's actor (:meth:`RankGroup.weights`), so a broadcast goes from the rank's
GPU to the engines and a handover by handle from the rank to the engines on its GPU; the
driver only says what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from trainer.backends import TensorMeta, Transport
from trainer.distributed._ranks import RankGroup

__all__ = ["RankSender"]


class RankSender:
    """Rank ``rank``'s weight sender. ``collective``: reading the weights is a collective
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
