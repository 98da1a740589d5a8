"""Tasks from prompt data files (slime's ``--prompt-data`` with ``--input-key``,
``--label-key`` and ``--metadata-key``): JSONL, Parquet, or a ``datasets.save_to_disk``
directory (its ``train`` split when it holds several).

Each row is one :class:`Task`: the prompt, the answer, and the rest in ``info`` (the
``metadata_key`` object merged in). :func:`read_prompt_data` skips bad rows, reporting
each with the file, the line (row) and the key; :func:`load_prompt_data` refuses the file
at its first bad row. What makes a row bad: docs/rewards.md. Only regular files and
directories are read: a FIFO or a device is refused before it is opened."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from agentenv._environment import Task
from agentenv._errors import ConfigError, MessageError
from agentenv._messages import validate_messages

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
    for number, line in enumerate(_read_regular(file).splitlines(), 1):
        if not line.strip():
            continue
        try:
            text = line.decode("utf-8-sig" if number == 1 else "utf-8")  # a BOM: no row
        except UnicodeDecodeError as e:
            yield f"line {number}", _BadRow(f"not UTF-8 (byte {e.start + 1} of the line)")
            continue
        try:
            yield f"line {number}", json.loads(text)
        except ValueError as e:
            yield f"line {number}", _BadRow(f"not JSON ({e})")
        except RecursionError:
            yield f"line {number}", _BadRow("JSON nested too deep to parse")


def _check_kind(file: Path, mode: int) -> None:
    if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
        raise ConfigError(
            f"prompt data {str(file)!r} is not a regular file or directory (a FIFO, socket "
            "or device would block or never end): pass a .jsonl or .parquet file or a "
            "datasets directory"
        )


def _read_regular(file: Path) -> bytes:
    """The bytes of ``file``, a regular file: opened without blocking (a FIFO put in its
    place after :func:`read_prompt_data` checked it cannot hang the open) and checked
    again on the open descriptor before anything is read."""
    try:
        fd = os.open(file, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ConfigError(f"cannot read prompt data {str(file)!r}: {e}") from None
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            _check_kind(file, mode)
            raise ConfigError(f"prompt data {str(file)!r} is a directory, not a JSONL file")
        try:
            return f.read()
        except OSError as e:
            raise ConfigError(f"cannot read prompt data {str(file)!r}: {e}") from None


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


def _check_rm_type(value: Any) -> None:
    from agentenv.rewards import RM_TYPES, check_rm_type

    if not isinstance(value, str):
        raise _BadRow(f"'rm_type' must be a string, one of {', '.join(RM_TYPES)}; got {value!r}")
    try:
        check_rm_type(value)
    except ConfigError as e:
        raise _BadRow(f"'rm_type': {str(e).removeprefix('--rm-type ')}") from None


def _task(
    row: Any,
    where: str,
    stem: str,
    input_key: str,
    label_key: str | None,
    metadata_key: str | None,
    check_rm_type: bool,
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
    if isinstance(prompt, list):
        try:
            validate_messages(prompt)
        except MessageError as e:
            raise _BadRow(f"{input_key!r}: {e}") from None
    label = row[label_key] if label_key is not None else None
    if label_key is not None and label is None:
        raise _BadRow(f"{label_key!r} is null")
    skip = {input_key, label_key, metadata_key}
    info = {k: v for k, v in row.items() if k not in skip}
    if metadata_key is not None and metadata_key in row:
        info.update(_metadata(row[metadata_key], metadata_key))
    if check_rm_type and info.get("rm_type") is not None:
        _check_rm_type(info["rm_type"])
    number = where.split()[-1]
    return Task(id=str(row.get("id", f"{stem}-{number}")), prompt=prompt, answer=label, info=info)


def read_prompt_data(
    path: str | os.PathLike[str],
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str | None = "metadata",
    check_rm_type: bool = True,
) -> PromptData:
    """The tasks of ``path`` and the rows skipped (see the module docstring).
    ``check_rm_type``: a row's ``rm_type`` must be a reward type (off when a custom
    reward function, which may read its own values, scores the rows).

    Raises:
        ConfigError: the file cannot be read, is not a regular file or directory, has no
            good row, or repeats an ``id``.
    """
    file = Path(path)
    try:
        mode = file.stat().st_mode  # stat never blocks, even on a FIFO
    except OSError as e:
        reason = "no such file or directory" if isinstance(e, FileNotFoundError) else e
        raise ConfigError(f"cannot read prompt data {str(file)!r}: {reason}") from None
    _check_kind(file, mode)
    tasks: list[Task] = []
    skipped: list[str] = []
    for where, row in _rows(file):
        try:
            tasks.append(
                _task(row, where, file.stem, input_key, label_key, metadata_key, check_rm_type)
            )
        except _BadRow as e:
            sep = ": " if not str(e).startswith("has ") else " "
            skipped.append(f"{file.name} {where}{sep}{e}")
    if not tasks:
        first = f" ({skipped[0]})" if skipped else ""
        raise ConfigError(f"prompt data {str(file)!r} has no tasks{first}")
    seen: set[str] = set()
    for task in tasks:
        if task.id in seen:
            raise ConfigError(f"prompt data {str(file)!r} repeats an 'id' ({task.id!r})")
        seen.add(task.id)
    return PromptData(tasks, skipped)


def load_prompt_data(
    path: str | os.PathLike[str],
    *,
    input_key: str = "prompt",
    label_key: str | None = "label",
    metadata_key: str | None = "metadata",
    check_rm_type: bool = True,
) -> list[Task]:
    """The tasks of ``path``; its first bad row is a :class:`ConfigError` naming the file,
    the line and the key."""
    data = read_prompt_data(
        path, input_key=input_key, label_key=label_key, metadata_key=metadata_key,
        check_rm_type=check_rm_type,
    )  # fmt: skip
    if data.skipped:
        raise ConfigError(data.skipped[0])
    return data.tasks
