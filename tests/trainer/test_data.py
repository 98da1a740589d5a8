"""Prompt data files: tasks from JSONL, errors that name the line and the key, and
``agentenv train`` skipping (and reporting) bad rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv import ConfigError, load_prompt_data


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text(text)
    return path


def test_tasks_come_from_the_keys(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        '{"question": "1 + 1?", "answer": 2, "level": "easy"}\n\n'
        '{"question": [{"role": "user", "content": "2 + 2?"}], "answer": 4, "id": "q2"}\n',
    )
    tasks = load_prompt_data(path, input_key="question", label_key="answer")
    assert [t.id for t in tasks] == ["data-1", "q2"]
    assert tasks[0].prompt == "1 + 1?" and tasks[0].answer == 2
    assert dict(tasks[0].info) == {"level": "easy"}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"question": "a", "answer": 1}\n{"question": "b"}\n', "line 2 has no key 'answer'"),
        (
            '{"q": "a", "answer": 1}\n',
            "line 1 has no key 'question' \\(keys: \\['answer', 'q'\\]\\)",
        ),
        ('{"question": "a", "answer": 1}\nnot json\n', "line 2: not JSON"),
        ("[1, 2]\n", "line 1: expected a JSON object"),
        ('{"question": 5, "answer": 1}\n', "must be a string or chat messages"),
        ("\n\n", "has no tasks"),
        (
            '{"question": "a", "answer": 1, "id": "x"}\n'
            '{"question": "b", "answer": 2, "id": "x"}\n',
            "repeats an 'id'",
        ),
    ],
)
def test_bad_prompt_data_is_named(tmp_path: Path, text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        load_prompt_data(write(tmp_path, text), input_key="question", label_key="answer")


def test_a_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read prompt data"):
        load_prompt_data(tmp_path / "nope.jsonl")


@pytest.mark.slow
def test_agentenv_train_takes_prompt_data_and_skips_a_bad_row_naming_it(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    from tests.trainer.test_loop import tiny_llama

    model = tiny_llama(tmp_path / "tiny")
    rows = [{"text": f"Say something, {i}.", "label": i} for i in range(4)]
    good = write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows))

    def train(data: Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "agentenv", "train",
             "--env", "tests.trainer.test_loop:GoodTokensEnv", "--hf-checkpoint", str(model),
             "--prompt-data", str(data), "--input-key", "text", "--label-key", "label",
             "--num-rollout", "1", "--rollout-batch-size", "4", "--n-samples-per-prompt", "2",
             "--rollout-max-response-len", "4", "--n-eval", "0", "--json"],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    out = train(good)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.splitlines()[-1])["steps"] == 1
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        json.dumps(rows[0]) + "\n" + json.dumps({"text": "no label"}) + "\n"
        + "".join(json.dumps(r) + "\n" for r in rows[1:])
    )  # fmt: skip
    out = train(bad)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "bad.jsonl line 2 has no key 'label' (keys: ['text']); skipped" in out.stderr
    only_bad = tmp_path / "only_bad.jsonl"
    only_bad.write_text(json.dumps({"text": "no label"}) + "\n")
    out = train(only_bad)
    assert out.returncode == 2
    assert "has no tasks (only_bad.jsonl line 1 has no key 'label'" in out.stderr


def test_rows_go_to_a_tool_environment_and_the_reward_flags_replace_its_rubric(
    tmp_path: Path,
) -> None:
    import json

    from agentenv.rewards import RuleReward
    from trainer import TrainConfig
    from trainer.run._setup import load_tasks

    rows = [{"question": f"What is {i} * 3?", "answer": str(3 * i)} for i in range(4)]
    data = write(tmp_path, "".join(json.dumps(r) + "\n" for r in rows))
    config = TrainConfig(env="calculator", prompt_data=data, input_key="question",
                         label_key="answer", rm_type="math", rollout_batch_size=4,
                         n_samples_per_prompt=2, global_batch_size=8, n_eval=2)  # fmt: skip
    tasks = load_tasks(config)
    assert [t.prompt for t in tasks.train] == [r["question"] for r in rows]
    assert type(tasks.env).__name__ == "CalculatorEnv"
    [(fn, weight)] = tasks.env.rubric.funcs  # type: ignore[attr-defined]
    assert isinstance(fn, RuleReward) and fn.rm_type == "math" and weight == 1.0
    assert len(tasks.held_out) == 2  # the environment's own test split
