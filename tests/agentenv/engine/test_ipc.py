"""``/update_weights_from_tensor`` against hostile payloads and hostile files: a payload
changes nothing but the weights it names, is checked whole before any is installed, and
is read without mapping the sender's files or contacting anything it names. Each hostile
payload is refused with 400; afterwards torch's classes and rebuild functions are as they
were, the model answers as before, and a legitimate update still lands."""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import struct
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from itertools import count
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch
import torch.multiprocessing.reductions as reductions
from safetensors.torch import load_file

from agentenv import SamplingParams
from agentenv.engine import Engine, EngineServer, serialize_named_tensors
from agentenv.engine._ipc import SHM_HEADER
from agentenv.sglang import SGLangClient, SGLangError
from benchmarks.cuda_check import NumberTokenizer, tiny_llama

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(300)]

NORM = "model.norm.weight"
Q = "model.layers.0.self_attn.q_proj.weight"
PROMPT = [5, 17, 33, 101, 250]
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0)
R = "torch.multiprocessing.reductions"
Served = tuple[Engine, SGLangClient]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return tiny_llama(root / "a", 0, hidden=64, layers=2), tiny_llama(
        root / "b", 1, hidden=64, layers=2
    )


@pytest.fixture
async def served(tiny: tuple[Path, Path]) -> AsyncIterator[Served]:
    async with (
        Engine(tiny[0], tokenizer=NumberTokenizer(), context_length=256) as engine,
        EngineServer(engine) as server,
        SGLangClient(server.url, retries=0) as client,
    ):
        yield engine, client


_names = count()


@pytest.fixture
def shm() -> Iterator[Callable[..., str]]:
    """Writes torch-format shared-memory files (a 64-byte header holding a reference
    count, then the data) as a sender would, without torch; removes them afterwards."""
    made: list[str] = []

    def write(data: torch.Tensor | bytes, *, refcount: int = 2) -> str:
        name = f"/torch_{os.getpid()}_4242_{next(_names)}"
        raw = data if isinstance(data, bytes) else data.contiguous().view(torch.uint8).numpy()
        with open("/dev/shm" + name, "xb") as f:
            f.write(struct.pack("=i", refcount).ljust(SHM_HEADER, b"\0") + bytes(raw))
        made.append(name)
        return name

    yield write
    for name in made:
        with contextlib.suppress(FileNotFoundError):
            os.unlink("/dev/shm" + name)


# -- a pickle assembler: the opcodes a hostile client would write -------------------------------
def g(module: str, name: str) -> bytes:  # GLOBAL, resolved through find_class
    return b"c" + module.encode() + b"\n" + name.encode() + b"\n"


def s(text: str) -> bytes:  # BINUNICODE
    raw = text.encode()
    return b"X" + struct.pack("<I", len(raw)) + raw


def b(data: bytes) -> bytes:  # BINBYTES
    return b"B" + struct.pack("<I", len(data)) + data


def i(n: int) -> bytes:  # LONG1, or LONG4 for a huge one
    raw = n.to_bytes((n.bit_length() + 8) // 8 or 1, "little", signed=True)
    if len(raw) > 255:
        return b"\x8b" + struct.pack("<I", len(raw)) + raw
    return b"\x8a" + bytes([len(raw)]) + raw


def tup(*items: bytes) -> bytes:
    return b"(" + b"".join(items) + b"t"


def call(fn: bytes, *args: bytes) -> bytes:  # REDUCE
    return fn + tup(*args) + b"R"


NONE, FALSE = b"N", b"\x89"


def size(*dims: int) -> bytes:
    return call(g("torch", "Size"), tup(*map(i, dims)))


def shm_tensor(
    name: str,
    shape: tuple[int, ...],
    *,
    nbytes: int | None = None,
    offset: int = 0,
    stride: tuple[int, ...] | None = None,
    dtype: str = "float32",
    manager: bytes | None = None,
) -> bytes:
    """What torch's reductions write for a CPU tensor shared by file name (naming this
    process's shared-memory manager unless told otherwise)."""
    manager = torch_manager() if manager is None else manager
    numel = 1
    for d in shape:
        numel *= d
    nbytes = numel * 4 if nbytes is None else nbytes
    stride = stride or tuple(
        int(torch.tensor(shape[k + 1 :]).prod()) if k + 1 < len(shape) else 1
        for k in range(len(shape))
    )
    untyped = call(
        g(R, "rebuild_storage_filename"),
        g("torch.storage", "UntypedStorage"), b(manager), b(name.encode()), i(nbytes),
    )  # fmt: skip
    typed = call(g(R, "rebuild_typed_storage"), untyped, g("torch", dtype))
    meta = tup(i(offset), size(*shape), tup(*map(i, stride)), FALSE)
    return call(g(R, "rebuild_tensor"), g("torch", "Tensor"), typed, meta)


@functools.cache
def torch_manager() -> bytes:
    """Where torch's shared-memory manager of this process listens (as a sender names it)."""
    torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    kept.append(torch.ones(1).untyped_storage())
    manager: bytes = kept[-1]._share_filename_cpu_()[0]
    return manager


kept: list[Any] = []


def cuda_tensor(shape: tuple[int, ...], device: bytes, handle: bytes = NONE) -> bytes:
    """torch's rebuild_cuda_tensor with no memory behind it (device 'cpu' or 'meta')."""
    return call(
        g(R, "rebuild_cuda_tensor"),
        g("torch", "Tensor"), size(*shape), tup(*map(i, [1] * len(shape))), i(0),
        g("torch.storage", "TypedStorage"), g("torch", "float32"), device, handle, i(0),
        i(0), FALSE, NONE, i(0), NONE, FALSE,
    )  # fmt: skip


def payload(*pairs: tuple[str, bytes]) -> str:
    import base64

    body = b"".join(s(n) + t + b"\x86" for n, t in pairs)
    return base64.b64encode(b"\x80\x02](" + body + b"e.").decode()


def raw(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


# -- what must not change ------------------------------------------------------------------------
REBUILDERS = [
    getattr(reductions, n)
    for n in (
        "rebuild_tensor",
        "rebuild_cuda_tensor",
        "rebuild_typed_storage",
        "rebuild_typed_storage_child",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
        "rebuild_storage_fd",
    )
]


def torch_state() -> list[Any]:
    return [
        dict(vars(torch.UntypedStorage)),
        dict(vars(torch.storage.TypedStorage)),
        dict(vars(torch.Tensor)),
        dict(vars(torch.Size)),
        dict(vars(reductions)),
        [(f.__defaults__, f.__kwdefaults__, f.__code__, dict(vars(f))) for f in REBUILDERS],
    ]


async def greedy(engine: Engine) -> list[int]:
    return (await engine.generate(PROMPT, GREEDY)).output_ids


async def refused(client: SGLangClient, data: str) -> str:
    with pytest.raises(SGLangError) as info:
        await client.update_weights_from_tensor([data], weight_version="hostile")
    assert info.value.status == 400, str(info.value)
    return str(info.value)


async def test_hostile_payloads_are_refused_and_change_nothing(
    served: Served, tiny: tuple[Path, Path], shm: Callable[..., str], tmp_path: Path
) -> None:
    engine, client = served
    hidden = engine.model.config.hidden_size
    before, state = await greedy(engine), torch_state()
    version = await client.weight_version()
    good = shm(torch.full((hidden,), 0.5))
    fifo = f"/torch_{os.getpid()}_4242_{next(_names)}"
    os.mkfifo("/dev/shm" + fifo)
    link = f"/torch_{os.getpid()}_4242_{next(_names)}"
    os.symlink("/dev/shm" + good, "/dev/shm" + link)
    try:

        def slot(key: str, value: bytes) -> bytes:  # BUILD with the state (None, {key: value})
            return b"N}" + s(key) + value + b"s\x86b"

        cases: dict[str, str] = {
            # BUILD, SETITEM and attributes on what find_class gives
            "BUILD on UntypedStorage": payload(
                (NORM, g("torch", "UntypedStorage") + slot("_new_shared_filename_cpu", NONE))
            ),
            "BUILD on storage.UntypedStorage": payload(
                (
                    NORM,
                    g("torch.storage", "UntypedStorage") + slot("_new_shared_filename_cpu", NONE),
                )
            ),
            "BUILD on TypedStorage": payload(
                (NORM, g("torch.storage", "TypedStorage") + slot("_new_wrapped_storage", NONE))
            ),
            "BUILD on Tensor": payload((NORM, g("torch", "Tensor") + slot("copy_", NONE))),
            "BUILD on a rebuilder's defaults": payload(
                (NORM, g(R, "rebuild_storage_filename") + slot("__defaults__", tup(s("x"))))
            ),
            "BUILD on a rebuilder's code": payload(
                (NORM, g(R, "rebuild_tensor") + slot("__code__", NONE))
            ),
            "BUILD with a dict state": payload(
                (NORM, g(R, "rebuild_tensor") + b"}" + s("x") + i(1) + b"sb")
            ),
            "BUILD on a dtype": payload((NORM, g("torch", "float32") + slot("is_signed", NONE))),
            "BUILD on torch.Size": payload((NORM, g("torch", "Size") + slot("__new__", NONE))),
            "SETITEM on a class": payload((NORM, g("torch", "Tensor") + s("k") + s("v") + b"s")),
            "SETITEM on a recorded call": payload(
                (NORM, shm_tensor(good, (hidden,)) + s("k") + s("v") + b"s")
            ),
            "BUILD on a recorded call": payload(
                (NORM, shm_tensor(good, (hidden,)) + slot("fn", s("rebuild_cuda_tensor")))
            ),
            "APPEND on a recorded call": raw(
                b"\x80\x02" + shm_tensor(good, (hidden,)) + s("x") + b"a."
            ),
            "a dotted global": raw(
                b"\x80\x04" + s(R) + s("rebuild_storage_filename.__defaults__") + b"\x93."
            ),
            "os.system": payload((NORM, call(g("os", "system"), s("true")))),
            "builtins.getattr": payload(
                (NORM, call(g("builtins", "getattr"), g("torch", "Tensor"), s("copy_")))
            ),
            "NEWOBJ on a rebuilder": payload((NORM, g(R, "rebuild_tensor") + b")\x81")),
            "a persistent id": raw(b"\x80\x02" + s("x") + b"Q."),
            "rebuild_storage_empty": payload(
                (NORM, call(g(R, "rebuild_storage_empty"), g("torch", "UntypedStorage")))
            ),
            "rebuild_typed_storage_child": payload(
                (NORM, call(g(R, "rebuild_typed_storage_child"), NONE, g("torch", "Tensor")))
            ),
            # reduce chains and torch's rebuilders with hostile arguments
            "a rebuilder as the storage": payload(
                (
                    NORM,
                    call(
                        g(R, "rebuild_tensor"),
                        g("torch", "Tensor"),
                        g(R, "rebuild_tensor"),
                        tup(i(0), size(hidden), tup(i(1)), FALSE),
                    ),
                )
            ),
            "a tensor as the tensor class": payload(
                (NORM, call(g(R, "rebuild_tensor"), shm_tensor(good, (hidden,)), NONE, NONE))
            ),
            "too many arguments": payload(
                (NORM, call(g(R, "rebuild_typed_storage"), NONE, NONE, NONE))
            ),
            "a storage larger than its file": payload(
                (NORM, shm_tensor(good, (hidden,), nbytes=hidden * 4 + 4096))
            ),
            "elements past the storage": payload(
                (NORM, shm_tensor(good, (hidden,), offset=hidden))
            ),
            "a negative offset": payload((NORM, shm_tensor(good, (hidden,), offset=-4))),
            "a huge stride": payload((NORM, shm_tensor(good, (hidden,), stride=(1 << 40,)))),
            "an int with no decimal form": payload(
                (NORM, shm_tensor(good, (hidden,), offset=1 << 20000))
            ),
            "a long name": payload(("x" * 5000, shm_tensor(good, (hidden,)))),
            "a negative stride": payload((NORM, shm_tensor(good, (hidden,), stride=(-1,)))),
            "a wrong shape": payload((NORM, shm_tensor(good, (hidden // 2,)))),
            "an integer dtype": payload((NORM, shm_tensor(good, (hidden,), dtype="int32"))),
            "a name that is no weight": payload(("model.nope.weight", shm_tensor(good, (hidden,)))),
            "one name twice": payload(
                (NORM, shm_tensor(good, (hidden,))), (NORM, shm_tensor(good, (hidden,)))
            ),
            "a path as the name": payload((NORM, shm_tensor("/../../etc/passwd", (hidden,)))),
            "a name that is not there": payload(
                (NORM, shm_tensor(f"/torch_{os.getpid()}_1_999999", (hidden,)))
            ),
            "a FIFO as the file": payload((NORM, shm_tensor(fifo, (hidden,)))),
            "a symlink as the file": payload((NORM, shm_tensor(link, (hidden,)))),
            "a meta tensor": payload((NORM, cuda_tensor((hidden,), s("meta")))),
            "a handle-less CUDA tensor on CPU": payload((NORM, cuda_tensor((hidden,), s("cpu")))),
            "a CUDA handle on CPU": payload((NORM, cuda_tensor((hidden,), i(0), b(b"\x01" * 64)))),
            "not pairs": payload(),  # an empty list is fine; a bare tensor is not:
            "a bare tensor": raw(b"\x80\x02" + shm_tensor(good, (hidden,)) + b"."),
        }
        del cases["not pairs"]
        for what, data in cases.items():
            message = await refused(client, data)
            assert "Failed to update weights" in message, (what, message)
            assert torch_state() == state, what
            assert await client.weight_version() == version, what
        assert await greedy(engine) == before
    finally:
        os.unlink("/dev/shm" + fifo)
        os.unlink("/dev/shm" + link)
    # A legitimate update afterwards: every weight of the other model, by handle.
    async with Engine(tiny[1], tokenizer=NumberTokenizer(), context_length=256) as other:
        expected = await greedy(other)
    weights = load_file(str(tiny[1] / "model.safetensors"))
    await client.update_weights_from_tensor(
        [serialize_named_tensors(weights.items())], weight_version="b"
    )
    assert await greedy(engine) == expected != before
    assert await client.weight_version() == "b"


async def test_a_payload_with_one_bad_tensor_installs_none(
    served: Served, shm: Callable[..., str]
) -> None:
    engine, client = served
    hidden = engine.model.config.hidden_size
    before, version = await greedy(engine), await client.weight_version()
    norm = shm(torch.full((hidden,), 3.0))
    q = tuple(engine.weight_shapes()[Q])
    for bad in (
        cuda_tensor(q, s("meta")),
        shm_tensor(norm, q),
        shm_tensor(norm, (hidden,), dtype="int64"),
    ):
        await refused(client, payload((NORM, shm_tensor(norm, (hidden,))), (Q, bad)))
        assert await greedy(engine) == before
        assert await client.weight_version() == version
    await client.update_weights_from_tensor([payload((NORM, shm_tensor(norm, (hidden,))))])
    view = engine.model._weight_views()[NORM]
    assert view is not None and torch.equal(view, torch.full((hidden,), 3.0))


async def test_a_truncated_file_is_refused_and_the_server_lives(
    served: Served, shm: Callable[..., str]
) -> None:
    engine, client = served
    hidden = engine.model.config.hidden_size
    before = await greedy(engine)
    name = shm(torch.full((hidden,), 2.0))
    os.truncate("/dev/shm" + name, SHM_HEADER + 8)  # the sender cut its file short
    message = await refused(client, payload((NORM, shm_tensor(name, (hidden,)))))
    assert "bytes" in message
    assert await greedy(engine) == before
    assert await client.health()


async def test_a_file_truncated_while_it_is_read_never_faults(
    served: Served, shm: Callable[..., str]
) -> None:
    """A sender that cuts its file short and grows it again while the server copies from
    it: each update either lands whole or is refused, and the server keeps answering
    (a mapped file would have faulted the process)."""
    engine, client = served
    embed = "model.embed_tokens.weight"
    shape = engine.weight_shapes()[embed]
    values = torch.full(shape, 0.125)
    name = shm(values, refcount=1 << 30)  # each update read releases one
    full = SHM_HEADER + values.numel() * 4
    stop = threading.Event()

    def flap() -> None:
        while not stop.is_set():
            os.truncate("/dev/shm" + name, SHM_HEADER)
            os.truncate("/dev/shm" + name, full)

    flapper = threading.Thread(target=flap, daemon=True)
    flapper.start()
    outcomes = set()
    try:
        for _ in range(20):
            try:
                await client.update_weights_from_tensor([payload((embed, shm_tensor(name, shape)))])
                outcomes.add(200)
            except SGLangError as e:
                outcomes.add(e.status or 0)
    finally:
        stop.set()
        flapper.join()
    assert outcomes <= {200, 400}
    assert await client.health()
    assert len(await greedy(engine)) == GREEDY.max_new_tokens


async def test_the_named_manager_is_never_contacted(
    served: Served, shm: Callable[..., str], tmp_path: Path
) -> None:
    """torch's receiver would connect to the manager socket the payload names (and wait on
    it holding the GIL); this one reads the file and never connects."""
    engine, client = served
    hidden = engine.model.config.hidden_size
    path = str(tmp_path / "manager.sock")
    with socket.socket(socket.AF_UNIX) as silent:
        silent.bind(path)
        silent.listen(8)
        silent.setblocking(False)
        name = shm(torch.full((hidden,), 0.75))
        data = payload((NORM, shm_tensor(name, (hidden,), manager=path.encode())))
        await client.update_weights_from_tensor([data], weight_version="m")
        with pytest.raises(BlockingIOError):
            silent.accept()  # nobody connected
    view = engine.model._weight_views()[NORM]
    assert view is not None and torch.equal(view, torch.full((hidden,), 0.75))
    assert await client.weight_version() == "m"


async def test_the_senders_reference_is_released(served: Served, shm: Callable[..., str]) -> None:
    """As torch's receiver does: the reference the sender took for the receiver is
    dropped, and a file no one holds any more is removed."""
    engine, client = served
    hidden = engine.model.config.hidden_size
    held = shm(torch.ones(hidden), refcount=2)  # the sender's and the receiver's
    last = shm(torch.ones(hidden), refcount=1)  # the receiver's only
    await client.update_weights_from_tensor([payload((NORM, shm_tensor(held, (hidden,))))])
    head = await anyio.Path("/dev/shm" + held).read_bytes()
    assert struct.unpack("=i", head[:4])[0] == 1
    await client.update_weights_from_tensor([payload((NORM, shm_tensor(last, (hidden,))))])
    assert not os.path.exists("/dev/shm" + last)  # noqa: ASYNC240 - one stat


def test_views_and_shared_storages_round_trip() -> None:
    from agentenv.engine import load_named_tensors

    base = torch.arange(24, dtype=torch.float32)
    pairs = [
        ("a", base.view(4, 6)),
        ("b", base[6:12]),
        ("t", base.view(4, 6).t()),
        ("cols", base.view(4, 6)[:, :2]),
        ("h", torch.ones(3, dtype=torch.bfloat16)),
    ]
    out = load_named_tensors(serialize_named_tensors(pairs))
    for name, t in pairs:
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
        assert out[name].untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


# -- /update_weights_from_disk: hostile files ------------------------------------------------
async def test_disk_updates_refuse_files_that_are_not_regular_at_once(
    served: Served, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """A FIFO or a device named model.safetensors is refused without being opened for
    reading (which would wait for a writer, or read forever); the server keeps serving."""
    engine, client = served
    before = await greedy(engine)
    makers: dict[str, Callable[[Path], None]] = {
        "fifo": os.mkfifo,
        "device": functools.partial(os.symlink, "/dev/zero"),
    }
    for what, make in makers.items():
        directory = tmp_path / what
        directory.mkdir()
        make(directory / "model.safetensors")
        with anyio.fail_after(60), pytest.raises(SGLangError) as info:
            await client.update_weights_from_disk(str(directory), weight_version="x")
        assert info.value.status == 400 and "not a regular file" in str(info.value), what
    assert await greedy(engine) == before
    assert await client.weight_version() == "default"
    async with Engine(tiny[1], tokenizer=NumberTokenizer(), context_length=256) as other:
        expected = await greedy(other)
    await client.update_weights_from_disk(str(tiny[1]), weight_version="b")
    assert await greedy(engine) == expected


async def test_disk_updates_refuse_corrupt_and_cut_files_whole(
    served: Served, tiny: tuple[Path, Path], tmp_path: Path
) -> None:
    """A file whose header claims more than it holds, or a shape the model does not have,
    is refused before any weight is read or installed."""
    engine, client = served
    before = await greedy(engine)
    data = (tiny[1] / "model.safetensors").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "model.safetensors").write_bytes(data[: len(data) // 2])
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "model.safetensors").write_bytes(b"\xff" * 64)
    for what, expected in {"cut": "cut short", "junk": "not a safetensors file"}.items():
        with pytest.raises(SGLangError) as info:
            await client.update_weights_from_disk(str(tmp_path / what))
        assert info.value.status == 400 and expected in str(info.value), what
    assert await greedy(engine) == before
