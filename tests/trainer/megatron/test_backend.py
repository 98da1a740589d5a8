"""MegatronBackend driven through the rank-management seam (trainer.distributed.Ranks)
by a fake rank manager: no processes, no megatron, no GPU. What the backend itself does
-- route every method to the ranks' workers, count the updates, write and check the
checkpoint directory around the ranks' shards -- is checked here; the workers' step
runs on a GPU (test_backend_gpu.py)."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from agentenv import ClosedResourceError, ConfigError
from tests.trainer.megatron.tiny import TINY
from trainer import OptimConfig
from trainer.megatron import (
    MegatronBackend,
    MegatronNotInstalledError,
    MegatronOptions,
    MegatronWorker,
    ParallelConfig,
    Ranks,
    launch_ranks,
    resolve_options,
)


class FakeWorker:
    """Rank 0's worker: records each call, answers with something recognisable."""

    def __init__(self, options: MegatronOptions) -> None:
        self.options = options
        self.device = torch.device("cpu")
        self.model, self.reference, self.optimizer = "model", None, "optimizer"
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []
        self.shut = 0

    def _record(self, name: str, *args: Any, **kwargs: Any) -> None:
        self.calls.append((name, args, kwargs))

    def logprobs(
        self, samples: Any, *, reference: bool = False, temperature: float = 1.0
    ) -> list[torch.Tensor]:
        self._record("logprobs", samples, reference=reference, temperature=temperature)
        return [torch.zeros(2)]

    def train_step(self, samples: Any, advantages: Any, **kwargs: Any) -> dict[str, float]:
        self._record("train_step", samples, advantages, **kwargs)
        if len(samples) != len(advantages):
            raise ConfigError(f"{len(samples)} samples but {len(advantages)} advantages")
        return {"loss": 0.5}

    def state_dict(self) -> dict[str, torch.Tensor]:
        self._record("state_dict")
        return {"w": torch.ones(1)}

    def save_hf(self, directory: Any) -> None:
        self._record("save_hf", directory)

    def save_shards(self, directory: str) -> None:
        self._record("save_shards", directory)
        (Path(directory) / "model_tp0_pp0.pt").write_bytes(b"shard")

    def load_shards(self, directory: str, steps: int) -> None:
        self._record("load_shards", directory, steps)

    def shutdown(self) -> None:
        self.shut += 1


class FakeRanks:
    """One rank, in this process: a call is the worker's method, run here."""

    def __init__(self, worker: FakeWorker) -> None:
        self.worker = worker
        self.closed = 0

    @property
    def world_size(self) -> int:
        return 1

    @property
    def local(self) -> Any:
        return self.worker

    def call(self, method: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise ClosedResourceError("closed")
        return getattr(self.worker, method.__name__)(*args, **kwargs)

    def exited(self) -> dict[int, int]:
        return {}

    def close(self) -> None:
        self.closed += 1
        self.worker.shutdown()


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    root = tmp_path / "hf"
    root.mkdir()
    (root / "config.json").write_text(json.dumps({**TINY, "architectures": ["LlamaForCausalLM"]}))
    return root


def _backend(model_dir: Path, **kwargs: Any) -> tuple[MegatronBackend, FakeRanks]:
    started: list[FakeRanks] = []

    def launch(options: MegatronOptions) -> Ranks[MegatronWorker]:
        started.append(FakeRanks(FakeWorker(options)))
        return started[0]

    backend = MegatronBackend(model_dir, device="cpu", launcher=launch, **kwargs)
    return backend, started[0]


def test_the_launcher_gets_the_checked_options_and_the_backend_keeps_rank_0s_objects(
    model_dir: Path,
) -> None:
    backend, ranks = _backend(model_dir, dtype=torch.float32, num_gpus=2, seed=3)
    options = ranks.worker.options
    assert options.path == model_dir and options.qkv_format == "bshd"  # fp32: padded rows
    assert (options.num_gpus, options.seed, options.data_parallel_size) == (2, 3, 2)
    assert backend.dp_size == 2 and backend.cfg.num_layers == TINY["num_hidden_layers"]
    assert (backend.model, backend.reference, backend.optimizer) == ("model", None, "optimizer")
    assert backend.device == torch.device("cpu")


def test_every_method_runs_on_the_ranks_and_updates_are_counted(model_dir: Path) -> None:
    backend, ranks = _backend(model_dir)
    worker = ranks.worker
    samples: Any = ["s0", "s1"]  # the fake worker reads only their number
    assert backend.logprobs(samples, reference=True, temperature=0.7)[0].shape == (2,)
    metrics = backend.train_step(samples, [1.0, -1.0], lr_step=4, temperature=0.7)
    assert metrics == {"loss": 0.5} and backend.steps == 1
    with pytest.raises(ConfigError, match="2 samples but 1 advantages"):
        backend.train_step(samples, [1.0])
    assert backend.steps == 1  # a refused step is no update
    assert set(backend.state_dict()) == {"w"}
    backend.save_hf("out")
    assert [c[0] for c in worker.calls] == [
        "logprobs",
        "train_step",
        "train_step",
        "state_dict",
        "save_hf",
    ]
    # The temperature each call is given reaches the ranks (the rollouts', from the loop).
    assert worker.calls[0] == ("logprobs", (samples,), {"reference": True, "temperature": 0.7})
    assert worker.calls[1][2] == {
        "old_logprobs": None, "ref_logprobs": None, "lr_step": 4, "temperature": 0.7
    }  # fmt: skip
    backend.close()
    assert ranks.closed == 1 and worker.shut == 1
    with pytest.raises(ClosedResourceError):
        backend.state_dict()


def test_a_checkpoint_holds_the_ranks_shards_and_restores_the_step_count(
    model_dir: Path, tmp_path: Path
) -> None:
    backend, ranks = _backend(model_dir)
    one: Any = ["s"]
    backend.train_step(one, [1.0])
    ckpt = tmp_path / "ckpt"
    backend.save_checkpoint(ckpt, {"note": "x"})
    (name, (written,), _) = ranks.worker.calls[-1]
    assert name == "save_shards" and Path(written) != ckpt  # written aside, then renamed
    assert (ckpt / "model_tp0_pp0.pt").read_bytes() == b"shard"
    meta = json.loads((ckpt / "checkpoint.json").read_text())
    assert meta["extra"] == {"note": "x"}
    assert meta["model"]["backend"] == "megatron" and meta["model"]["data_parallel_size"] == 1

    again, ranks2 = _backend(model_dir)
    assert again.load_checkpoint(ckpt) == {"note": "x"}
    assert again.steps == 1
    assert ranks2.worker.calls == [("load_shards", (str(ckpt.resolve()), 1), {})]


def test_a_checkpoint_of_another_layout_is_refused_before_any_rank_loads(
    model_dir: Path, tmp_path: Path
) -> None:
    backend, _ = _backend(model_dir)
    backend.save_checkpoint(tmp_path / "ckpt", {})
    other, ranks = _backend(model_dir, parallel=ParallelConfig(use_distributed_optimizer=True))
    with pytest.raises(ConfigError, match="from another model or layout"):
        other.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="is not a trainer checkpoint"):
        other.load_checkpoint(tmp_path / "nothing")
    assert ranks.worker.calls == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": torch.float16}, r"dtype must be torch.bfloat16 or torch.float32"),
        ({"num_gpus": 3, "parallel": ParallelConfig(tensor_model_parallel_size=2)}, "world size 3"),
        ({"max_tokens_per_micro_batch": 0}, "max_tokens_per_micro_batch must be at least 1"),
        (
            {
                "optim": OptimConfig(optimizer="sgd"),
                "parallel": ParallelConfig(use_distributed_optimizer=True),
            },
            "works with adam only",
        ),
    ],
)
def test_bad_options_are_refused_before_any_rank_starts(
    model_dir: Path, kwargs: dict[str, Any], message: str
) -> None:
    def launch(options: MegatronOptions) -> Ranks[MegatronWorker]:
        raise AssertionError("no rank should start")

    with pytest.raises(ConfigError, match=message):
        MegatronBackend(model_dir, launcher=launch, **kwargs)


def test_the_default_launcher_needs_megatron_and_a_cuda_device(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import trainer.megatron._backend as backend_module

    options = resolve_options(model_dir, device="cpu")
    for name in ("megatron", "megatron.core"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import` raise ImportError
    with pytest.raises(MegatronNotInstalledError):
        launch_ranks(options)
    monkeypatch.setattr(backend_module, "require_megatron", lambda: None)
    with pytest.raises(ConfigError, match=r"needs a CUDA device .* got device 'cpu'"):
        launch_ranks(options)
