"""The loop's seam to the engines that play the episodes (:class:`RolloutEngine`: the
embedded engine, SGLang or ``agentenv serve`` servers), how the trainer's weights reach
them (:class:`WeightSync`) and how they give their memory back while a step trains
(:class:`OffloadHooks`). Engine actors on Ray are :mod:`trainer.distributed`.
"""

from trainer.engines._engines import EmbeddedEngine, OffloadHooks, RolloutEngine, ServerEngine
from trainer.engines._sync import DiskSync, DistributedSync, InProcessSync, TensorSync, WeightSync

__all__ = [
    "DiskSync",
    "DistributedSync",
    "EmbeddedEngine",
    "InProcessSync",
    "OffloadHooks",
    "RolloutEngine",
    "ServerEngine",
    "TensorSync",
    "WeightSync",
]
