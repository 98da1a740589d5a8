"""Tensors handed from one process to another on the same machine, in SGLang's
``/update_weights_from_tensor`` format: a list of ``(name, tensor)`` pairs pickled with
torch's multiprocessing reductions and base64-encoded. The payload holds handles, not data
(a CUDA IPC handle for a tensor on a GPU, a shared-memory file name for one on CPU); the
sender keeps the tensors alive until the receiver answers.

    payload = serialize_named_tensors(model.state_dict().items())   # the sender
    tensors = load_named_tensors(payload)                            # the receiver

A payload is data, never code: it is described (the unpickler's globals are inert
stand-ins that only record torch's rebuild calls), checked (the shapes torch's reductions
produce, every element inside its storage) and only then materialised (CPU tensors read
with ``pread`` from ``/dev/shm``, never mapped; CUDA ones by torch's
``rebuild_cuda_tensor``), all or nothing; the whole rule is in docs/inference.md, "Weight
updates".
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import io
import math
import os
import pickle
import re
import stat
import sys
import threading
from collections.abc import Iterable
from typing import Any

from agentenv._errors import ConfigError, short_repr

__all__ = [
    "TensorPayload",
    "describe_named_tensors",
    "load_named_tensors",
    "open_regular",
    "read_bytes",
    "serialize_named_tensors",
]

_REDUCTIONS = "torch.multiprocessing.reductions"
#: Where shm_open's names live (Linux).
SHM_DIR = "/dev/shm"
#: torch's shared-memory names: ``/torch_<pid>_<random>_<counter>``.
_SHM_NAME = re.compile(rb"/torch_[0-9]{1,20}(?:_[0-9]{1,20}){1,3}")
#: Bytes before the data in torch's shared-memory files (a reference count; torch's
#: ``map_alloc_alignment``).
SHM_HEADER = 64
#: torch's CUDA IPC reference-counter files: this many int64 counters.
_CUDA_REF_COUNTERS = 10000
_FLOATS = ("float32", "bfloat16", "float16", "float64")
MAX_NAME = 1024  # characters in a tensor's name
_MAX_HANDLE = 4096  # bytes in a CUDA IPC handle (64 in torch's; room for other forms)
_READ_CHUNK = 1 << 30  # bytes per pread (Linux reads at most ~2 GiB at once)


def serialize_named_tensors(tensors: Iterable[tuple[str, Any]]) -> str:
    """``(name, tensor)`` pairs as one base64 payload (handles, not data: the tensors
    must stay alive until the receiver has loaded them). Tensors on CPU are shared
    through named shared-memory files (torch's ``file_system`` strategy, which a process
    that is not this one's child can open). A tensor with gaps in its storage (a slice)
    is sent as a dense copy: a receiver reads only the elements a tensor covers."""
    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import init_reductions

    pairs = [(str(name), t) for name, t in tensors]
    for name, t in pairs:
        if not isinstance(t, torch.Tensor):
            raise ConfigError(f"{name!r} is a {type(t).__name__}, not a tensor")
    pairs = [(n, _dense(t.detach())) for n, t in pairs]
    strategy = mp.get_sharing_strategy()  # type: ignore[no-untyped-call]
    if any(t.device.type == "cpu" for _, t in pairs) and strategy != "file_system":
        mp.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    init_reductions()  # type: ignore[no-untyped-call]
    from multiprocessing.reduction import ForkingPickler

    buf = io.BytesIO()
    ForkingPickler(buf, pickle.HIGHEST_PROTOCOL).dump(pairs)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _dense(t: Any) -> Any:
    """``t``, or a contiguous copy when its elements do not fill the span they cover."""
    return t if _span(tuple(t.shape), tuple(t.stride())) <= max(t.numel(), 1) else t.contiguous()


def _span(shape: tuple[int, ...], stride: tuple[int, ...]) -> int:
    """Elements from a tensor's first to its last, inclusive (0 for an empty tensor)."""
    if any(n == 0 for n in shape):
        return 0
    return 1 + sum((n - 1) * s for n, s in zip(shape, stride, strict=True))


# -- step 1: the pickle, read into inert records ---------------------------------------------
class _Frozen:
    """A stand-in or record: no ``__dict__``, no ``__setstate__``, no item assignment, and
    no attribute set after construction (a pickle's BUILD opcode fails on it)."""

    __slots__ = ()

    def __setattr__(self, name: str, value: object) -> None:
        raise ConfigError(f"the payload tries to set {_quote(name)} on {self!r}; refused")

    def __delattr__(self, name: str) -> None:
        raise ConfigError(f"the payload tries to delete {_quote(name)} of {self!r}; refused")

    def __reduce__(self) -> Any:
        raise TypeError(f"{self!r} cannot be pickled")


class _Global(_Frozen):
    """A class or dtype a payload names (``torch.Tensor``, ``torch.float32``): a name only."""

    __slots__ = ("name",)
    name: str

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "name", name)

    def __repr__(self) -> str:
        return self.name


class _Call(_Frozen):
    """A call of one of torch's rebuild functions (or ``torch.Size``), recorded, not run."""

    __slots__ = ("args", "fn")
    fn: str
    args: tuple[Any, ...]

    def __init__(self, fn: str, args: tuple[Any, ...]) -> None:
        object.__setattr__(self, "fn", fn)
        object.__setattr__(self, "args", args)

    def __repr__(self) -> str:
        return f"{self.fn}(...)"


class _Recorder(_Frozen):
    """What a payload gets for one of torch's rebuild functions: calling it records the
    call (:class:`_Call`) and runs nothing."""

    __slots__ = ("fn",)
    fn: str

    def __init__(self, fn: str) -> None:
        object.__setattr__(self, "fn", fn)

    def __call__(self, *args: Any) -> _Call:
        return _Call(self.fn, args)

    def __repr__(self) -> str:
        return self.fn


_RECORDERS = {
    (_REDUCTIONS, "rebuild_tensor"): _Recorder("rebuild_tensor"),
    (_REDUCTIONS, "rebuild_cuda_tensor"): _Recorder("rebuild_cuda_tensor"),
    (_REDUCTIONS, "rebuild_typed_storage"): _Recorder("rebuild_typed_storage"),
    (_REDUCTIONS, "rebuild_storage_filename"): _Recorder("rebuild_storage_filename"),
    ("torch", "Size"): _Recorder("torch.Size"),
}
_CLASSES = {
    ("torch", "Tensor"): _Global("torch.Tensor"),
    ("torch.nn.parameter", "Parameter"): _Global("torch.Tensor"),  # rebuilt as a plain tensor
    ("torch", "UntypedStorage"): _Global("torch.UntypedStorage"),
    ("torch.storage", "UntypedStorage"): _Global("torch.UntypedStorage"),
    ("torch", "TypedStorage"): _Global("torch.TypedStorage"),
    ("torch.storage", "TypedStorage"): _Global("torch.TypedStorage"),
}
_DTYPES = {("torch", name): _Global(name) for name in _FLOATS}


class _Restricted(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        key = (module, name)
        found = _RECORDERS.get(key) or _CLASSES.get(key) or _DTYPES.get(key)
        if found is None:
            raise ConfigError(
                f"the payload names {module}.{name}; a tensor payload may only name torch's "
                "tensor and storage rebuilders, torch.Size, torch.Tensor, torch's storage "
                f"classes and the dtypes {', '.join(_FLOATS)} (serialize it with torch's "
                "multiprocessing reductions: ForkingPickler over (name, tensor) pairs)"
            )
        return found

    def persistent_load(self, pid: Any) -> Any:
        raise ConfigError("the payload holds a persistent id; a tensor payload holds none")


# -- step 2: the records, checked --------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _ShmStorage:
    """A CPU storage in a shared-memory file: ``nbytes`` of data after the header."""

    name: str  # "/torch_..." (shm_open's name)
    nbytes: int


@dataclasses.dataclass(frozen=True)
class _CudaStorage:
    """A CUDA storage by IPC handle: torch's ``rebuild_cuda_tensor`` arguments."""

    device: int
    handle: bytes
    nbytes: int
    offset_bytes: int
    ref_counter: bytes
    ref_counter_offset: int
    event_handle: bytes | None
    event_sync_required: bool


@dataclasses.dataclass(frozen=True)
class _TensorSpec:
    """One named tensor of a payload, checked: where its elements are and what they are."""

    name: str
    dtype: str  # one of _FLOATS
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # elements into the storage
    storage: _ShmStorage | _CudaStorage
    key: int  # the storage record's identity: one release per record, as torch's receiver


@dataclasses.dataclass(frozen=True)
class TensorPayload:
    """A payload described and checked (:func:`describe_named_tensors`); nothing is read
    until :meth:`materialise`."""

    specs: tuple[_TensorSpec, ...]

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Each tensor's name and shape, in the payload's order."""
        return {s.name: s.shape for s in self.specs}

    def materialise(self) -> dict[str, Any]:
        """``{name: tensor}``: CPU tensors read into memory of this process, CUDA tensors
        mapped from the sender's; raises :class:`ConfigError` (and holds none of them)
        when any cannot be read in full."""
        out: dict[str, Any] = {}
        opened: dict[int, tuple[int, str]] = {}  # storage record -> its file (open), its name
        try:
            for spec in self.specs:
                storage = spec.storage
                if isinstance(storage, _ShmStorage):
                    if spec.key not in opened:
                        opened[spec.key] = (_open_shm(storage), storage.name)
                    out[spec.name] = _read(opened[spec.key][0], storage.name, spec)
                else:
                    out[spec.name] = _map_cuda(spec, storage)
        except BaseException:
            out.clear()
            raise
        finally:
            for fd, name in opened.values():
                try:
                    _release(fd, name)
                finally:
                    os.close(fd)
        return out


def describe_named_tensors(payload: str, *, cuda: bool = False) -> TensorPayload:
    """A payload of :func:`serialize_named_tensors` (or SGLang's
    ``MultiprocessingSerializer``) read and checked without touching any tensor or file:
    :class:`ConfigError` for anything that is not such a payload. ``cuda``: whether the
    receiver runs on CUDA (otherwise CUDA handles are refused)."""
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as e:
        raise ConfigError(f"the payload is not base64: {e}") from None
    try:
        pairs = _Restricted(io.BytesIO(raw)).load()
    except ConfigError:
        raise
    except Exception as e:  # truncated, foreign, or an opcode our records refuse
        raise ConfigError(f"the payload could not be loaded: {type(e).__name__}: {e}") from None
    if type(pairs) is dict:
        pairs = list(pairs.items())
    if type(pairs) not in (list, tuple):
        raise ConfigError(f"the payload must hold (name, tensor) pairs, got {_kind(pairs)}")
    specs: list[_TensorSpec] = []
    seen: set[str] = set()
    for i, pair in enumerate(pairs):
        if not (type(pair) in (tuple, list) and len(pair) == 2):
            raise ConfigError(f"entry {i} of the payload is not a (name, tensor) pair")
        name, tensor = pair
        if type(name) is not str or not isinstance(tensor, _Call):
            raise ConfigError(
                f"entry {i} of the payload is ({_kind(name)}, {_kind(tensor)}), not (str, tensor)"
            )
        if len(name) > MAX_NAME:
            raise ConfigError(
                f"entry {i} of the payload is named {_quote(name)}, {len(name)} characters: a "
                f"weight name has at most {MAX_NAME}"
            )
        if name in seen:
            raise ConfigError(f"the payload names {name!r} twice")
        seen.add(name)
        try:
            specs.append(_tensor(name, tensor, cuda))
        except ConfigError as e:
            raise ConfigError(f"tensor {name!r}: {e}") from None
    return TensorPayload(tuple(specs))


def _kind(value: object) -> str:
    return repr(value) if isinstance(value, _Frozen) else type(value).__name__


def _quote(value: object) -> str:
    """A payload's value in a message, short whatever its size."""
    if isinstance(value, str | bytes):
        return short_repr(value[:80])
    if type(value) is int:  # a huge int has no decimal form (sys.int_max_str_digits)
        return (
            short_repr(value)
            if value.bit_length() <= 256
            else f"an int of {value.bit_length()} bits"
        )
    return _kind(value)


def _tensor(name: str, call: _Call, cuda: bool) -> _TensorSpec:
    if call.fn == "rebuild_tensor":
        cls, storage, metadata = _args(call, 3)
        _expect_class(cls, "torch.Tensor", "the tensor class")
        if not (type(metadata) is tuple and len(metadata) == 4):
            raise ConfigError("rebuild_tensor's metadata must be (offset, size, stride, grad)")
        offset, size, stride, _ = metadata
        if not (isinstance(storage, _Call) and storage.fn == "rebuild_typed_storage"):
            raise ConfigError(
                f"the storage must be rebuild_typed_storage(...), got {_kind(storage)}"
            )
        untyped, dtype = _args(storage, 2)
        if not (isinstance(untyped, _Call) and untyped.fn == "rebuild_storage_filename"):
            raise ConfigError(
                f"the storage must be a shared-memory file (rebuild_storage_filename), got "
                f"{_kind(untyped)}: send CPU tensors with torch's file_system sharing strategy"
            )
        where: _ShmStorage | _CudaStorage = _shm(untyped)
        key = id(untyped)
    elif call.fn == "rebuild_cuda_tensor":
        if not cuda:
            raise ConfigError(
                "a CUDA IPC handle, and this server runs on CPU: it can read CPU tensors "
                "shared by name (torch's file_system strategy) only"
            )
        (cls, size, stride, offset, storage_cls, dtype, device, handle, nbytes, offset_bytes,
         _, ref_counter, ref_offset, event, sync) = _args(call, 15)  # fmt: skip
        _expect_class(cls, "torch.Tensor", "the tensor class")
        if not isinstance(storage_cls, _Global) or "Storage" not in storage_cls.name:
            raise ConfigError(f"the storage class must be torch's, got {_kind(storage_cls)}")
        if type(handle) is not bytes or not 0 < len(handle) <= _MAX_HANDLE:
            raise ConfigError(
                f"the tensor has no CUDA IPC handle (got {_kind(handle)}); send a CUDA "
                "tensor that holds memory"
            )
        if type(ref_counter) is not bytes or not _SHM_NAME.fullmatch(ref_counter):
            raise ConfigError(f"the reference-counter name {_quote(ref_counter)} is not torch's")
        if not (event is None or (type(event) is bytes and len(event) <= _MAX_HANDLE)):
            raise ConfigError(f"the event handle must be bytes, got {_kind(event)}")
        if type(sync) is not bool:
            raise ConfigError(f"event_sync_required must be a bool, got {_kind(sync)}")
        ref_offset = _int(ref_offset, "ref_counter_offset")
        if ref_offset >= _CUDA_REF_COUNTERS:
            raise ConfigError(f"ref_counter_offset {ref_offset} is past torch's counters")
        storage_bytes = _int(nbytes, "storage_size_bytes")
        if storage_bytes == 0:
            raise ConfigError("the CUDA storage is empty (no memory behind the handle)")
        where = _CudaStorage(
            _int(device, "device"), handle, storage_bytes, _int(offset_bytes, "storage offset"),
            ref_counter, ref_offset, event, sync,
        )  # fmt: skip
        key = id(call)
    else:
        raise ConfigError(
            f"a tensor must be rebuild_tensor(...) or rebuild_cuda_tensor(...), got {call!r}"
        )
    spec = _TensorSpec(
        name, _dtype(dtype), _ints(_size(size), "size"), _ints(stride, "stride"),
        _int(offset, "offset"), where, key,
    )  # fmt: skip
    if len(spec.stride) != len(spec.shape):
        raise ConfigError(f"size {spec.shape} and stride {spec.stride} differ in length")
    span = _span(spec.shape, spec.stride)
    if span > max(math.prod(spec.shape), 1):
        raise ConfigError(
            f"size {spec.shape} with stride {spec.stride} leaves gaps between its elements; "
            "send a contiguous tensor"
        )
    end = (spec.offset + span) * _itemsize(spec.dtype)
    if end > spec.storage.nbytes:
        raise ConfigError(
            f"elements up to byte {end} of a storage of {spec.storage.nbytes} bytes (offset "
            f"{spec.offset}, size {spec.shape}, stride {spec.stride}, {spec.dtype})"
        )
    return spec


def _args(call: _Call, n: int) -> tuple[Any, ...]:
    if len(call.args) != n:
        raise ConfigError(f"{call.fn} takes {n} arguments, the payload gives {len(call.args)}")
    return call.args


def _expect_class(value: object, name: str, what: str) -> None:
    if not (isinstance(value, _Global) and value.name == name):
        raise ConfigError(f"{what} must be {name}, got {_kind(value)}")


def _size(value: object) -> object:
    if isinstance(value, _Call) and value.fn == "torch.Size":
        (dims,) = _args(value, 1)
        return dims
    return value


def _int(value: object, what: str) -> int:
    if type(value) is not int or value < 0 or value >= 1 << 62:
        raise ConfigError(f"{what} must be a non-negative int, got {_quote(value)}")
    return value


def _ints(value: object, what: str) -> tuple[int, ...]:
    if not (isinstance(value, tuple | list) and type(value) in (tuple, list) and len(value) <= 64):
        raise ConfigError(f"{what} must be a tuple of ints, got {_kind(value)}")
    return tuple(_int(v, what) for v in value)


def _dtype(value: object) -> str:
    if not (isinstance(value, _Global) and value.name in _FLOATS):
        raise ConfigError(f"the dtype must be one of {', '.join(_FLOATS)}, got {_kind(value)}")
    return value.name


def _shm(call: _Call) -> _ShmStorage:
    cls, manager, name, nbytes = _args(call, 4)
    _expect_class(cls, "torch.UntypedStorage", "the storage class")
    if type(manager) is not bytes:  # where torch's manager listens: never contacted here
        raise ConfigError(f"the manager handle must be bytes, got {_kind(manager)}")
    if type(name) is not bytes or not _SHM_NAME.fullmatch(name):
        raise ConfigError(
            f"the shared-memory name {_quote(name)} is not torch's (/torch_<pid>_<n>_<n>)"
        )
    return _ShmStorage(name.decode("ascii"), _int(nbytes, "the storage size"))


def _itemsize(dtype: str) -> int:
    return {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}[dtype]


# -- step 3: materialise -----------------------------------------------------------------------
_RELEASE = threading.Lock()  # the reference counts in the files: one release at a time


def _open_shm(storage: _ShmStorage) -> int:
    """The storage's file, opened without following a link or blocking, checked to be a
    regular file that holds the header and ``nbytes``."""
    try:
        fd = open_regular(SHM_DIR + storage.name, write=True, follow=False)
    except ConfigError as e:
        raise ConfigError(
            f"shared-memory file {storage.name}: {e} (the sender must keep its tensors alive "
            "until this server answers)"
        ) from None
    try:
        size = os.fstat(fd).st_size
        if size < SHM_HEADER + storage.nbytes:
            raise ConfigError(
                f"shared-memory file {storage.name} holds {size} bytes, the payload "
                f"announces {SHM_HEADER} + {storage.nbytes}"
            )
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read(fd: int, name: str, spec: _TensorSpec) -> Any:
    """The tensor's elements read from its file into a new tensor of this process."""
    import torch

    size = _itemsize(spec.dtype)
    span = _span(spec.shape, spec.stride)
    start = SHM_HEADER + spec.offset * size
    what = f"shared-memory file {name}"
    flat = read_bytes(fd, start, span * size, what).view(getattr(torch, spec.dtype))
    return torch.as_strided(flat, spec.shape, spec.stride) if span else flat.reshape(spec.shape)


def open_regular(path: str, *, write: bool = False, follow: bool = True) -> int:
    """``path`` opened without blocking, and only if it is a regular file: a FIFO, a device
    or a socket is refused at once, never waited on. ``follow``: whether a symlink is
    followed. Raises :class:`ConfigError` naming the file."""
    flags = (os.O_RDWR if write else os.O_RDONLY) | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
    if not follow:
        flags |= os.O_NOFOLLOW
    try:
        # Checked before the open too: opening a device may do something by itself.
        if not stat.S_ISREG(os.stat(path, follow_symlinks=follow).st_mode):
            raise ConfigError(f"{path} is not a regular file")
        fd = os.open(path, flags)
    except OSError as e:
        raise ConfigError(f"{path} could not be opened: {e.strerror}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # replaced since the check
            raise ConfigError(f"{path} is not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_bytes(fd: int, start: int, nbytes: int, what: str) -> Any:
    """``nbytes`` of ``fd`` from ``start`` into a new uint8 tensor, with ``pread`` (the
    file is never mapped: a file cut short meanwhile is a short read, refused with
    :class:`ConfigError` naming ``what``, not a fault)."""
    import torch

    buf = torch.empty(nbytes, dtype=torch.uint8)
    view = buf.numpy().data.cast("B")
    done = 0
    while done < nbytes:
        n = os.preadv(fd, [view[done : done + _READ_CHUNK]], start + done)
        if n <= 0:
            raise ConfigError(
                f"{what} ended after {start + done} bytes, {start + nbytes} expected: it was "
                "cut short while it was read"
            )
        done += n
    return buf


def _release(fd: int, name: str) -> None:
    """Drop the reference the sender took for this receiver on the file (its first int:
    torch's count), unlinking the file when none is left, as torch's receiver does. The
    sender waits for the answer meanwhile; a count already spent is left alone."""
    with _RELEASE:
        try:
            head = os.pread(fd, 4, 0)
            count = int.from_bytes(head, sys.byteorder, signed=True) if len(head) == 4 else 0
            if count <= 0:
                return
            os.pwrite(fd, (count - 1).to_bytes(4, sys.byteorder, signed=True), 0)
            if count == 1:
                os.unlink(SHM_DIR + name)
        except OSError:
            pass  # the sender's bookkeeping; the tensors are read


def _map_cuda(spec: _TensorSpec, storage: _CudaStorage) -> Any:
    """torch's own ``rebuild_cuda_tensor`` over the checked plain values."""
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    if storage.device >= torch.cuda.device_count():
        raise ConfigError(
            f"the tensor is on cuda:{storage.device}, this process sees "
            f"{torch.cuda.device_count()} GPUs"
        )
    # torch maps the sender's reference counters from this file: it must be one of torch's
    # (a regular file of the counters' size), not whatever the payload names.
    counters = SHM_DIR + storage.ref_counter.decode("ascii")
    fd = open_regular(counters, follow=False)
    try:
        size = os.fstat(fd).st_size
    finally:
        os.close(fd)
    if size < SHM_HEADER + 8 * _CUDA_REF_COUNTERS:
        raise ConfigError(f"{counters} holds {size} bytes, not torch's CUDA reference counters")
    try:
        return rebuild_cuda_tensor(  # type: ignore[no-untyped-call]
            torch.Tensor, torch.Size(spec.shape), spec.stride, spec.offset,
            torch.UntypedStorage, getattr(torch, spec.dtype), storage.device, storage.handle,
            storage.nbytes, storage.offset_bytes, False, storage.ref_counter,
            storage.ref_counter_offset, storage.event_handle, storage.event_sync_required,
        )  # fmt: skip
    except (RuntimeError, ValueError, TypeError) as e:
        raise ConfigError(
            f"CUDA tensor {spec.name!r} could not be mapped: {type(e).__name__}: {e}"
        ) from None


def load_named_tensors(payload: str, *, cuda: bool = False) -> dict[str, Any]:
    """A payload of :func:`serialize_named_tensors` (or SGLang's
    ``MultiprocessingSerializer``) as ``{name: tensor}``: described, checked, then read
    (see the module docstring). Raises :class:`~agentenv.ConfigError` for anything that is
    not such a payload, or whose memory cannot be read in full. ``cuda``: whether CUDA
    handles may be mapped (the receiver runs on CUDA)."""
    return describe_named_tensors(payload, cuda=cuda).materialise()
