"""The loop's schedules (one-step-off, async with a staleness bound), weight sync to a server
through /update_weights_from_disk, over-sampling with a dynamic-sampling filter, and the
training CLI's config file, rollout engines and reports -- on a tiny random Llama."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentenv import (
    ChatTokenizer,
    ConfigError,
    Game,
    GameEnv,
    Message,
    Rubric,
    Sample,
    SamplingParams,
    State,
    Task,
)
from agentenv.engine import Engine, EngineServer
from agentenv.sglang import SGLangClient
from tests.trainer.test_loop import GoodTokensEnv, good_tokens, tiny_llama
from trainer import (
    Backend,
    DiskSync,
    EmbeddedEngine,
    GRPOConfig,
    InProcessSync,
    LossConfig,
    OptimConfig,
    ServerEngine,
    TorchBackend,
    run_grpo,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

SAMPLING = SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


class Recording(TorchBackend):
    """Remembers what every optimizer step trained on."""

    trained: list[list[Sample]]
    advantages: list[list[float]]

    def train_step(
        self, samples: Sequence[Sample], advantages: Any, *args: Any, **kw: Any
    ) -> dict[str, float]:
        self.trained = [*getattr(self, "trained", []), list(samples)]
        self.advantages = [*getattr(self, "advantages", []), [float(a) for a in advantages]]
        return super().train_step(samples, advantages, *args, **kw)


class _Scored:
    """Counts the episodes scored; ``reached`` is set once ``wanted`` of them were."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.reset(0)

    def reset(self, wanted: int) -> None:
        self.n, self.wanted, self.reached = 0, wanted, threading.Event()
        if wanted <= 0:
            self.reached.set()

    def add(self) -> None:
        with self.lock:
            self.n += 1
            if self.n >= self.wanted:
                self.reached.set()


SCORED = _Scored()


def _counted(task: Task, state: State) -> float:
    SCORED.add()  # (rewards are scored in worker threads)
    return good_tokens(task, state)


class CountingEnv(GoodTokensEnv):
    """Scores as :class:`GoodTokensEnv` and counts the episodes it scored."""

    rubric = Rubric(_counted)


def run(
    model: Path, config: GRPOConfig, backend: TorchBackend, *, hold_first_sync: int = 0
) -> list[dict[str, float]]:
    """The loop on an embedded engine; with ``hold_first_sync``, the weights of step 0 reach
    the engine only once that many episodes have been scored."""
    tokenizer = ChatTokenizer.load(model)
    SCORED.reset(hold_first_sync)

    async def go() -> list[dict[str, float]]:
        async with Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as e:
            push = InProcessSync(e)

            async def sync(backend: Backend, version: int) -> None:
                if version == 1:  # (the test's timeout bounds the wait)
                    await anyio.to_thread.run_sync(SCORED.reached.wait, abandon_on_cancel=True)
                await push(backend, version)

            env = CountingEnv()
            return await run_grpo(
                env, env.tasks(), backend, EmbeddedEngine(e), tokenizer, config, sync=sync
            )

    return anyio.run(go)


def test_one_step_off_trains_on_samples_one_version_behind(model: Path) -> None:
    backend = Recording(model, optim=OptimConfig(lr=1e-2), loss=LossConfig(use_tis=True))
    config = GRPOConfig(
        num_rollout=4, rollout_batch_size=4, n_samples_per_prompt=4, sampling=SAMPLING,
        schedule="one_step_off",
    )  # fmt: skip
    history = run(model, config, backend)
    assert len(history) == 4
    # Step k trains on a rollout made with the weights of step k - 1 (version k - 1 after
    # the first): exactly one version behind, never more. (A step whose groups all have
    # equal rewards trains nothing: what every step's batch held is in its metrics.)
    versions = [{v for s in batch for v in s.weight_versions} for batch in backend.trained]
    assert versions[:2] == [{"0"}, {"0"}] and all(len(v) == 1 for v in versions)
    assert [h["rollout/weight_version_min"] for h in history] == [0, 0, 1, 2]
    assert [h["rollout/staleness_max"] for h in history] == [0, 1, 1, 1]
    # The trainer's old log-probs are its own (the ratio starts at 1); the sampling
    # policy's differ from them once the samples lag a version behind (TIS corrects it).
    diff = [h["train/rollout_train_logprob_abs_diff"] for h in history[:2]]
    assert diff[0] <= 1e-4 and diff[1] > 1e-3, diff
    assert all(h["samples"] == 16 for h in history)


def test_async_keeps_every_batch_within_the_staleness_bound(model: Path) -> None:
    backend = Recording(model, optim=OptimConfig(lr=1e-2))
    config = GRPOConfig(
        num_rollout=5, rollout_batch_size=2, n_samples_per_prompt=4, sampling=SAMPLING,
        schedule="async", max_staleness=1, concurrency=4,
    )  # fmt: skip
    # Step 0's weights reach the engine only once a group more than its batch was scored:
    # the producer ran ahead of the trainer, as it does whenever training takes longer.
    history = run(model, config, backend, hold_first_sync=8 + 4)
    assert len(history) == 5 and all(h["samples"] == 8 for h in history)
    for step, batch in enumerate(backend.trained):
        oldest = min(int(v) for s in batch for v in s.weight_versions)
        assert step - oldest <= 1, (step, oldest)
    # What was sampled ahead with step 0's weights was trained one version behind.
    assert [h["rollout/staleness_max"] for h in history][:2] == [0, 1]
    # Several rounds at once, but never more requests than the engines take together.
    assert max(h["rollout/peak_requests"] for h in history) == 4


def test_over_sampling_and_a_dynamic_filter_train_only_kept_groups(model: Path) -> None:
    backend = Recording(model, optim=OptimConfig(lr=1e-3))

    def odd_tasks(samples: Sequence[Sample]) -> bool:
        return int((samples[0].task_id or "t0")[1:]) % 2 == 1

    config = GRPOConfig(
        num_rollout=3, rollout_batch_size=2, n_samples_per_prompt=2, sampling=SAMPLING,
        over_sampling_batch_size=4, filters=[odd_tasks],
    )  # fmt: skip
    history = run(model, config, backend)
    trained = [s.task_id for batch in backend.trained for s in batch]
    assert trained and all(int((t or "")[1:]) % 2 == 1 for t in trained)
    assert all(h["samples"] == 4 for h in history)  # two kept groups of two every step
    assert sum(h["rollout/prompts"] for h in history) >= 3 * 4


def test_the_learning_rate_follows_the_planned_steps_when_filters_shrink_batches(
    model: Path,
) -> None:
    optim = OptimConfig(lr=1e-2, min_lr=1e-3, lr_decay_style="linear", lr_decay_iters=16)
    backend = Recording(model, optim=optim)

    def odd_tasks(samples: Sequence[Sample]) -> bool:
        return int((samples[0].task_id or "t0")[1:]) % 2 == 1

    # Four planned updates per rollout step; one round per step (max_rounds), so a step
    # trains on the kept groups of two samples each: four updates, two or none.
    config = GRPOConfig(
        num_rollout=4, rollout_batch_size=2, n_samples_per_prompt=2, sampling=SAMPLING,
        global_batch_size=1, num_steps_per_rollout=4, filters=[odd_tasks], max_rounds=1,
    )  # fmt: skip
    history = run(model, config, backend)
    for step, h in enumerate(history):
        if h["samples"]:
            updates = int(h["samples"])  # one sample each
            assert h["train/lr"] == pytest.approx(optim.lr_at(step * 4 + updates - 1))
    # Counted by updates taken, the decay would lag: fewer than 16 were taken.
    assert backend.steps < 16


def test_weights_reach_a_server_through_update_weights_from_disk(
    model: Path, tmp_path: Path
) -> None:
    tokenizer = ChatTokenizer.load(model)
    backend = TorchBackend(model, optim=OptimConfig(lr=1e-2))
    config = GRPOConfig(num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=4,
                        sampling=SAMPLING)  # fmt: skip

    async def go() -> None:
        async with (
            Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as engine,
            EngineServer(engine) as server,
            SGLangClient(server.url) as client,
        ):
            sync = DiskSync([client], tmp_path / "weights")
            history = await run_grpo(GoodTokensEnv(), GoodTokensEnv().tasks(), backend,
                                     ServerEngine(client, sync), tokenizer, config)  # fmt: skip
            assert len(history) == 2 and history[-1]["time_sync_s"] > 0
            assert await client.weight_version() == "2"
            # Only the newest weights stay on disk.
            assert [p.name for p in (tmp_path / "weights").iterdir()] == ["step_2"]
            # The server generates with the trainer's weights: same log-probs.
            c = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
            sample = Sample(prompt_ids=[1, 2, 3], completion_ids=c.output_ids, reward=0.0)
            mine = backend.logprobs([sample])[0].double()
            assert torch.allclose(mine, torch.tensor(c.logprobs, dtype=torch.float64), atol=1e-4)

    anyio.run(go)


def _train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "agentenv", "train", *args],
        capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_agentenv_train_with_a_config_file_a_served_engine_and_tensorboard(
    model: Path, tmp_path: Path
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = tmp_path / "run.yaml"
    config.write_text(
        "env: tests.trainer.test_loop:GoodTokensEnv\n"
        f"hf-checkpoint: {model}\n"
        "num_rollout: 3\nrollout_batch_size: 2\nn_samples_per_prompt: 4\n"
        "rollout_max_response_len: 6\nn_eval: 2\nlr: 1.0e-2\n"
        "lr_decay_style: linear\nmin_lr: 1.0e-3\nschedule: one_step_off\n"
    )
    out = _train("--config", str(config), "--rollout-engine", "serve", "--num-rollout", "4",
                 "--save", str(tmp_path / "run"), "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["steps"] == 4 and summary["schedule"] == "one_step_off"  # flag > file
    assert "agentenv serve --model-path" in out.stderr
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [m["train/lr"] for m in metrics]
    assert lrs[0] == pytest.approx(1e-2) and lrs == sorted(lrs, reverse=True)
    assert lrs[-1] == pytest.approx(1e-3 + (1e-2 - 1e-3) / 4)
    events = EventAccumulator(str(tmp_path / "run" / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("reward_mean")] == [0, 1, 2, 3]
    assert "time_sync_s" in events.Tags()["scalars"]
    assert (tmp_path / "run" / "metrics.png").exists()
    assert not (tmp_path / "run" / "weights").exists()  # the sync directories are gone


def test_a_served_engine_on_the_trainers_device_gets_the_weights_by_handle(
    model: Path, tmp_path: Path
) -> None:
    out = _train(
        "--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint", str(model),
        "--rollout-engine", "serve", "--weight-sync", "tensor", "--num-rollout", "3",
        "--rollout-batch-size", "2", "--n-samples-per-prompt", "2",
        "--rollout-max-response-len", "4", "--n-eval", "0", "--save", str(tmp_path / "run"),
        "--json",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "/update_weights_from_tensor" in out.stderr
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Each step's samples came from the weights of the step before (the sync schedule).
    assert [m["rollout/staleness_max"] for m in metrics] == [0.0, 0.0, 0.0]
    assert [m["rollout/weight_version_min"] for m in metrics] == [0.0, 1.0, 2.0]
    assert all(m["time_sync_s"] > 0 for m in metrics)
    assert not (tmp_path / "run" / "weights").exists()  # nothing went through the disk


def test_agentenv_train_refuses_bad_settings_before_loading_anything(
    model: Path, tmp_path: Path
) -> None:
    base = ["--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint", str(model)]
    out = _train(*base, "--sglang-mem-fraction-static", "0.5")
    assert out.returncode == 2 and "need --rollout-engine sglang" in out.stderr
    out = _train(*base, "--backend", "megatron")  # megatron-core is not installed here
    assert out.returncode == 2 and "pip install 'agentenv[megatron]'" in out.stderr
    out = _train(*base, "--rollout-batch-size", "9", "--n-samples-per-prompt", "2")
    assert out.returncode == 2 and "but there are only 8 distinct tasks" in out.stderr
    assert "held-out reward before" not in out.stderr  # refused before the evaluation
    out = _train(*base, "--tensor-model-parallel-size", "2")
    assert out.returncode == 2 and "need --backend megatron" in out.stderr
    out = _train(*base, "--backend", "megatron", "--tensor-parallel", "2")
    assert out.returncode == 2 and "did you mean --tensor-model-parallel-size?" in out.stderr
    out = _train(*base, "--backend", "megatron", "--actor-num-gpus-per-node", "3",
                 "--tensor-model-parallel-size", "2")  # fmt: skip
    assert out.returncode == 2 and "world size 3 is not a multiple of TP" in out.stderr
    out = _train(*base, "--rollout-num-gpus", "3", "--rollout-num-gpus-per-engine", "2",
                 "--rollout-engine", "sglang")  # fmt: skip
    assert out.returncode == 2 and "not a multiple of --rollout-num-gpus-per-engine" in out.stderr
    out = _train(*base, "--qkv-format", "thd")
    assert out.returncode == 2 and "--qkv-format thd needs --backend megatron" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "eval", "--env", "x", "--model", "y", "--bogus"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "unknown flag --bogus" in out.stderr
    out = _train(*base, "--rollout-batch-size", "8", "--over-sampling-batch-size", "4")
    assert out.returncode == 2 and "--over-sampling-batch-size (4) must be at least" in out.stderr
    out = _train(*base, "--dynamic-sampling-filter-path", "nowhere.filter")
    assert out.returncode == 2 and "No module named 'nowhere'" in out.stderr
    bad = tmp_path / "bad.toml"
    bad.write_text('env = "arithmetic"\nlearning_rate = 1.0\n')
    out = _train("--config", str(bad))
    assert out.returncode != 0 and "unknown setting 'learning_rate'" in out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "eval", "--env", "arithmetic", "--model", "x",
         "--sglang-tp", "2"], capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert out.returncode == 2 and "not by 'eval'" in out.stderr


class Duel(Game):
    """Each of two players says something once; the longer text wins (zero-sum)."""

    name = "duel"
    roles = ("a", "b")

    def reset(self, seed: int) -> None:
        self.said: list[str] = []

    def current_role(self) -> str | None:
        return self.roles[len(self.said)] if len(self.said) < 2 else None

    def observation(self, role: str) -> list[Message]:
        return [{"role": "user", "content": f"You are {role}. Say something."}]

    def parse(self, text: str) -> str:
        return text

    def apply(self, action: str) -> None:
        self.said.append(action)

    def returns(self) -> dict[str, float]:
        a, b = (len(t) for t in self.said)
        win = 1.0 if a > b else -1.0 if a < b else 0.0
        return {"a": win, "b": -win}


def test_self_play_trains_each_role_against_its_own_baseline(model: Path) -> None:
    env = GameEnv(Duel, n_train=4, n_test=1)
    tokenizer = ChatTokenizer.load(model)
    backend = Recording(model, optim=OptimConfig(lr=1e-3))
    config = GRPOConfig(num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=4,
                        sampling=SAMPLING)  # fmt: skip

    async def go() -> None:
        async with Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as e:
            await run_grpo(env, env.tasks(), backend, EmbeddedEngine(e), tokenizer, config)

    anyio.run(go)
    uncentred = 0
    for samples, adv in zip(backend.trained, backend.advantages, strict=True):
        # Every step trains both seats of its 2 prompts: 2 x 4 episodes x 2 roles.
        assert len(samples) == 16 and {s.role for s in samples} == {"a", "b"}
        groups: dict[tuple[str | None, str | None], list[tuple[float, float]]] = {}
        for sample, a in zip(samples, adv, strict=True):
            groups.setdefault((sample.group_id, sample.role), []).append((sample.reward, a))
        assert len(groups) == 4
        for members in groups.values():
            # Each (prompt, role) group is centred on its own mean reward ...
            assert abs(sum(a for _, a in members)) < 1e-5, members
            # ... which is not the prompt's (0 in a zero-sum game) when one seat won more.
            uncentred += abs(sum(r for r, _ in members)) > 0
    assert uncentred > 0


def _odd(samples: Sequence[Sample]) -> bool:
    return int((samples[0].task_id or "t0")[1:]) % 2 == 1


@pytest.mark.parametrize(
    ("schedule", "max_staleness", "over"),
    [("async", 0, None), ("async", 1, 6), ("sync", 1, 6), ("one_step_off", 1, None)],
)
def test_schedules_finish_when_filters_drop_groups(
    model: Path, schedule: str, max_staleness: int, over: int | None
) -> None:
    backend = Recording(model, optim=OptimConfig(lr=1e-3))
    config = GRPOConfig(
        num_rollout=3, rollout_batch_size=2, n_samples_per_prompt=2, sampling=SAMPLING,
        schedule=schedule, max_staleness=max_staleness,  # type: ignore[arg-type]
        over_sampling_batch_size=over, filters=[_odd],
    )  # fmt: skip

    history = run(model, config, backend)
    assert len(history) == 3
    trained = [s.task_id for batch in backend.trained for s in batch]
    assert trained and all(int((t or "")[1:]) % 2 == 1 for t in trained)
    assert all(h["rollout/staleness_max"] <= max(max_staleness, 1) for h in history)


def test_async_stops_with_a_clear_error_when_nothing_is_ever_kept(model: Path) -> None:
    config = GRPOConfig(
        num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=2, sampling=SAMPLING,
        schedule="async", filters=[lambda samples: False], max_rounds=2,
    )  # fmt: skip
    with pytest.raises(ConfigError, match="2 rounds in a row kept no group"):
        run(model, config, TorchBackend(model))
