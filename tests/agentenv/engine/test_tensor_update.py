"""SGLang's ``/update_weights_from_tensor``, served by ``agentenv serve``: another process
on this machine hands its tensors over by handle (shared memory on CPU) and they land in
the served model; payloads that are not tensor handles -- above all, pickles that would
run code -- are refused without being run."""

from __future__ import annotations

import base64
import os
import pickle
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest
import torch

from agentenv.engine import Engine, EngineServer, load_named_tensors, serialize_named_tensors
from agentenv.sglang import SGLangClient, SGLangError
from tests._gpu import gpu_test

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

NORM = "model.norm.weight"
ROOT = Path(__file__).resolve().parents[3]
Served = tuple[Engine, SGLangClient]

# A sender in a process of its own, as a trainer rank is: SGLang's serializer
# (ForkingPickler over (name, tensor) pairs, base64), the tensors alive until the answer.
SENDER = """
import base64, io, sys
import httpx, torch
import torch.multiprocessing as mp
from multiprocessing.reduction import ForkingPickler
mp.set_sharing_strategy("file_system")
norm = torch.full((int(sys.argv[2]),), 0.25)
buf = io.BytesIO()
ForkingPickler(buf).dump([("model.norm.weight", norm)])
body = {"serialized_named_tensors": [base64.b64encode(buf.getvalue()).decode()],
        "weight_version": "7"}
r = httpx.post(sys.argv[1] + "/update_weights_from_tensor", json=body, timeout=60)
print(r.status_code, r.json()["message"])
"""


@pytest.fixture
async def served() -> AsyncIterator[Served]:
    async with (
        Engine("smollm2-135m", context_length=256) as engine,
        EngineServer(engine) as server,
        SGLangClient(server.url, retries=0) as client,
    ):
        yield engine, client


def _norm(engine: Engine) -> torch.Tensor:
    views = engine.model._weight_views()
    view = views[NORM]
    assert view is not None
    return view


def test_a_payload_round_trips_by_handle() -> None:
    a, b = torch.randn(3, 4), torch.arange(6, dtype=torch.bfloat16)[2:]
    out = load_named_tensors(serialize_named_tensors([("a", a), ("b", b)]))
    assert list(out) == ["a", "b"]
    assert torch.equal(out["a"], a) and torch.equal(out["b"], b)
    assert out["b"].dtype == torch.bfloat16


async def test_tensors_of_another_process_land_in_the_model(served: Served, tmp_path: Path) -> None:
    engine, client = served
    size = _norm(engine).shape[0]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-c", SENDER, client.url, str(size)]
    # Output to files: torch's shared-memory manager outlives the sender with its streams.
    log, err = tmp_path / "out", tmp_path / "err"
    with log.open("wb") as stdout, err.open("wb") as stderr, anyio.fail_after(90):
        # The server answers on this loop meanwhile.
        done = await anyio.run_process(cmd, env=env, check=False, stdout=stdout, stderr=stderr)
    out = log.read_text()
    assert done.returncode == 0, err.read_text()
    assert out.startswith("200 Succeeded to update model weights."), out
    assert "Weight version updated to 7" in out
    assert torch.equal(_norm(engine).float(), torch.full((size,), 0.25))
    assert await client.weight_version() == "7"


async def test_the_client_hands_tensors_over_in_this_process(served: Served) -> None:
    engine, client = served
    new = torch.full_like(_norm(engine), 0.5)
    await client.update_weights_from_tensor(
        [serialize_named_tensors([(NORM, new)])], weight_version="3"
    )
    assert torch.equal(_norm(engine), new)
    assert await client.weight_version() == "3"


class _Boom:
    """Unpickled, it would run a command: what a hostile client sends."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"touch {self.marker}",))


async def test_payloads_that_are_not_tensor_handles_are_refused(
    served: Served, tmp_path: Path
) -> None:
    engine, client = served
    before = _norm(engine).clone()
    marker = tmp_path / "pwned"
    hostile = base64.b64encode(pickle.dumps([(NORM, _Boom(marker))])).decode()
    cases = {
        hostile: "may only name torch's tensor and storage rebuilders",
        "not base64!": "not base64",
        base64.b64encode(b"\x80\x05junk").decode(): "could not be loaded",
        base64.b64encode(pickle.dumps([("x", 1)])).decode(): "not (str, tensor)",
        serialize_named_tensors([(NORM, torch.zeros(3))]): "the model is unchanged",
        serialize_named_tensors([("model.nope.weight", torch.zeros(3))]): "nope",
    }
    for payload, expected in cases.items():
        with pytest.raises(SGLangError, match="Failed to update weights") as info:
            await client.update_weights_from_tensor([payload])
        assert expected in str(info.value), (expected, str(info.value))
    assert not os.path.exists(marker)  # noqa: ASYNC240 - one stat
    with pytest.raises(SGLangError, match="one payload"):
        await client.update_weights_from_tensor([hostile, hostile])
    with pytest.raises(SGLangError, match="load_format"):
        await client.update_weights_from_tensor(
            [serialize_named_tensors([(NORM, before)])], load_format="flattened_bucket"
        )
    assert torch.equal(_norm(engine), before)


CUDA_SENDER = """
import sys
import httpx, torch
from agentenv.engine import serialize_named_tensors
norm = torch.full((int(sys.argv[2]),), 0.75, device="cuda", dtype=torch.bfloat16)
body = {"serialized_named_tensors": [serialize_named_tensors([("model.norm.weight", norm)])],
        "weight_version": "9"}
r = httpx.post(sys.argv[1] + "/update_weights_from_tensor", json=body, timeout=120)
print(r.status_code, r.json()["message"])
"""


@gpu_test()
async def test_a_cuda_tensor_of_another_process_is_mapped_on_the_same_gpu(
    tmp_path: Path,
) -> None:
    # A small random Llama: the handover, not the model, is under test.
    from benchmarks.cuda_check import NumberTokenizer, tiny_llama

    model = tiny_llama(tmp_path / "model", seed=0)
    number_tokens = NumberTokenizer()
    async with (
        Engine(str(model), device="cuda", context_length=256, tokenizer=number_tokens) as engine,
        EngineServer(engine) as server,
        SGLangClient(server.url, retries=0) as client,
    ):
        size = _norm(engine).shape[0]
        env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
        log, err = tmp_path / "out", tmp_path / "err"
        cmd = [sys.executable, "-c", CUDA_SENDER, server.url, str(size)]
        with log.open("wb") as stdout, err.open("wb") as stderr, anyio.fail_after(120):
            done = await anyio.run_process(cmd, env=env, check=False, stdout=stdout, stderr=stderr)
        assert done.returncode == 0, err.read_text()
        assert log.read_text().startswith("200 Succeeded"), log.read_text()
        assert torch.equal(_norm(engine).float().cpu(), torch.full((size,), 0.75))
        assert await client.weight_version() == "9"
