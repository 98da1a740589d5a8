"""Tasks from prompt data files (slime's ``--prompt-data`` with ``--input-key``,
``--label-key`` and ``--metadata-key``): JSONL (one object a line), Parquet (``.parquet``,
as ``datasets`` and pandas write it) and a ``datasets.save_to_disk`` directory (its
``train`` split when it holds several).

Each row gives one :class:`Task`: the prompt (a string or chat messages) under
``input_key``, the answer under ``label_key``, and the rest in ``info``, the
``metadata_key`` object's entries merged in (slime's per-row metadata, e.g. an
``rm_type``). :func:`read_prompt_data` skips bad rows and reports each with the file, the
line (row) and the key; :func:`load_prompt_data` refuses the file at its first bad row.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from agentenv._environment import Task
from agentenv._errors import ConfigError

__all__ = ["PromptData", "load_prompt_data", "read_prompt_data"]


@dataclasses.dataclass(frozen=True, slots=True)
class PromptData:
    """The tasks of a prompt data file, and why each skipped row was skipped
    (``"data.jsonl line 3 has no key 'label' (keys: [...])"``)."""

    tasks: list[Task]
    skipped: list[str]


class _BadRow(Exception):
    pass


def _rows(file: Path) -> Iterator[tuple[str, Any]]:
    """(where, row) for each row: ``line N`` of JSONL, ``row N`` of a table."""
    if file.is_dir() or file.suffix in (".parquet", ".arrow"):
        for number, row in enumerate(_table_rows(file), 1):
            yield f"row {number}", row
        return
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read prompt data {str(file)!r}: {e}") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            yield f"line {number}", json.loads(line)
        except ValueError as e:
            yield f"line {number}", _BadRow(f"not JSON ({e})")


def _table_rows(path: Path) -> list[dict[str, Any]]:
    try:
        if path.is_dir():
            import datasets

            loaded = datasets.load_from_disk(str(path))
            if isinstance(loaded, datasets.DatasetDict):
                if "train" not in loaded:
                    raise ConfigError(
                        f"prompt data {str(path)!r} holds the splits {sorted(loaded)}, no "
                        f"'train': pass one split's directory ({path}/{next(iter(loaded))})"
                    )
                loaded = loaded["train"]
            return list(loaded.to_list())
        import pyarrow.parquet

        return list(pyarrow.parquet.read_table(path).to_pylist())
    except ImportError as e:
        raise ConfigError(
            f"reading {str(path)!r} needs {e.name}: pip install 'agentenv[bench]' "
            "(datasets, pyarrow)"
        ) from None
    except (OSError, ValueError) as e:  # not a datasets directory, not Parquet
        raise ConfigError(f"cannot read prompt data {str(path)!r}: {e}") from None


def _metadata(value: Any, key: str) -> Mapping[str, Any]:
    if isinstance(value, str):  # tables often hold it as JSON text
        try:
            value = json.loads(value) if value.strip() else {}
        except ValueError:
            raise _BadRow(f"{key!r} is not a JSON object: {value[:60]!r}") from None
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise _BadRow(f"{key!r} must be an object, got {type(value).__name__}")
    return value


def _task(
    row: Any, where: str, stem: str, input_key: str, label_key: str | None, metadata_key: str | None
) -> Task:
    if isinstance(row, _BadRow):
        raise row
    if not isinstance(row, dict):
        raise _BadRow("expected a JSON object")
    for key in (input_key, label_key):
        if key is not None and key not in row:
            raise _BadRow(f"has no key {key!r} (keys: {sorted(row)})")
    prompt = row[input_key]
    if not isinstance(prompt, str) and not (
        isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)
    ):
        raise _BadRow(f"{input_key!r} must be a string or chat messages")
    label = row[label_key] if label_key is not None else None
    if label_key is not None and label is None:
        raise _BadRow(f"{label_key!r} is null")
    skip = {input_key, label_key, metadata_key}
    info = {k: v for k, v in row.items() if k not in skip}
    if metadata_key is not None and metadata_key in row:
        info.update(_metadata(row[metadata_key], metadata_key))
    number = where.split()[-1]
    return Task(id=str(row.get("id", f"{stem}-{number}")), prompt=prompt, answer=label, info=info)


def read_prompt_data(
    path: str | os.PathLike[str],
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str | None = "metadata",
) -> PromptData:
    """The tasks of ``path`` and the rows skipped (see the module docstring).

    Raises:
        ConfigError: the file cannot be read, has no good row, or repeats an ``id``.
    """
    file = Path(path)
    if not file.exists():
        raise ConfigError(f"cannot read prompt data {str(file)!r}: no such file or directory")
    tasks: list[Task] = []
    skipped: list[str] = []
    for where, row in _rows(file):
        try:
            tasks.append(_task(row, where, file.stem, input_key, label_key, metadata_key))
        except _BadRow as e:
            sep = ": " if not str(e).startswith("has ") else " "
            skipped.append(f"{file.name} {where}{sep}{e}")
    if not tasks:
        first = f" ({skipped[0]})" if skipped else ""
        raise ConfigError(f"prompt data {str(file)!r} has no tasks{first}")
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        repeated = next(i for i in ids if ids.count(i) > 1)
        raise ConfigError(f"prompt data {str(file)!r} repeats an 'id' ({repeated!r})")
    return PromptData(tasks, skipped)


def load_prompt_data(
    path: str | os.PathLike[str],
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str | None = "metadata",
) -> list[Task]:
    """The tasks of ``path``; its first bad row is a :class:`ConfigError` naming the file,
    the line and the key."""
    data = read_prompt_data(
        path, input_key=input_key, label_key=label_key, metadata_key=metadata_key
    )
    if data.skipped:
        raise ConfigError(data.skipped[0])
    return data.tasks
