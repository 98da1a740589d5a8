"""Prompt data files: JSONL, Parquet and ``datasets`` directories give the same tasks;
bad rows are skipped and reported with the file, the line (row) and the key."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from agentenv import ConfigError, load_prompt_data, read_prompt_data

ROWS: list[dict[str, Any]] = [
    {"prompt": "1 + 1?", "label": "2", "metadata": {"rm_type": "math", "level": 1}},
    {"prompt": "2 + 2?", "label": "4", "metadata": {}},
    {"prompt": "3 + 3?", "label": "6", "metadata": {"level": 2}},
]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_jsonl_parquet_and_a_datasets_directory_give_the_same_tasks(tmp_path: Path) -> None:
    import datasets

    jsonl = write_jsonl(tmp_path / "math.jsonl", ROWS)
    # Tables hold the metadata as JSON text (one schema for every row).
    table = [{**r, "metadata": json.dumps(r["metadata"])} for r in ROWS]
    datasets.Dataset.from_list(table).to_parquet(str(tmp_path / "math.parquet"))
    datasets.Dataset.from_list(table).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(table)}).save_to_disk(
        str(tmp_path / "splits")
    )
    seen = []
    for path in ("math.jsonl", "math.parquet", "saved", "splits"):
        tasks = load_prompt_data(tmp_path / path)
        seen.append([(t.prompt, t.answer, dict(t.info)) for t in tasks])
    assert seen[0] == seen[1] == seen[2] == seen[3]
    assert seen[0][0] == ("1 + 1?", "2", {"rm_type": "math", "level": 1})
    assert seen[0][1] == ("2 + 2?", "4", {})
    ids = [t.id for t in load_prompt_data(jsonl)]
    assert ids == ["math-1", "math-2", "math-3"]


def test_bad_rows_are_skipped_and_each_is_reported(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "data.jsonl",
        [ROWS[0], {"prompt": "no label"}, "not json", [1, 2], {"prompt": 5, "label": "1"},
         {"prompt": "p", "label": None}, {"prompt": "p", "label": "1", "metadata": "[1]"},
         ROWS[2]],
    )  # fmt: skip
    data = read_prompt_data(path)
    assert [t.prompt for t in data.tasks] == ["1 + 1?", "3 + 3?"]
    assert data.skipped[0] == ("data.jsonl line 2 has no key 'label' (keys: ['prompt'])")
    assert data.skipped[1].startswith("data.jsonl line 3: not JSON")
    assert data.skipped[2:] == [
        "data.jsonl line 4: expected a JSON object",
        "data.jsonl line 5: 'prompt' must be a string or chat messages",
        "data.jsonl line 6: 'label' is null",
        "data.jsonl line 7: 'metadata' must be an object, got list",
    ]
    with pytest.raises(ConfigError, match=r"data\.jsonl line 2 has no key 'label'"):
        load_prompt_data(path)  # strict: the first bad row


def test_chat_messages_as_prompts_in_a_parquet_file(tmp_path: Path) -> None:
    import datasets

    chat = [{"prompt": [{"role": "user", "content": f"{i} + {i}?"}], "label": str(2 * i)}
            for i in range(3)]  # fmt: skip
    datasets.Dataset.from_list(chat).to_parquet(str(tmp_path / "chat.parquet"))
    tasks = load_prompt_data(tmp_path / "chat.parquet")
    assert tasks[2].prompt == [{"role": "user", "content": "2 + 2?"}] and tasks[2].answer == "4"


def test_a_table_row_is_named_by_its_number(tmp_path: Path) -> None:
    import datasets

    rows = [{"question": "a", "answer": "1"}, {"question": "b", "answer": None}]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "t.parquet"))
    data = read_prompt_data(tmp_path / "t.parquet", input_key="question", label_key="answer")
    assert data.skipped == ["t.parquet row 2: 'answer' is null"]


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda p: p / "missing.jsonl", "no such file or directory"),
        (lambda p: write_jsonl(p / "bad.jsonl", ["{"]), "has no tasks (bad.jsonl line 1: not"),
        (lambda p: (p / "x.parquet").write_text("nope") and p / "x.parquet", "cannot read"),
        (
            lambda p: write_jsonl(p / "d.jsonl", [{"prompt": "a", "label": 1, "id": "x"},
                                                  {"prompt": "b", "label": 2, "id": "x"}]),
            "repeats an 'id' ('x')",
        ),
    ],
)  # fmt: skip
def test_what_cannot_be_read_at_all_is_an_error(tmp_path: Path, make: Any, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_prompt_data(make(tmp_path))


def test_a_datasets_directory_without_a_train_split_names_its_splits(tmp_path: Path) -> None:
    import datasets

    rows = [{"prompt": "a", "label": "1"}]
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "d")
    )
    with pytest.raises(ConfigError, match=r"holds the splits \['test'\], no 'train'"):
        read_prompt_data(tmp_path / "d")


@pytest.mark.timeout(120)  # the check was quadratic: 100k rows did not finish in hours
def test_a_repeated_id_among_many_rows_is_found_in_linear_time(tmp_path: Path) -> None:
    rows = [{"prompt": "p", "label": "1", "id": f"t{i}"} for i in range(100_000)]
    path = write_jsonl(
        tmp_path / "big.jsonl", [*rows, {"prompt": "p", "label": "1", "id": "t99999"}]
    )
    with pytest.raises(ConfigError, match=r"repeats an 'id' \('t99999'\)"):
        read_prompt_data(path)


@pytest.mark.timeout(60)  # the open blocked until a writer came
def test_a_fifo_is_refused_before_it_is_opened(tmp_path: Path) -> None:
    fifo = tmp_path / "data.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"data\.jsonl' is not a regular file or directory"):
        read_prompt_data(fifo)
    table = tmp_path / "data.parquet"
    os.mkfifo(table)
    with pytest.raises(ConfigError, match=r"data\.parquet' is not a regular file or directory"):
        read_prompt_data(table)


def test_deep_nesting_bad_utf8_unknown_roles_and_reward_types_are_bad_rows(
    tmp_path: Path,
) -> None:
    path = tmp_path / "data.jsonl"
    lines = [
        json.dumps(ROWS[0]).encode(),
        b"[" * 100_000 + b"]" * 100_000,
        b'{"prompt": "caf\xe9", "label": "1"}',
        json.dumps({"prompt": [{"role": "usr", "content": "hi"}], "label": "1"}).encode(),
        json.dumps({"prompt": "p", "label": "1", "metadata": {"rm_type": "mathh"}}).encode(),
        json.dumps({"prompt": "p", "label": "1", "rm_type": 3}).encode(),
        json.dumps(ROWS[2]).encode(),
    ]
    path.write_bytes(b"\n".join(lines) + b"\n")
    data = read_prompt_data(path)
    assert [t.prompt for t in data.tasks] == ["1 + 1?", "3 + 3?"]
    assert data.skipped[0] == "data.jsonl line 2: JSON nested too deep to parse"
    assert data.skipped[1] == "data.jsonl line 3: not UTF-8 (byte 16 of the line)"
    assert data.skipped[2] == (
        "data.jsonl line 4: 'prompt': message 0 has unknown role 'usr'; expected one of "
        "['assistant', 'system', 'tool', 'user']"
    )
    assert data.skipped[3].startswith(
        "data.jsonl line 5: 'rm_type': 'mathh' is not a reward type; known: dapo, deepscaler, "
        "f1, math, remote_rm"
    )
    assert data.skipped[3].endswith("did you mean math?")
    assert data.skipped[4].startswith("data.jsonl line 6: 'rm_type' must be a string, one of")
    with pytest.raises(ConfigError, match=r"data\.jsonl line 2: JSON nested too deep"):
        load_prompt_data(path)
    # A custom reward function may read rm_type values of its own.
    custom = read_prompt_data(path, check_rm_type=False)
    assert len(custom.tasks) == 4
