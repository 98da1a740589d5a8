"""The Data Buffer: GRPO groups in, trainer batches out, optionally crash-safe on disk.

See :class:`Buffer`. ``agentenv buffer stats|export|serve`` work on a durable Buffer's
directory.
"""

from agentenv.buffer._buffer import (
    Batch,
    Buffer,
    BufferStats,
    Group,
    LeaseExpiredError,
    UnknownBatchError,
)
from agentenv.buffer._config import BufferConfig, FilterResult, GroupFilter, RewardStdFilter
from agentenv.buffer._service import BufferClient, BufferServer, BufferServiceError
from agentenv.buffer._store import BufferLockedError, BufferStoreError

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
    "UnknownBatchError",
]
