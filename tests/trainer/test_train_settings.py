"""The training settings that need no model: learning-rate schedules, the task stream's
saved position, filter paths, the raw (no chat template) rendering, config files and the
SGLang flag pass-through."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest

from agentenv import ChatTokenizer, ConfigError, Task
from agentenv.cli._config import add_model_arguments, build_config
from trainer import OptimConfig
from trainer._cli import TrainConfig
from trainer._producer import TaskStream
from trainer._train import RAW_TEMPLATE, load_filter


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
    with pytest.raises(ConfigError, match="unknown lr_decay_style 'step'; valid: constant"):
        OptimConfig(lr_decay_style="step")
    with pytest.raises(ConfigError, match="unknown optimizer 'lion'; valid: adam, sgd"):
        OptimConfig(optimizer="lion")
    with pytest.raises(ConfigError, match="min_lr must be in"):
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


def _parse(tmp_path: Path, text: str, suffix: str, *argv: str) -> TrainConfig:
    path = tmp_path / f"run{suffix}"
    path.write_text(text)
    parser = argparse.ArgumentParser()
    add_model_arguments(parser, TrainConfig, config_file=True, exclude=("sglang_args",))
    return build_config(TrainConfig, parser.parse_args(["--config", str(path), *argv]))


def test_config_files_in_three_formats_and_flags_override(tmp_path: Path) -> None:
    yaml = _parse(
        tmp_path, "env: arithmetic\nnum-rollout: 7\nlr: 3.0e-6\n", ".yaml", "--lr", "1e-5"
    )
    assert (yaml.env, yaml.num_rollout, yaml.lr) == ("arithmetic", 7, 1e-5)
    toml = _parse(
        tmp_path,
        'env = "x"\nschedule = "async"\nrollout_engine = "sglang"\nsglang_args = ["--tp", "2"]\n',
        ".toml",
    )
    assert toml.schedule == "async" and toml.sglang_args == ["--tp", "2"]
    assert (
        _parse(tmp_path, '{"env": "x", "rollout_shuffle": false}', ".json").rollout_shuffle is False
    )


@pytest.mark.parametrize(
    ("text", "suffix", "message"),
    [
        ("env: x\nlearning_rate: 1\n", ".yaml", "--learning-rate: Extra inputs are not permitted"),
        ("env: [unclosed\n", ".yaml", "does not parse"),
        ("- a\n- b\n", ".yaml", "must hold a mapping"),
        ("env=x", ".ini", "expected a .yaml, .yml, .json or .toml file"),
        ("num_rollout: 3\n", ".yaml", "--env: Field required"),
        ("env: x\nuse_dynamic_batch_size: false\n", ".yaml", "always packed by"),
    ],
)
def test_bad_config_files_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, suffix: str, message: str
) -> None:
    with pytest.raises(SystemExit) as e:
        _parse(tmp_path, text, suffix)
    assert e.value.code == 2 and message in capsys.readouterr().err


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


def test_the_rollout_servers_api_key(monkeypatch: pytest.MonkeyPatch) -> None:
    import pydantic

    monkeypatch.delenv("AGENTENV_API_KEY", raising=False)
    base = {"env": "arithmetic"}
    assert TrainConfig(**base).rollout_api_key() is None
    # SGLang's --api-key: passed through to a launched SGLang, and this trainer's key.
    sglang = TrainConfig(
        **base, rollout_engine="sglang", sglang_args=["--api-key", "k1", "--tp", "2"]
    )
    assert sglang.rollout_api_key() == "k1" and sglang.sglang_args[:2] == ["--api-key", "k1"]
    # The one --sglang-* flag a non-SGLang server takes.
    assert (
        TrainConfig(**base, rollout_engine="serve", sglang_args=["--api-key=k2"]).rollout_api_key()
        == "k2"
    )
    url = TrainConfig(**base, rollout_url="http://10.0.0.2:30000", sglang_args=["--api-key", "k3"])
    assert url.rollout_api_key() == "k3"
    with pytest.raises(pydantic.ValidationError, match=r"\(--tp 2\) need --rollout-engine sglang"):
        TrainConfig(**base, rollout_engine="serve", sglang_args=["--api-key", "k", "--tp", "2"])
    with pytest.raises(pydantic.ValidationError, match="the embedded engine takes none"):
        TrainConfig(**base, sglang_args=["--api-key", "k"])
    monkeypatch.setenv("AGENTENV_API_KEY", "from-env")
    assert TrainConfig(**base, rollout_engine="serve").rollout_api_key() == "from-env"


@pytest.mark.timeout(180)
def test_a_launched_agentenv_serve_gets_the_key_and_the_trainer_sends_it(
    tmp_path: Path, smollm2: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import anyio
    import httpx

    from agentenv import SamplingParams
    from trainer._train import rollout_engine

    monkeypatch.delenv("AGENTENV_API_KEY", raising=False)
    config = TrainConfig(
        env="arithmetic", rollout_engine="serve", sglang_args=["--api-key", "trainer-key"]
    )

    async def go() -> None:
        async with rollout_engine(config, smollm2, tmp_path) as (client, _):
            c = await client.generate([1, 2, 3], SamplingParams(max_new_tokens=2))
            assert len(c.output_ids) == 2
            async with httpx.AsyncClient(base_url=client.url) as plain:  # no key: refused
                r = await plain.post("/generate", json={"input_ids": [1, 2, 3]})
                assert r.status_code == 401

    anyio.run(go)
