"""The synchronous GRPO loop end to end on a tiny random Llama: the reward rises within a
few steps, the engine follows the trainer's weights, and samples carry weight versions."""

from __future__ import annotations

import itertools
import shutil
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from agentenv import (
    ChatTokenizer,
    ConfigError,
    Rubric,
    Sample,
    SamplingParams,
    SingleTurnEnv,
    State,
    Task,
)
from agentenv.engine import Engine, resolve_model
from trainer import EmbeddedEngine, GRPOConfig, LossConfig, OptimConfig, TorchBackend, run_grpo

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]


ACTIVE = range(1000, 1016)  # the tokens a tiny model says; the first half is rewarded
GOOD = range(1000, 1008)


def tiny_llama(directory: Path, *, hidden: int = 32) -> Path:
    """A 2-layer random Llama with SmolLM2's tokenizer (49,152 ids) whose output layer
    speaks almost only the 16 ACTIVE tokens, so a policy over them can be learnt fast."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=hidden, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        head = model.lm_head.weight
        head.zero_()
        head[ACTIVE.start : ACTIVE.stop] = 3 * torch.randn(len(ACTIVE), head.shape[1])
    model.save_pretrained(directory, safe_serialization=True)
    source = resolve_model("smollm2-135m")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, directory / name)
    return directory


def good_tokens(task: Task, state: State) -> float:
    """The share of completion tokens among GOOD: about 0.5 for the untrained model."""
    ids = state.transcript.current.completion_ids
    return sum(1 for t in ids if t in GOOD) / max(len(ids), 1)


class GoodTokensEnv(SingleTurnEnv):
    name = "good_tokens"
    rubric = Rubric(good_tokens)

    def tasks(self, split: str = "train") -> list[Task]:
        return [Task(id=f"t{i}", prompt=f"Say something, {i}.") for i in range(8)]


def test_reward_rises_and_the_engine_follows(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "tiny")
    tokenizer = ChatTokenizer.load(model)
    env = GoodTokensEnv()
    backend = TorchBackend(
        model, optim=OptimConfig(lr=1e-2, grad_clip=1.0), loss=LossConfig(eps_clip=0.2)
    )
    config = GRPOConfig(
        num_rollout=10, rollout_batch_size=4, n_samples_per_prompt=8,
        sampling=SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True),
    )  # fmt: skip

    async def go() -> list[dict[str, float]]:
        async with Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as e:
            history = await run_grpo(
                env, env.tasks(), backend, EmbeddedEngine(e), tokenizer, config
            )
            # The engine serves the trainer's weights: same log-probs for one sample.
            c = await e.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=1.0))
            assert c.weight_version == str(config.num_rollout)
            sample = Sample(prompt_ids=[1, 2, 3], completion_ids=c.output_ids, reward=0.0)
            mine = backend.logprobs([sample])[0]
            want = torch.tensor(c.logprobs, dtype=torch.float64)
            assert torch.allclose(mine.double(), want, atol=1e-4), (mine, want)
            return history

    history = anyio.run(go)
    first = sum(h["reward_mean"] for h in history[:2]) / 2
    last = sum(h["reward_mean"] for h in history[-2:]) / 2
    assert last > first + 0.1, [round(h["reward_mean"], 3) for h in history]
    assert history[0]["train/ratio_max"] == 1.0
    # On CPU the engine gave its memory (pool and weights) back for every step's training
    # (a step whose groups all had equal rewards trains nothing, and keeps it), and the
    # sync loaded the new weights: the engine followed all the same.
    trained = list(itertools.accumulate(int("train/loss" in h) for h in history))
    assert [h["rollout/engine_memory_releases"] for h in history] == trained
    assert trained[-1] >= 2 and all(
        h["rollout/zero_std_groups"] == 1.0 for h in history if h["train/skipped_no_gradient"]
    )
    phases = ("time_rollout_s", "time_train_s", "time_wait_s", "time_sync_s")
    for h in history:  # every step syncs the weights, and its phases make up the step
        assert 0 < h["time_sync_s"] < h["time_step_s"]
        assert sum(h[p] for p in phases) == pytest.approx(h["time_step_s"])


def test_the_batch_identity_is_checked_before_anything_starts() -> None:
    with pytest.raises(ConfigError, match=r"\(8\) x .*\(4\) = 32.*\(30\) x .*\(1\) = 30"):
        GRPOConfig(rollout_batch_size=8, n_samples_per_prompt=4, global_batch_size=30)
    with pytest.raises(ConfigError, match="--advantage-estimator: Input should be 'grpo'"):
        GRPOConfig(advantage_estimator="gae")


def test_agentenv_train_cli_runs_saves_and_reports(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    model = tiny_llama(tmp_path / "tiny")

    def train(steps: int, run: str = "run", *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentenv", "train",
             "--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint", str(model),
             "--num-rollout", str(steps), "--rollout-batch-size", "4",
             "--n-samples-per-prompt", "4", "--rollout-max-response-len", "8", "--n-eval", "4",
             "--lr", "1e-2", "--save", str(tmp_path / run), "--json", *extra],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    out = train(3)
    assert out.returncode == 0, out.stderr[-2000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["steps"] == 3 and summary["eval_tasks"] == 4
    assert summary["eval_reward_after"] > summary["eval_reward_before"]
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
    assert (tmp_path / "run" / "model" / "model.safetensors").exists()
    assert "step 3/3  reward" in out.stderr
    # The final model and the last checkpoint's are the same weights, held once on disk.
    weights = [tmp_path / "run" / d / "model.safetensors" for d in ("model", "checkpoint/model")]
    assert weights[0].stat().st_ino == weights[1].stat().st_ino
    # The same command with more steps resumes after the checkpoint of step 3.
    out = train(4)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "step 4/4" in out.stderr and "step 1/4" not in out.stderr
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2, 3]
    recorded = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert recorded == json.loads(out.stdout.splitlines()[-1])
    # Once more: the run is complete. It says so, evaluates nothing, trains nothing, and
    # prints the result it recorded.
    out = train(4)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"the run in {tmp_path / 'run'} is complete: 4 steps trained" in out.stderr
    assert "held-out reward before" not in out.stderr and "step 4/4" not in out.stderr
    assert json.loads(out.stdout.splitlines()[-1]) == recorded
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 4
    # --keep-checkpoints 0: once complete only the model and the result stay; such a run
    # cannot be continued, and says why.
    out = train(1, "bare", "--keep-checkpoints", "0")
    assert out.returncode == 0, out.stderr[-2000:]
    assert {p.name for p in (tmp_path / "bare").iterdir()} >= {"model", "summary.json"}
    assert not (tmp_path / "bare" / "checkpoint").exists()
    out = train(2, "bare")
    assert out.returncode == 2 and "kept no checkpoint to continue from" in out.stderr


def test_a_run_stopped_and_resumed_continues_as_if_never_interrupted(tmp_path: Path) -> None:
    model = tiny_llama(tmp_path / "tiny")
    tokenizer = ChatTokenizer.load(model)
    env = GoodTokensEnv()

    def config(steps: int) -> GRPOConfig:
        return GRPOConfig(
            num_rollout=steps, rollout_batch_size=4, n_samples_per_prompt=4, concurrency=1,
            sampling=SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True),
        )  # fmt: skip

    def run(steps: int, checkpoint: Path | None) -> tuple[list[float], dict[str, torch.Tensor]]:
        torch.manual_seed(0)
        backend = TorchBackend(model, optim=OptimConfig(lr=3e-3))

        async def go() -> list[dict[str, float]]:
            async with Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as e:
                return await run_grpo(
                    env,
                    env.tasks(),
                    backend,
                    EmbeddedEngine(e),
                    tokenizer,
                    config(steps),
                    checkpoint=checkpoint,
                )

        history = anyio.run(go)
        return [h["reward_mean"] for h in history], backend.state_dict()

    straight, final = run(4, None)
    first_half, _ = run(2, tmp_path / "ckpt")  # stops after step 2 (as if killed there)
    second_half, resumed = run(4, tmp_path / "ckpt")  # finds the checkpoint: steps 3-4
    assert len(second_half) == 2
    assert first_half + second_half == pytest.approx(straight, abs=1e-9)
    for name, tensor in final.items():
        assert torch.allclose(resumed[name], tensor, atol=1e-6), name
    bad = GRPOConfig(rollout_batch_size=2, n_samples_per_prompt=4, num_rollout=5)

    async def resume_changed() -> None:
        async with Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as e:
            backend = TorchBackend(model)
            await run_grpo(
                env,
                env.tasks(),
                backend,
                EmbeddedEngine(e),
                tokenizer,
                bad,
                checkpoint=tmp_path / "ckpt",
            )

    with pytest.raises(ConfigError, match="another schedule"):
        anyio.run(resume_changed)


def test_a_checkpoint_of_another_model_is_refused(tmp_path: Path) -> None:
    a = TorchBackend(tiny_llama(tmp_path / "a"))
    a.save_checkpoint(tmp_path / "ckpt", {"step": 0})
    b = TorchBackend(tiny_llama(tmp_path / "b", hidden=48))
    with pytest.raises(ConfigError, match=r"another model .*hidden_size': \(32, 48\)"):
        b.load_checkpoint(tmp_path / "ckpt")
    with pytest.raises(ConfigError, match="is not a trainer checkpoint"):
        b.load_checkpoint(tmp_path / "nowhere")


def test_kl_to_a_frozen_reference_several_steps_per_rollout_and_evaluation(
    tmp_path: Path,
) -> None:
    model = tiny_llama(tmp_path / "tiny")
    tokenizer = ChatTokenizer.load(model)
    env = GoodTokensEnv()
    backend = TorchBackend(
        model,
        optim=OptimConfig(lr=1e-2),
        loss=LossConfig(use_kl_loss=True, kl_loss_coef=0.1, kl_type="k3"),
    )
    config = GRPOConfig(
        num_rollout=2, rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=8,
        num_steps_per_rollout=2,
        sampling=SamplingParams(max_new_tokens=6, temperature=1.0, ignore_eos=True),
    )  # fmt: skip
    evaluations = 0

    async def go() -> list[dict[str, float]]:
        async with Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as e:

            async def evaluate() -> float:
                nonlocal evaluations
                evaluations += 1
                return 0.5

            return await run_grpo(
                env, env.tasks(), backend, EmbeddedEngine(e), tokenizer, config,
                evaluate=evaluate, eval_interval=1,
            )  # fmt: skip

    history = anyio.run(go)
    assert evaluations == 2 and all(h["eval/reward_mean"] == 0.5 for h in history)
    # The second optimizer step of a rollout sees a policy that already moved: the ratio
    # departs from 1, and the KL to the frozen starting model grows from 0.
    assert history[0]["train/ratio_max"] > 1.0 or history[0]["train/ratio_min"] < 1.0
    assert history[1]["train/kl"] > 0
    assert backend.reference is not None
    with pytest.raises(ConfigError, match="no reference model"):
        TorchBackend(model).logprobs([], reference=True)


def test_train_at_rollout_temperature_0_7_scores_the_distribution_it_sampled(
    tmp_path: Path,
) -> None:
    """``--rollout-temperature 0.7``: the trainer's log-probs are of softmax(logits / 0.7),
    as the engine's are, so the first step's ratio is exactly 1 and the trainer-vs-rollout
    difference is float noise (at T = 1 it would be whole nats on this model)."""
    import json
    import subprocess
    import sys

    model = tiny_llama(tmp_path / "tiny")
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "train",
         "--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint", str(model),
         "--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
         "--rollout-max-response-len", "8", "--rollout-temperature", "0.7", "--n-eval", "0",
         "--use-tis", "--save", str(tmp_path / "run"), "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (line,) = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    first = json.loads(line)
    assert first["train/ratio_max"] == 1.0 and first["train/ratio_min"] == 1.0
    assert first["train/rollout_train_logprob_abs_diff"] <= 1e-4
    assert abs(first["train/tis_weight"] - 1.0) <= 1e-3


def test_the_loop_hands_the_backend_the_rollouts_temperature(tmp_path: Path) -> None:
    """The temperature is one setting, the rollouts': every log-prob the loop asks the
    backend for (the old policy's, the reference's, the step's) is at it."""
    model = tiny_llama(tmp_path / "tiny")
    tokenizer = ChatTokenizer.load(model)
    config = GRPOConfig(
        num_rollout=1, rollout_batch_size=2, n_samples_per_prompt=2, global_batch_size=2,
        num_steps_per_rollout=2,
        sampling=SamplingParams(max_new_tokens=4, temperature=0.7, ignore_eos=True),
    )  # fmt: skip
    seen: list[float] = []

    class Asked(TorchBackend):
        def logprobs(self, samples: Any, **kw: Any) -> Any:
            seen.append(kw["temperature"])
            return super().logprobs(samples, **kw)

        def train_step(self, samples: Any, advantages: Any, **kw: Any) -> Any:
            seen.append(kw["temperature"])
            return super().train_step(samples, advantages, **kw)

    loss = LossConfig(use_kl_loss=True, kl_loss_coef=0.1)
    backend = Asked(model, optim=OptimConfig(lr=1e-3), loss=loss)
    env = GoodTokensEnv()

    async def go() -> None:
        async with Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as e:
            await run_grpo(env, env.tasks(), backend, EmbeddedEngine(e), tokenizer, config)

    anyio.run(go)
    assert len(seen) == 4 and set(seen) == {0.7}  # old, reference, two steps


def test_the_saved_model_is_a_complete_hf_directory_every_loader_takes(tmp_path: Path) -> None:
    """``train --save R`` writes ``R/model`` with the source's tokenizer, chat template,
    special tokens and generation config beside the weights: transformers, ``agentenv
    eval``, ``agentenv serve`` and ``agentenv train --hf-checkpoint`` all load it."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentenv.sglang import Launcher, SGLangClient, server_command
    from trainer._resources import free_port

    source = tiny_llama(tmp_path / "tiny")
    (source / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"})
    )

    def agentenv(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentenv", *args], capture_output=True, text=True, timeout=300
        )

    def train(model: Path, *extra: str) -> subprocess.CompletedProcess[str]:
        return agentenv(
            "train", "--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint",
            str(model), "--num-rollout", "1", "--rollout-batch-size", "2",
            "--n-samples-per-prompt", "2", "--rollout-max-response-len", "4", "--n-eval", "0",
            *extra,
        )  # fmt: skip

    out = train(source, "--save", str(tmp_path / "run"))
    assert out.returncode == 0, out.stderr[-2000:]
    saved = tmp_path / "run" / "model"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                 "generation_config.json"):  # fmt: skip
        assert (saved / name).read_bytes() == (source / name).read_bytes(), name
    assert {"config.json", "model.safetensors"} <= {p.name for p in saved.iterdir()}

    tok = AutoTokenizer.from_pretrained(saved)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == (
        ChatTokenizer.load(source).render([{"role": "user", "content": "hi"}])
    )
    assert AutoModelForCausalLM.from_pretrained(saved).config.vocab_size == 49152

    out = agentenv("eval", "--env", "tests.trainer.test_loop:GoodTokensEnv", "--model",
                   str(saved), "--n", "2", "--max-new-tokens", "4", "--json")  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1])["episodes"] == 2

    out = train(saved)
    assert out.returncode == 0, out.stderr[-2000:]

    async def serve() -> list[int]:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        command = server_command(
            str(saved), port=port, program=[sys.executable, "-m", "agentenv", "serve"]
        )
        with anyio.fail_after(180):
            async with Launcher(command, url, health_timeout=120), SGLangClient(url) as client:
                c = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=3))
                return c.output_ids

    assert len(anyio.run(serve)) == 3


def test_eval_takes_the_tokenizer_flag_for_a_model_directory_without_one(tmp_path: Path) -> None:
    """A model directory holding only weights and config runs with ``--tokenizer``."""
    import json
    import subprocess
    import sys

    model = tiny_llama(tmp_path / "tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (model / name).unlink()
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "eval", "--env", "tests.trainer.test_loop:GoodTokensEnv",
         "--model", str(model), "--tokenizer", "smollm2-135m", "--n", "2",
         "--max-new-tokens", "4", "--json"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1])["episodes"] == 2


def test_the_loop_keeps_as_many_episodes_in_flight_as_the_engine_decodes(
    tmp_path: Path,
) -> None:
    model = tiny_llama(tmp_path / "tiny")
    tokenizer = ChatTokenizer.load(model)
    env = GoodTokensEnv()
    backend = TorchBackend(model, optim=OptimConfig(lr=1e-3))
    # 96 episodes a round, more than the 64 a fixed default would let run together.
    config = GRPOConfig(
        num_rollout=1, rollout_batch_size=8, n_samples_per_prompt=12,
        sampling=SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True),
    )  # fmt: skip

    class Counting(EmbeddedEngine):
        """The engine, counting its generate calls in flight."""

        def __init__(self, engine: Engine) -> None:
            super().__init__(engine)
            self.now = self.peak = 0

        async def generate(
            self, ids: Any, params: SamplingParams, *, rid: str | None = None
        ) -> Any:
            self.now += 1
            self.peak = max(self.peak, self.now)
            try:
                return await self.engine.generate(ids, params, rid=rid)
            finally:
                self.now -= 1

    async def go(max_running: int) -> tuple[int, dict[str, float]]:
        async with Engine(
            model, device="cpu", dtype=torch.float32, tokenizer=tokenizer, max_running=max_running
        ) as e:
            counting = Counting(e)
            history = await run_grpo(env, env.tasks(), backend, counting, tokenizer, config)
            return counting.peak, history[-1]

    for max_running in (96, 16):
        peak, metrics = anyio.run(go, max_running)
        assert peak == max_running
        assert metrics["rollout/concurrency"] == max_running
        assert metrics["rollout/peak_requests"] == max_running
        # On CPU the process's peak resident set (CUDA: the step's peak GPU memory).
        assert 0.1 < metrics["perf/peak_rss_gib"] < 64 and "perf/peak_memory_gib" not in metrics


class SameRewardEnv(GoodTokensEnv):
    """Every episode scores 1: every group's rewards are equal, every advantage is 0."""

    name = "same_reward"
    rubric = Rubric(lambda task, state: 1.0)


class CountingBackend(TorchBackend):
    """The torch backend, counting its forward passes and optimizer steps."""

    forwards = 0
    steps_run = 0

    def _forward(self, batch: Any, **kwargs: Any) -> Any:
        self.forwards += 1
        return super()._forward(batch, **kwargs)

    def train_step(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        self.steps_run += 1
        return super().train_step(*args, **kwargs)


@pytest.mark.parametrize("kl", [False, True])
def test_a_step_without_gradient_is_not_run_unless_a_kl_term_gives_one(
    tmp_path: Path, kl: bool
) -> None:
    """All groups' rewards equal: no forward, no backward, no optimizer step (AdamW's
    weight decay would have moved the weights), counted in ``train/skipped_no_gradient``;
    the weights are still synced as the step's version. With a KL penalty the loss has a
    gradient without advantages: the step runs."""
    model = tiny_llama(tmp_path / "tiny")
    tokenizer = ChatTokenizer.load(model)
    env = SameRewardEnv()
    loss = LossConfig(use_kl_loss=True, kl_loss_coef=0.1) if kl else LossConfig()
    backend = CountingBackend(model, optim=OptimConfig(lr=1e-2, weight_decay=0.1), loss=loss)
    before = {k: v.clone() for k, v in backend.state_dict().items()}
    config = GRPOConfig(
        num_rollout=2, rollout_batch_size=2, n_samples_per_prompt=4, global_batch_size=4,
        num_steps_per_rollout=2,
        sampling=SamplingParams(max_new_tokens=4, temperature=1.0, ignore_eos=True),
    )  # fmt: skip

    async def go() -> tuple[list[dict[str, float]], str | None]:
        async with Engine(model, device="cpu", dtype=torch.float32, tokenizer=tokenizer) as e:
            history = await run_grpo(
                env, env.tasks(), backend, EmbeddedEngine(e), tokenizer, config
            )
            c = await e.generate([1, 2, 3], SamplingParams(max_new_tokens=1))
            return history, c.weight_version

    history, version = anyio.run(go)
    assert version == "2"  # synced after every step, skipped or not
    assert all(h["rollout/zero_std_groups"] == 1.0 for h in history)
    after = backend.state_dict()
    if kl:
        assert [h["train/skipped_no_gradient"] for h in history] == [0.0, 0.0]
        assert backend.steps_run == 4 and backend.forwards > 0
        assert any(not torch.equal(after[k], v) for k, v in before.items())
    else:
        assert [h["train/skipped_no_gradient"] for h in history] == [2.0, 2.0]
        assert backend.steps_run == 0 and backend.forwards == 0
        assert all(torch.equal(after[k], v) for k, v in before.items())
        assert all("train/loss" not in h and h["perf/train_tokens_per_s"] == 0 for h in history)
