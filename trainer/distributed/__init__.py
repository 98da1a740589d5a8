"""A run across machines on Ray: the rollout engines as actors behind SGLang's router.

See docs/distributed.md. Needs ``ray`` (the ``distributed`` extra) and ``sglang-router``.
"""

from trainer.distributed._engine_actor import EngineInfo, EngineSpec
from trainer.distributed._engine_config import engine_spec
from trainer.distributed._engine_group import (
    EngineGroup,
    EngineGroupError,
    EngineSlot,
    EngineStatistics,
    GroupSync,
)

__all__ = [
    "EngineGroup",
    "EngineGroupError",
    "EngineInfo",
    "EngineSlot",
    "EngineSpec",
    "EngineStatistics",
    "GroupSync",
    "engine_spec",
]
