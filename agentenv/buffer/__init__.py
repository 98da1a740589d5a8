"""The Data Buffer: GRPO groups in, trainer batches out, optionally crash-safe on disk.

See :class:`Buffer`. ``agentenv buffer stats|export|serve`` work on a durable Buffer's
directory (:func:`open_readonly` reads one without taking its lock; :func:`decode_sample`
decodes a stored sample).
"""

from agentenv.buffer._buffer import (
    Batch,
    Buffer,
    BufferStats,
    Group,
    LeaseExpiredError,
    UnknownBatchError,
)
from agentenv.buffer._codec import decode_sample
from agentenv.buffer._config import BufferConfig, FilterResult, GroupFilter, RewardStdFilter
from agentenv.buffer._service import BufferClient, BufferServer, BufferServiceError
from agentenv.buffer._store import BufferLockedError, BufferStoreError, StoreReader, open_readonly

__all__ = [
    "Batch",
    "Buffer",
    "BufferClient",
    "BufferConfig",
    "BufferLockedError",
    "BufferServer",
    "BufferServiceError",
    "BufferStats",
    "BufferStoreError",
    "FilterResult",
    "Group",
    "GroupFilter",
    "LeaseExpiredError",
    "RewardStdFilter",
    "StoreReader",
    "UnknownBatchError",
    "decode_sample",
    "open_readonly",
]
