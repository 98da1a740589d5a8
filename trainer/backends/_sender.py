"""The trainer's end of a weight update: where the weights are read and from where they
leave, kept apart from the protocol that drives it (:mod:`trainer.engines._sync`), so that the
weights leave from the process that holds them -- the backend itself in this process, or
trainer rank 0's actor on Ray (:class:`trainer.distributed.RankSender`) -- and never pass
through the driver.

    sender = backend.weight_sender()
    buckets = sender.prepare(bucket_bytes)      # names, dtypes, shapes of each bucket
    sender.join(address, port, world_size=3, name="g", backend="gloo", timeout=60)
    sender.broadcast(0)                          # bucket 0, to the group's other ranks
    ...
    sender.finish()                              # the snapshot is dropped
    sender.post_tensors(["http://engine:30000"], version="7")  # or: by handle, same host
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol

from agentenv import ConfigError

if TYPE_CHECKING:
    import torch

    from agentenv.engine import WeightUpdateGroup

#: The broadcast's process-group backend.
Transport = Literal["nccl", "gloo"]

__all__ = ["LocalSender", "TensorMeta", "WeightSender", "buckets", "sender_of"]


@dataclasses.dataclass(frozen=True, slots=True)
class TensorMeta:
    """One tensor of a bucket as the servers are told of it."""

    name: str
    dtype: str  # torch's name without ``torch.``: ``bfloat16``
    shape: tuple[int, ...]


class WeightSender(Protocol):
    """The trainer's end of a weight update (blocking calls; the sync runs them in
    threads). Between :meth:`prepare` and :meth:`finish` it holds one snapshot of the
    weights; the group, once joined, lasts until :meth:`destroy` or :meth:`abort`."""

    def prepare(self, bucket_bytes: int, backend: Transport) -> list[list[TensorMeta]]:
        """Snapshot the weights, cut into buckets of about ``bucket_bytes`` for a broadcast
        over ``backend``; the buckets' tensors, in order."""

    def join(
        self, address: str, port: int, *, world_size: int, name: str,
        backend: Literal["nccl", "gloo"], timeout: float,
    ) -> None:  # fmt: skip
        """Form the weight-update group as its rank 0, hosting the rendezvous at
        ``address:port``; blocks until every server joined."""

    def rendezvous(self, address: str) -> tuple[str, int]:
        """Where the servers reach this sender's rendezvous: ``address`` (the configured
        one) where the sender is this process, its own node's address where it is not;
        and a port free there."""

    def broadcast(self, index: int) -> None:
        """Bucket ``index`` of the snapshot to the group's other ranks."""

    def finish(self) -> None:
        """Drop the snapshot."""

    def destroy(self) -> None:
        """Leave the group (waits for the other ranks)."""

    def abort(self) -> None:
        """Leave the group at once (a broadcast waiting in another thread ends)."""

    def post_tensors(self, urls: Sequence[str], version: str, api_key: str | None) -> None:
        """The weights to each server at ``urls`` by handle (SGLang's
        ``/update_weights_from_tensor``): the servers are on this sender's machine (on
        its GPU: CUDA IPC; on CPU: shared memory); returns once every one answered."""


def buckets(
    tensors: Mapping[str, torch.Tensor], limit: int
) -> list[list[tuple[str, torch.Tensor]]]:
    """``tensors`` in order, cut into runs of at most ``limit`` bytes (a larger tensor goes
    alone). A tensor that is a view of one already taken (tied embeddings: ``lm_head.weight``)
    is left out: the servers tie it themselves."""
    out: list[list[tuple[str, torch.Tensor]]] = []
    seen: set[tuple[Any, ...]] = set()
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, t in tensors.items():
        key = (t.device, t.data_ptr(), t.dtype, tuple(t.shape), t.stride())
        if t.numel() and key in seen:
            continue
        seen.add(key)
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > limit:
            out.append(bucket)
            bucket, size = [], 0
        bucket.append((name, t))
        size += nbytes
    if bucket:
        out.append(bucket)
    return out


class LocalSender:
    """A :class:`WeightSender` in the process that holds the weights: ``state_dict()``
    (a backend's) is read at each :meth:`prepare`."""

    def __init__(self, state_dict: Callable[[], Mapping[str, torch.Tensor]]) -> None:
        self._state_dict = state_dict
        self._buckets: list[list[tuple[str, torch.Tensor]]] = []
        self._group: WeightUpdateGroup | None = None

    def prepare(self, bucket_bytes: int, backend: Transport) -> list[list[TensorMeta]]:
        state = self._state_dict()
        if backend == "nccl":
            where = {str(t.device) for t in state.values() if t.device.type != "cuda"}
            if where:
                raise ConfigError(
                    f"the nccl backend broadcasts CUDA tensors, but the trainer's weights are "
                    f"on {', '.join(sorted(where))} (use backend gloo)"
                )
        self._buckets = buckets(state, bucket_bytes)
        return [
            [TensorMeta(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in b]
            for b in self._buckets
        ]

    def rendezvous(self, address: str) -> tuple[str, int]:
        from trainer._resources import free_port

        return address, free_port()

    def join(
        self, address: str, port: int, *, world_size: int, name: str,
        backend: Literal["nccl", "gloo"], timeout: float,
    ) -> None:  # fmt: skip
        from agentenv.engine import WeightUpdateGroup

        self._group = WeightUpdateGroup.join(
            address, port, rank=0, world_size=world_size, name=name, backend=backend,
            timeout=timeout, transfer_timeout=timeout,
        )  # fmt: skip

    def broadcast(self, index: int) -> None:
        group = self._group
        if group is None:
            raise ConfigError("broadcast before join: the weight-update group is not formed")
        tensors = [t for _, t in self._buckets[index]]
        if group.backend == "gloo":
            tensors = [t.detach().to("cpu") for t in tensors]
        group.broadcast([t.detach().contiguous() for t in tensors])

    def finish(self) -> None:
        self._buckets = []

    def destroy(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.destroy()

    def abort(self) -> None:
        group, self._group = self._group, None
        if group is not None:
            group.abort()

    def post_tensors(self, urls: Sequence[str], version: str, api_key: str | None) -> None:
        import anyio

        from agentenv.engine import serialize_named_tensors

        state = self._state_dict()
        if not state:  # a rank that holds none of the weights (megatron's others)
            return
        tensors = [(n, t) for b in buckets(state, 1 << 62) for n, t in b]
        payload = serialize_named_tensors(tensors)
        # A thread of its own (the sync's worker thread, or a rank actor's): its own loop.
        anyio.run(_post_payload, list(urls), payload, version, api_key)
        del tensors, state  # the servers have copied them


async def _post_payload(urls: list[str], payload: str, version: str, api_key: str | None) -> None:
    from agentenv.sglang import SGLangClient

    for url in urls:  # the client raises the server's refusal (SGLangError)
        async with SGLangClient(url, api_key=api_key, retries=0, timeout=600.0) as client:
            await client.update_weights_from_tensor([payload], weight_version=version)


def sender_of(backend: Any) -> WeightSender:
    """``backend``'s weight sender; a duck-typed backend's is its ``state_dict``, read
    in this process."""
    own = getattr(backend, "weight_sender", None)
    return own() if own is not None else LocalSender(backend.state_dict)
