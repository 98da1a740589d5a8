"""The embedded inference engine: local models, continuous batching, SGLang's HTTP API.

``Engine``, ``EngineServer`` and ``WeightUpdateGroup`` (one rank of the process group that
carries SGLang's distributed weight updates) import torch, so they load on first use:
resolving a model name (``resolve_model``) stays light, and so does importing
``serialize_named_tensors`` / ``load_named_tensors`` (SGLang's ``/update_weights_from_tensor``
payload; they import torch when called), and ``release_freed_memory`` (the C heap's free
pages back to the system between the phases of a CPU run). ``use_torch_threads`` sets
the calling thread's torch thread count for the engine's or the trainer's work, from the
CPUs the process may use (``_threads.py``).
"""

from typing import TYPE_CHECKING, Any

from agentenv.engine._ipc import load_named_tensors, serialize_named_tensors
from agentenv.engine._memory import release_freed_memory
from agentenv.engine._models import SMOLLM2_NAME, cache_dir, resolve_model
from agentenv.engine._threads import use_torch_threads

if TYPE_CHECKING:
    from agentenv.engine._engine import Engine, EngineChunk
    from agentenv.engine._group import WeightUpdateGroup
    from agentenv.engine._server import EngineServer

__all__ = [
    "SMOLLM2_NAME",
    "Engine",
    "EngineChunk",
    "EngineServer",
    "WeightUpdateGroup",
    "cache_dir",
    "load_named_tensors",
    "release_freed_memory",
    "resolve_model",
    "serialize_named_tensors",
    "use_torch_threads",
]


def __getattr__(name: str) -> Any:
    if name in ("Engine", "EngineChunk"):
        from agentenv.engine import _engine

        return getattr(_engine, name)
    if name == "EngineServer":
        from agentenv.engine._server import EngineServer

        return EngineServer
    if name == "WeightUpdateGroup":
        from agentenv.engine._group import WeightUpdateGroup

        return WeightUpdateGroup
    raise AttributeError(f"module 'agentenv.engine' has no attribute {name!r}")
