"""The megatron backend's own errors (both under :class:`agentenv.AgentEnvError`)::

AgentEnvError
├── ConfigError
│   └── WeightShapeError         a checkpoint tensor's shape does not fit the model config
└── MegatronNotInstalledError    megatron-core is not importable (also an ImportError)
"""

from __future__ import annotations

from collections.abc import Sequence

from agentenv import AgentEnvError, ConfigError

__all__ = ["EXTRA", "MegatronNotInstalledError", "WeightShapeError"]

#: The optional-dependency group that installs megatron-core.
EXTRA = "megatron"


class MegatronNotInstalledError(AgentEnvError, ImportError):
    """megatron-core cannot be imported; the message names the extra that installs it."""

    def __init__(self, cause: BaseException | None = None) -> None:
        why = f" ({type(cause).__name__}: {cause})" if cause is not None else ""
        super().__init__(
            f"the megatron backend needs megatron-core, which could not be imported{why}; "
            f"install it with `pip install 'agentenv[{EXTRA}]'` (megatron-core 0.19.2, "
            "Python >= 3.12, with triton for its pipeline schedules)"
        )


class WeightShapeError(ConfigError):
    """A tensor of a checkpoint does not have the shape the model config implies.

    Attributes:
        name: the tensor's name in its state dict.
        shape: its shape.
        expected: the shape the config implies.
    """

    def __init__(self, name: str, shape: Sequence[int], expected: Sequence[int], why: str) -> None:
        self.name = name
        self.shape = tuple(shape)
        self.expected = tuple(expected)
        super().__init__(
            f"tensor {name!r} has shape {self.shape}, expected {self.expected} ({why}); "
            "the checkpoint is not of the model its config describes"
        )
