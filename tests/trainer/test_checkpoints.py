"""Checkpoints written in the background: the snapshot is the step's state even while
training goes on, a resume from it is exact, and a failed write fails the run."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentenv import ChatTokenizer, Sample, SamplingParams
from agentenv.engine import Engine
from tests.trainer.test_loop import GoodTokensEnv, tiny_llama
from trainer import (
    EmbeddedEngine,
    GRPOConfig,
    OptimConfig,
    TorchBackend,
    compute_advantages,
    run_grpo,
)
from trainer._resources import replace_dir
from trainer.backends._checkpoints import CheckpointWriter, cpu_copy
from trainer.run._config import CheckpointConfig

pytestmark = [pytest.mark.timeout(300), pytest.mark.slow]


def batch(seed: int) -> tuple[list[Sample], torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    samples = [
        Sample(
            prompt_ids=torch.randint(1000, 1016, (5,), generator=gen).tolist(),
            completion_ids=torch.randint(1000, 1016, (4 + i % 3,), generator=gen).tolist(),
            reward=float(i % 2),
            group_id=f"g{i // 4}",
        )
        for i in range(8)
    ]
    return samples, compute_advantages([s.reward for s in samples], [s.group_id for s in samples])


def test_cpu_copy_keeps_tied_tensors_one_copy_and_leaves_the_originals() -> None:
    w = torch.ones(3, 2)
    state = {"a": w, "b": w.detach(), "steps": 3, "groups": [{"lr": 0.1, "params": [0, 1]}]}
    copied = cpu_copy(state)
    w.add_(1)
    assert torch.equal(copied["a"], torch.ones(3, 2)) and copied["a"] is copied["b"]
    assert copied["steps"] == 3 and copied["groups"] == [{"lr": 0.1, "params": [0, 1]}]


def test_a_checkpoint_written_in_the_background_is_the_snapshots_and_resumes_exactly(
    tmp_path: Path,
) -> None:
    model = tiny_llama(tmp_path / "tiny")
    first, second = batch(1), batch(2)
    backend = TorchBackend(model, optim=OptimConfig(lr=1e-2), background_checkpoints=True)
    backend.train_step(*first)
    extra = {"step": 0, "tasks": {"order": ["t1"]}}
    write = backend.checkpoint_snapshot(extra)  # the state after the first step
    backend.save_checkpoint(tmp_path / "foreground", extra)  # written now, in the foreground
    straight = backend.train_step(*second)  # training goes on while the write is pending
    write(tmp_path / "background")
    for name in ("model/model.safetensors", "model/config.json", "checkpoint.json"):
        a, b = (tmp_path / d / name for d in ("foreground", "background"))
        assert a.read_bytes() == b.read_bytes(), name
    saved = [
        torch.load(tmp_path / d / "trainer_state.pt", weights_only=False)
        for d in ("foreground", "background")
    ]
    flat = [torch.nn.utils.parameters_to_vector(list(_tensors(s["optimizer"]))) for s in saved]
    assert torch.equal(flat[0], flat[1]) and saved[0]["steps"] == saved[1]["steps"] == 1

    resumed = TorchBackend(model, optim=OptimConfig(lr=1e-2))
    assert resumed.load_checkpoint(tmp_path / "background") == extra
    again = resumed.train_step(*second)
    assert again["loss"] == straight["loss"] and again["grad_norm"] == straight["grad_norm"]
    for (name, a), b in zip(
        backend.state_dict().items(), resumed.state_dict().values(), strict=True
    ):
        assert torch.equal(a, b), name


def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj.flatten().double()]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


class FailingSecondWrite(TorchBackend):
    """Its second checkpoint write fails midway (e.g. a full disk)."""

    writes = 0

    def checkpoint_snapshot(self, extra: dict[str, Any]) -> Any:
        write = super().checkpoint_snapshot(extra)
        assert write is not None

        def failing(directory: str | os.PathLike[str]) -> None:
            self.writes += 1
            if self.writes < 2:
                return write(directory)
            with replace_dir(directory) as tmp:
                (tmp / "checkpoint.json").write_text("{")
                raise OSError(28, "No space left on device")

        return failing


def test_a_failed_background_write_fails_the_run_and_keeps_the_previous_checkpoint(
    tmp_path: Path,
) -> None:
    model = tiny_llama(tmp_path / "tiny")
    tokenizer = ChatTokenizer.load(model)
    env = GoodTokensEnv()
    backend = FailingSecondWrite(model, optim=OptimConfig(lr=1e-3), background_checkpoints=True)
    config = GRPOConfig(
        num_rollout=4, rollout_batch_size=4, n_samples_per_prompt=2,
        sampling=SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True),
    )  # fmt: skip
    steps: list[int] = []

    async def go() -> None:
        async with Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as e:
            await run_grpo(
                env, env.tasks(), backend, EmbeddedEngine(e), tokenizer, config,
                checkpoint=tmp_path / "ckpt",
                save_interval=1, on_step=lambda m: steps.append(int(m["step"])),
            )  # fmt: skip

    with pytest.raises(OSError, match="No space left on device"):
        anyio.run(go)
    # Step 1's write failed; step 2 stopped at its start or at its own save.
    assert backend.writes == 2 and steps == [0, 1]
    saved = json.loads((tmp_path / "ckpt" / "checkpoint.json").read_text())
    assert saved["extra"]["step"] == 0  # the previous checkpoint, whole


class StepCheckpoints:
    """A backend's checkpoint part only: each save writes its step, in the foreground;
    ``fail_at`` makes that step's write fail halfway."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.fail_at = fail_at

    def checkpoint_snapshot(self, extra: Any) -> None:
        return None

    def save_checkpoint(self, directory: Path, extra: dict[str, Any]) -> None:
        with replace_dir(directory) as tmp:
            (tmp / "weights.bin").write_bytes(bytes([extra["step"]]) * 1000)
            if extra["step"] == self.fail_at:
                raise OSError(28, "No space left on device")
            (tmp / "checkpoint.json").write_text(json.dumps({"extra": extra}))


def _steps_on_disk(root: Path) -> dict[str, int]:
    return {
        p.name: json.loads((p / "checkpoint.json").read_text())["extra"]["step"]
        for p in sorted(root.iterdir())
        if not p.name.endswith(".tmp")  # a failed write's leftover (the next one clears it)
    }


@pytest.mark.parametrize("keep", [1, 3])
def test_only_the_newest_keep_checkpoints_stay_and_a_failed_write_deletes_none(
    tmp_path: Path, keep: int
) -> None:
    async def save(backend: StepCheckpoints, steps: range) -> OSError | None:
        async with anyio.create_task_group() as tg:
            writer = CheckpointWriter(tg, keep=keep)
            try:
                for step in steps:
                    await writer.save(backend, tmp_path / "ckpt", {"step": step})
                await writer.wait()
            except OSError as e:
                return e
        return None

    assert anyio.run(save, StepCheckpoints(), range(5)) is None
    want = {"ckpt": 4} | ({"ckpt.step-2": 2, "ckpt.step-3": 3} if keep == 3 else {})
    assert _steps_on_disk(tmp_path) == want
    # Setting a checkpoint aside copies nothing: its files are the replaced one's.
    if keep == 3:
        assert (tmp_path / "ckpt.step-3" / "weights.bin").stat().st_nlink == 1
        assert (tmp_path / "ckpt.step-3" / "weights.bin").read_bytes() == bytes([3]) * 1000
    # The newest complete checkpoint stays until the next one is complete: a write that
    # fails keeps it, and every one kept beside it.
    assert "No space left" in str(anyio.run(save, StepCheckpoints(fail_at=5), range(5, 6)))
    assert _steps_on_disk(tmp_path) == want | ({"ckpt.step-4": 4} if keep == 3 else {})


def test_the_save_interval_help_says_where_checkpoints_are_written(tmp_path: Path) -> None:
    """On CPU the torch backend writes checkpoints in the step (a copy to write in the
    background would double the step's memory); the flag's help says so."""
    help_text = CheckpointConfig.model_fields["save_interval"].description or ""
    assert "on CUDA writes them in the background, on CPU and megatron in the step" in help_text
    assert TorchBackend(tiny_llama(tmp_path / "tiny")).checkpoint_snapshot({}) is None
