"""The training settings that need no model: learning-rate schedules, the task stream's
saved position, filter paths, the raw (no chat template) rendering, config files and the
SGLang flag pass-through."""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import anyio
import pytest

from agentenv import (
    ChatTokenizer,
    ConfigError,
    Rubric,
    SamplingParams,
    ScriptedModel,
    SingleTurnEnv,
    Task,
)
from agentenv._scripted import ScriptContext
from agentenv.buffer import Buffer
from trainer import GRPOConfig, OptimConfig, TrainConfig
from trainer.config._rollout import load_filter
from trainer.run._flags import add_train_arguments, config_from_args
from trainer.run._producer import Producer, TaskStream
from trainer.run._setup import RAW_TEMPLATE


def test_learning_rate_schedules() -> None:
    const = OptimConfig(lr=1.0)
    assert [const.lr_at(k) for k in (0, 5, 100)] == [1.0, 1.0, 1.0]
    warm = OptimConfig(lr=1.0, lr_warmup_iters=4)
    assert [warm.lr_at(k) for k in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    linear = OptimConfig(lr=1.0, min_lr=0.2, lr_decay_style="linear", lr_decay_iters=4)
    assert [linear.lr_at(k) for k in range(6)] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2, 0.2])
    cosine = OptimConfig(lr=1.0, lr_decay_style="cosine", lr_decay_iters=10, lr_warmup_iters=2)
    assert cosine.lr_at(2) == 1.0 and cosine.lr_at(6) == pytest.approx(
        0.5 + 0.5 * math.cos(0.5 * math.pi)
    )
    assert cosine.lr_at(10) == pytest.approx(0.0) and cosine.lr_at(50) == pytest.approx(0.0)
    with pytest.raises(ConfigError, match="--lr-decay-style: Input should be 'constant', "):
        OptimConfig(lr_decay_style="step")
    with pytest.raises(
        ConfigError, match="--optimizer: Input should be 'adam' or 'sgd', got 'lion'"
    ):
        OptimConfig(optimizer="lion")
    with pytest.raises(ConfigError, match=r"--min-lr \(0.001\) must be <= --lr \(1e-06\)"):
        OptimConfig(lr=1e-6, min_lr=1e-3)


def test_the_task_stream_restores_its_position() -> None:
    tasks = [Task(id=f"t{i}", prompt="x") for i in range(5)]
    a = TaskStream(tasks, seed=3, shuffle=True)
    a.take(3)
    saved = a.state()
    rest = [t.id for t in a.take(7)]
    b = TaskStream(tasks, seed=99, shuffle=True)
    b.restore(saved)
    assert [t.id for t in b.take(7)] == rest
    ordered = TaskStream(tasks, seed=0, shuffle=False)
    assert [t.id for t in ordered.take(4)] == ["t0", "t1", "t2", "t3"]
    # A batch never holds a task twice, and asking for more tasks than exist gives all.
    assert sorted(t.id for t in ordered.take(3)) == ["t0", "t1", "t4"]
    assert len(ordered.take(50)) == 5


def test_filter_paths() -> None:
    from agentenv.buffer import RewardStdFilter

    assert isinstance(load_filter("agentenv.buffer.RewardStdFilter"), RewardStdFilter)
    assert load_filter("math:isfinite") is math.isfinite
    with pytest.raises(ConfigError, match="expected module:function"):
        load_filter("nodots")
    with pytest.raises(ConfigError, match="has no attribute 'nope'"):
        load_filter("math.nope")
    with pytest.raises(ConfigError, match="is not callable"):
        load_filter("math:pi")


def test_without_the_chat_template_prompts_are_raw_text(smollm2: ChatTokenizer) -> None:
    raw = smollm2.with_template(RAW_TEMPLATE)
    msgs = [{"role": "user", "content": "2 + 2 ="}]
    assert raw.render(msgs, add_generation_prompt=True) == "2 + 2 ="
    assert "<|im_start|>" in smollm2.render(msgs, add_generation_prompt=True)


class Answer(SingleTurnEnv):
    rubric = Rubric(lambda task, state: 1.0)


def test_template_arguments_reach_the_rounds_prompts(thinking: ChatTokenizer) -> None:
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    argv = ["--env", "x", "--apply-chat-template-kwargs", '{"enable_thinking": false}']
    config = config_from_args(parser.parse_args(argv))
    assert config.rollout.chat_template_kwargs == {"enable_thinking": False}
    with pytest.raises(ConfigError, match="may not set 'tools'"):
        GRPOConfig(chat_template_kwargs={"tools": []})
    prompts: list[str] = []

    def answer(ctx: ScriptContext) -> str:
        prompts.append(ctx.text)
        return "4"

    tasks = [Task(id="a", prompt="2+2?")]

    async def play() -> None:
        with anyio.fail_after(60):
            await play_one()

    async def play_one() -> None:
        async with Buffer() as buffer:
            producer = Producer(
                Answer(), TaskStream(tasks, seed=0, shuffle=False),
                ScriptedModel(thinking, answer), thinking, buffer, config.rollout.model_copy(
                    update={"rollout_batch_size": 1, "n_samples_per_prompt": 1}
                ), concurrency=1,
            )  # fmt: skip
            assert await producer.play(tasks, seed=0) == 1

    anyio.run(play)
    assert prompts and prompts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def _parse(tmp_path: Path, text: str, suffix: str, *argv: str) -> TrainConfig:
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    return config_from_args(parser.parse_args(["--config", str(path), *argv]))


def test_config_files_in_three_formats_and_flags_override(tmp_path: Path) -> None:
    yaml = _parse(
        tmp_path, "env: arithmetic\nnum-rollout: 7\nlr: 3.0e-6\n", ".yaml", "--lr", "1e-5"
    )
    assert (yaml.data.env, yaml.rollout.num_rollout, yaml.optimizer.lr) == ("arithmetic", 7, 1e-5)
    toml = _parse(
        tmp_path,
        'env = "x"\nschedule = "async"\nrollout_engine = "sglang"\nsglang_args = ["--tp", "2"]\n',
        ".toml",
    )
    assert toml.rollout.schedule == "async" and toml.engine.sglang_args == ["--tp", "2"]
    assert (
        _parse(tmp_path, '{"env": "x", "rollout_shuffle": false}', ".json").rollout.shuffle is False
    )
    # The nested form, by group, mixed with the flat one; switches as true/false.
    nested = _parse(
        tmp_path,
        "data: {env: x}\nrollout: {rollout_batch_size: 2, sampling: {temperature: 0.5}}\n"
        "algorithm: {eps_clip_high: 0.28}\nn-samples-per-prompt: 2\n"
        "calculate_per_token_loss: true\n",
        ".yaml",
        "--eps-clip-c", "3",
    )  # fmt: skip
    assert (nested.rollout.rollout_batch_size, nested.rollout.n_samples_per_prompt) == (2, 2)
    assert nested.algorithm.clip_high == 0.28 and nested.algorithm.dual_clip == 3.0
    assert nested.algorithm.aggregation == "per_token"
    # The rollouts' temperature (the log-probs' too); the decay spans the run.
    assert nested.rollout.sampling.temperature == 0.5
    assert nested.optimizer.lr_decay_iters == nested.rollout.num_rollout


@pytest.mark.parametrize(
    ("text", "suffix", "message"),
    [
        ("env: x\nlearning_rate: 1\n", ".yaml", "unknown setting 'learning_rate'"),
        ("env: x\nrollout_batch: 1\n", ".yaml", "did you mean 'rollout_batch_size'?"),
        (
            "env: x\nrollout: {lr: 1}\n",
            ".yaml",
            "rollout.lr: Extra inputs are not permitted, got 1",
        ),
        ("env: x\nrm_type: deepscalar\n", ".yaml", "--rm-type 'deepscalar' is not a reward"),
        ("env: [unclosed\n", ".yaml", "does not parse"),
        ("- a\n- b\n", ".yaml", "must hold a mapping"),
        ("env=x", ".ini", "expected a .yaml, .yml, .json or .toml file"),
        ("num_rollout: 3\n", ".yaml", "--env NAME or --prompt-data FILE is required"),
    ],
)
def test_bad_config_files_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, suffix: str, message: str
) -> None:
    from agentenv.cli import main

    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    try:
        code = main(["train", "--config", str(path), "--dry-run"])
    except SystemExit as e:  # the file does not read: refused like a bad flag
        code = int(str(e.code))
    assert code == 2 and message in capsys.readouterr().err


def test_sglang_flags_after_a_double_dash_belong_to_the_command(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from agentenv.cli import main

    # `agentenv sandbox exec ... -- CMD`: a --sglang-* token there is the command's own
    # (the command is then refused for its bad backend, not for the SGLang flag).
    with pytest.raises(SystemExit):
        main(["sandbox", "exec", "--backend", "nothing", "--", "echo", "--sglang-x", "1"])
    err = capsys.readouterr().err
    assert "invalid choice: 'nothing'" in err and "--sglang" not in err


def test_the_episodes_in_flight_follow_the_engines_capacity() -> None:
    from agentenv.sglang import split_passthrough
    from trainer.run._servers import server_capacity

    # slime's --sglang-server-concurrency is the trainer's, not a flag for SGLang.
    ours, server, _ = split_passthrough(
        ["--sglang-server-concurrency", "32", "--sglang-mem-fraction-static", "0.5"]
    )
    assert ours == ["--sglang-server-concurrency", "32"]
    assert server == ["--mem-fraction-static", "0.5"]

    def concurrency(**settings: object) -> int | None:
        config = TrainConfig.model_validate({"env": "arithmetic", **settings})
        return anyio.run(server_capacity, config, None)

    assert concurrency(rollout_engine="serve", rollout_max_running=512) == 512
    assert concurrency(rollout_engine="sglang") == 512  # slime's default, per server
    assert concurrency(rollout_engine="sglang", sglang_server_concurrency=96) == 96

    class Router:
        async def list_workers(self) -> list[str]:
            return ["http://127.0.0.1:1", "http://127.0.0.1:2", "http://127.0.0.1:3"]

    config = TrainConfig(
        env="arithmetic", rollout_url="http://127.0.0.1:9", sglang_server_concurrency=8
    )
    assert anyio.run(server_capacity, config, Router()) == 24
    with pytest.raises(
        ConfigError, match="concurrency: Input should be greater than or equal to 1"
    ):
        GRPOConfig(concurrency=0)

    # An engine that does not say what it decodes together: a whole round at once; one
    # that does, its capacity; the setting, given, wins.
    class Says:
        def __init__(self, capacity: int | None) -> None:
            self.capacity = capacity

    grpo = GRPOConfig(rollout_batch_size=8, n_samples_per_prompt=4)
    assert grpo.concurrency_for(Says(None)) == 32
    assert grpo.concurrency_for(Says(16)) == 16
    assert GRPOConfig(concurrency=3).concurrency_for(Says(16)) == 3


def test_the_rollout_servers_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("AGENTENV_API_KEY", raising=False)
    base = {"env": "arithmetic"}
    assert TrainConfig(**base).engine.api_key() is None
    # SGLang's --api-key: passed through to a launched SGLang, and this trainer's key.
    sglang = TrainConfig(
        **base, rollout_engine="sglang", sglang_args=["--api-key", "k1", "--tp", "2"]
    )
    assert sglang.engine.api_key() == "k1" and sglang.engine.sglang_args[:2] == ["--api-key", "k1"]
    # The one --sglang-* flag a non-SGLang server takes.
    assert (
        TrainConfig(**base, rollout_engine="serve", sglang_args=["--api-key=k2"]).engine.api_key()
        == "k2"
    )
    url = TrainConfig(**base, rollout_url="http://10.0.0.2:30000", sglang_args=["--api-key", "k3"])
    assert url.engine.api_key() == "k3"
    with pytest.raises(ConfigError, match=r"\(--tp 2\) need --rollout-engine sglang"):
        TrainConfig(**base, rollout_engine="serve", sglang_args=["--api-key", "k", "--tp", "2"])
    with pytest.raises(ConfigError, match="the embedded engine takes none"):
        TrainConfig(**base, sglang_args=["--api-key", "k"])
    monkeypatch.setenv("AGENTENV_API_KEY", "from-env")
    assert TrainConfig(**base, rollout_engine="serve").engine.api_key() == "from-env"


@pytest.mark.timeout(180)
def test_a_launched_agentenv_serve_gets_the_key_and_the_trainer_sends_it(
    tmp_path: Path, smollm2: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anyio
    import httpx

    from trainer.run._servers import rollout_engine

    monkeypatch.delenv("AGENTENV_API_KEY", raising=False)
    config = TrainConfig(
        env="arithmetic", rollout_engine="serve", sglang_args=["--api-key", "trainer-key"]
    )

    async def go() -> None:
        async with rollout_engine(config, smollm2, tmp_path) as client:
            c = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
            assert len(c.output_ids) == 2
            async with httpx.AsyncClient(base_url=client.url) as plain:  # no key: refused
                r = await plain.post("/generate", json={"input_ids": [1, 2, 3]})
                assert r.status_code == 401

    anyio.run(go)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--num-rolout", "3"], "unknown flag --num-rolout; did you mean --num-rollout?"),
        (["--learning-rate", "1e-5"], "unknown flag --learning-rate; did you mean --lr,"),
        (["--backend", "megatron", "--num-rolout", "3"], "did you mean --num-rollout?"),
        (["--backend", "megatron", "--tensor-parallel", "2"],
         "unknown flag --tensor-parallel; did you mean --tensor-model-parallel-size?"),
        (["--frobnicate"], "unknown flag --frobnicate (--help lists the flags)"),
        # Only megatron's own flags are blamed on the backend.
        (["--tensor-model-parallel-size", "2"],
         "megatron flags (--tensor-model-parallel-size 2) need --backend megatron"),
    ],
)  # fmt: skip
def test_a_mistyped_train_flag_is_named_with_the_closest_one(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    from agentenv.cli import main

    try:
        code = main(["train", "--dry-run", "--env", "arithmetic", *argv])
    except SystemExit as e:  # argparse's way
        code = int(str(e.code))
    err = capsys.readouterr().err
    assert code == 2 and message in err
    if "megatron flags" not in message:
        assert "megatron flags" not in err and "need --backend megatron" not in err


class _SampledEnv(SingleTurnEnv):
    rubric = Rubric(lambda task, state: 1.0)
    sampling: ClassVar[Mapping[str, Any]] = {"max_new_tokens": 96, "temperature": 0.5}


def test_the_environments_sampling_fills_what_was_not_given_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = _SampledEnv()
    plain = GRPOConfig().for_env(env)
    assert (plain.sampling.max_new_tokens, plain.sampling.temperature) == (96, 0.5)
    config = TrainConfig(env="x", rollout_max_response_len=8).for_env(env)
    assert (config.rollout.sampling.max_new_tokens, config.rollout.sampling.temperature) == (8, 0.5)
    message = "--rollout-max-response-len 8 wins over _SampledEnv.sampling's max_new_tokens=96"
    assert caplog.text.count(message) == 1
    again = config.rollout.model_copy(update={"concurrency": 4}).for_env(env)  # run_grpo's
    assert again.sampling == config.rollout.sampling and caplog.text.count(message) == 1


def test_the_held_out_evaluation_plays_with_the_rounds_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One episode a task at --eval-temperature and its own seed; the rounds' episode
    timeout, template arguments and the concurrency it is given."""
    import agentenv
    from trainer.run._evaluation import Evaluator

    seen: dict[str, Any] = {}

    async def run_rollouts(env: Any, tasks: Any, policy: Any, **kwargs: Any) -> Any:
        seen.update(kwargs)
        return type("Stats", (), {"reward_mean": 0.5})()

    monkeypatch.setattr(agentenv, "run_rollouts", run_rollouts)
    parser = argparse.ArgumentParser()
    add_train_arguments(parser)
    argv = ["--env", "x", "--episode-timeout", "7", "--n-samples-per-prompt", "4",
            "--rollout-temperature", "0.9", "--eval-temperature", "0.2",
            "--apply-chat-template-kwargs", '{"enable_thinking": false}']  # fmt: skip
    config = config_from_args(parser.parse_args(argv))
    evaluate = Evaluator(Answer(), [Task(id="a", prompt="2+2?")], None, config)  # type: ignore[arg-type]
    assert anyio.run(evaluate, None, 3) == 0.5
    rollout = seen["config"]
    assert rollout.n_samples_per_prompt == 1 and rollout.concurrency == 3
    assert rollout.sampling.temperature == 0.2 and rollout.seed == evaluate.seed
    assert rollout.limits.timeout_s == 7
    assert rollout.chat_template_kwargs == {"enable_thinking": False}
