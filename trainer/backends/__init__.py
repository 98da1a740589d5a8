"""The trainer backends and what they share: the :class:`Backend` interface and the GRPO
step over micro-batches, the torch backend (:class:`TorchBackend`) with its numerics and
data parallelism, the weights' sending end of a weight update, and checkpoints written in
the background. The megatron-core backend is :mod:`trainer.megatron`.
"""

from trainer.backends._backend import (
    Backend,
    Item,
    RanksBackend,
    StepCore,
    StepPlan,
    Tally,
    check_temperature,
    pad,
    response_positions,
    to_items,
)
from trainer.backends._checkpoints import (
    CheckpointWriter,
    checkpoint_meta,
    checkpoint_step,
    link_model,
)
from trainer.backends._data_parallel import DataParallel
from trainer.backends._precision import PRECISIONS, Precision, resolve_precision
from trainer.backends._sender import LocalSender, TensorMeta, Transport, WeightSender, sender_of
from trainer.backends._torch import TorchBackend

__all__ = [
    "PRECISIONS",
    "Backend",
    "CheckpointWriter",
    "DataParallel",
    "Item",
    "LocalSender",
    "Precision",
    "RanksBackend",
    "StepCore",
    "StepPlan",
    "Tally",
    "TensorMeta",
    "TorchBackend",
    "Transport",
    "WeightSender",
    "check_temperature",
    "checkpoint_meta",
    "checkpoint_step",
    "link_model",
    "pad",
    "resolve_precision",
    "response_positions",
    "sender_of",
    "to_items",
]
