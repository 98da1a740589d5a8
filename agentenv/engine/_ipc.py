"""Tensors handed from one process to another on the same machine, in SGLang's
``/update_weights_from_tensor`` format: a list of ``(name, tensor)`` pairs pickled with
torch's multiprocessing reductions and base64-encoded. The payload holds no tensor data,
only handles to it: a CUDA IPC handle for a tensor on a GPU (the receiver maps the
sender's memory on the same GPU, no copy), a shared-memory file name for a tensor on CPU.
The sender keeps the tensors alive until the receiver answers.

    payload = serialize_named_tensors(model.state_dict().items())   # the sender
    tensors = load_named_tensors(payload)                            # the receiver

Loading refuses any pickle that names something other than torch's tensor and storage
rebuilders, dtypes and sizes: a payload is data, never code to run.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
from collections.abc import Iterable
from typing import Any

from agentenv._errors import ConfigError

__all__ = ["load_named_tensors", "serialize_named_tensors"]

_REDUCTIONS = "torch.multiprocessing.reductions"
#: What a payload may name: torch's rebuilders of shared tensors and storages.
_REBUILDERS = frozenset(
    {
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
    }
)
_TORCH_CLASSES = frozenset({"Tensor", "Size", "UntypedStorage", "TypedStorage", "device"})


def serialize_named_tensors(tensors: Iterable[tuple[str, Any]]) -> str:
    """``(name, tensor)`` pairs as one base64 payload (handles, not data: the tensors
    must stay alive until the receiver has loaded them). Tensors on CPU are shared
    through named shared-memory files (torch's ``file_system`` strategy, which a process
    that is not this one's child can open)."""
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import init_reductions

    pairs = [(str(name), t.detach()) for name, t in tensors]
    strategy = mp.get_sharing_strategy()  # type: ignore[no-untyped-call]
    if any(t.device.type == "cpu" for _, t in pairs) and strategy != "file_system":
        mp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    init_reductions()  # type: ignore[no-untyped-call]
    from multiprocessing.reduction import ForkingPickler

    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{name!r} is a {type(t).__name__}, not a tensor")
    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(pairs)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        allowed = (
            (module == _REDUCTIONS and name in _REBUILDERS)
            or (module == "torch" and name in _TORCH_CLASSES)
            or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
            or (module == "torch.storage" and name in _TORCH_CLASSES)
        )
        if not allowed:
            raise ConfigError(
                f"the payload names {module}.{name}; a tensor payload may only name torch's "
                "tensor and storage rebuilders (serialize it with torch's multiprocessing "
                "reductions: ForkingPickler over (name, tensor) pairs)"
            )
        return super().find_class(module, name)


def load_named_tensors(payload: str) -> dict[str, Any]:
    """A payload of :func:`serialize_named_tensors` (or SGLang's
    ``MultiprocessingSerializer``) as ``{name: tensor}``, mapped from the sender's memory.
    Raises :class:`~agentenv.ConfigError` for anything that is not such a payload."""
    import torch
    from torch.multiprocessing.reductions import init_reductions

    init_reductions()  # type: ignore[no-untyped-call]
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ConfigError(f"the payload is not base64: {e}") from None
    try:
        pairs = _Restricted(io.BytesIO(raw)).load()
    except ConfigError:
        raise
    except Exception as e:  # truncated, foreign, or the sender's memory is gone
        raise ConfigError(f"the payload could not be loaded: {type(e).__name__}: {e}") from None
    if isinstance(pairs, dict):
        pairs = list(pairs.items())
    if not isinstance(pairs, list | tuple):
        raise ConfigError(f"the payload must hold (name, tensor) pairs, got {type(pairs).__name__}")
    out: dict[str, Any] = {}
    for i, pair in enumerate(pairs):
        if not (isinstance(pair, tuple | list) and len(pair) == 2):
            raise ConfigError(f"entry {i} of the payload is not a (name, tensor) pair")
        name, tensor = pair
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise ConfigError(
                f"entry {i} of the payload is ({type(name).__name__}, "
                f"{type(tensor).__name__}), not (str, tensor)"
            )
        if name in out:
            raise ConfigError(f"the payload names {name!r} twice")
        out[name] = tensor
    return out
