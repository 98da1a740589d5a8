"""``prompt_data``: a prompt file scored by a reward type, no Python written."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from agentenv import ChatTokenizer, ConfigError, ScriptedModel, load_environment, run
from environments.prompt_data import PromptDataEnv


def write(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_rows_are_scored_by_the_type_and_bad_rows_are_reported(
    tmp_path: Path, smollm2: ChatTokenizer, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(
        tmp_path / "math.jsonl",
        [{"prompt": "What is 1/2?", "label": "0.5"}, {"prompt": "What is 3?"},
         {"prompt": "Capital of France?", "label": "Paris", "metadata": {"rm_type": "f1"}}],
    )  # fmt: skip
    with caplog.at_level(logging.WARNING, logger="environments.prompt_data"):
        env = load_environment("prompt_data", {"path": str(path), "rm_type": "math"})
    assert isinstance(env, PromptDataEnv)
    assert "math.jsonl line 2 has no key 'label' (keys: ['prompt']); skipped" in caplog.text
    assert env.skipped == ["math.jsonl line 2 has no key 'label' (keys: ['prompt'])"]
    model = ScriptedModel(
        smollm2, lambda ctx: "Paris" if "France" in ctx.text else "It is \\boxed{\\frac{1}{2}}"
    )
    samples = run(env, model).samples
    assert [s.reward for s in samples] == [1.0, 1.0]
    assert [s.metadata["rewards"] for s in samples] == [{"math": 1.0}, {"math": 1.0}]
    assert env.tasks("test") == []


def test_a_held_out_file_and_a_system_prompt(tmp_path: Path) -> None:
    train = write(tmp_path / "train.jsonl", [{"q": "a", "a": "1"}])
    test = write(tmp_path / "test.jsonl", [{"q": "b", "a": "2"}, {"q": "c", "a": "3"}])
    env = PromptDataEnv(str(train), eval_path=str(test), input_key="q", label_key="a",
                        system_prompt="Box the answer.", rm_type="math")  # fmt: skip
    assert [t.prompt for t in env.tasks("test")] == ["b", "c"]
    assert env.prompt(env.tasks("train")[0])[0] == {"role": "system", "content": "Box the answer."}


def test_it_needs_a_reward(tmp_path: Path) -> None:
    path = write(tmp_path / "x.jsonl", [{"prompt": "a", "label": "1"}])
    with pytest.raises(ConfigError, match="no reward: pass --rm-type"):
        PromptDataEnv(str(path))


def test_a_row_naming_an_unknown_reward_type_is_skipped_at_load_time(tmp_path: Path) -> None:
    path = write(
        tmp_path / "x.jsonl",
        [{"prompt": "a", "label": "1"},
         {"prompt": "b", "label": "2", "metadata": {"rm_type": "f2"}}],
    )  # fmt: skip
    env = PromptDataEnv(str(path), rm_type="math")
    assert [t.prompt for t in env.tasks()] == ["a"]
    assert env.skipped[0].startswith("x.jsonl line 2: 'rm_type': 'f2' is not a reward type; known:")
