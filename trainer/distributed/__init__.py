"""One training run across many GPUs and machines, on Ray: where the trainer ranks and
the engines run (:class:`Placement`, slime's flags), the trainer ranks as Ray actors
(:class:`RankGroup`, the :class:`Ranks` a megatron backend runs on; :class:`LocalRanks`
for one rank in this process), the torch
backend's data-parallel ranks behind the :class:`~trainer.Backend` interface
(:class:`TrainerGroup`), and the rollout engines as Ray actors behind SGLang's router
(:class:`EngineGroup`).

    ray = connect(config.placement.ray_address)
    placed = Placement.from_config(config).place(ray, timeout=config.placement.placement_timeout)
    backend = TrainerGroup.start(placed, "smollm2-135m", optim=..., loss=...)

Importing this package imports neither Ray nor torch's distributed machinery; a run
without placement flags never gets here (``trainer.run._setup.build_backend``). See
docs/distributed.md; needs the ``distributed`` extra (``ray``, ``sglang-router``).
"""

import typing

from trainer import _lazy
from trainer.distributed._cluster import connect, node_address
from trainer.distributed._engine_actor import EngineInfo, EngineSpec
from trainer.distributed._engine_group import (
    EngineGroup,
    EngineGroupError,
    EngineHooks,
    EngineSlot,
    EngineStatistics,
    GroupSync,
)
from trainer.distributed._placement import Bundle, Placed, Placement, PlacementTimeoutError
from trainer.distributed._ranks import (
    LocalRanks,
    RankGroup,
    Ranks,
    RankSender,
    Rendezvous,
    TrainerRankError,
    Worker,
)
from trainer.distributed._workers import (
    PlayResult,
    RolloutWorkers,
    WorkerSpec,
    check_worker_room,
)

if typing.TYPE_CHECKING:
    from trainer.distributed._trainer import TorchRank, TrainerGroup

__all__ = [
    "Bundle",
    "EngineGroup",
    "EngineGroupError",
    "EngineHooks",
    "EngineInfo",
    "EngineSlot",
    "EngineSpec",
    "EngineStatistics",
    "GroupSync",
    "LocalRanks",
    "Placed",
    "Placement",
    "PlacementTimeoutError",
    "PlayResult",
    "RankGroup",
    "RankSender",
    "Ranks",
    "Rendezvous",
    "RolloutWorkers",
    "TorchRank",
    "TrainerGroup",
    "TrainerRankError",
    "Worker",
    "WorkerSpec",
    "check_worker_room",
    "connect",
    "node_address",
]


# The torch backend's ranks import torch and transformers: only when asked for.
__getattr__, __dir__ = _lazy.lazy_names(
    __name__, ("TorchRank", "TrainerGroup"), ("trainer.distributed._trainer",)
)
