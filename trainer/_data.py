"""Training prompts from a JSONL file (slime's ``--prompt-data``, ``--input-key``,
``--label-key``): one task per line, the prompt under ``input_key`` and what the reward
compares against under ``label_key``."""

from __future__ import annotations

import json
import os
from pathlib import Path

from agentenv import ConfigError, Task

__all__ = ["load_prompt_data"]


def load_prompt_data(
    path: str | os.PathLike[str], *, input_key: str = "prompt", label_key: str | None = "label"
) -> list[Task]:
    """Tasks from ``path``; every error names the file, the line and the key."""
    file = Path(path)
    try:
        lines = file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read prompt data {str(file)!r}: {e}") from None
    tasks = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as e:
            raise ConfigError(f"{file.name} line {number}: not JSON ({e})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{file.name} line {number}: expected a JSON object")
        for key in (input_key, label_key):
            if key is not None and key not in row:
                raise ConfigError(
                    f"{file.name} line {number} has no key {key!r} (keys: {sorted(row)})"
                )
        prompt = row[input_key]
        if not isinstance(prompt, str) and not (
            isinstance(prompt, list) and all(isinstance(m, dict) for m in prompt)
        ):
            raise ConfigError(
                f"{file.name} line {number}: {input_key!r} must be a string or chat messages"
            )
        info = {k: v for k, v in row.items() if k not in (input_key, label_key)}
        tasks.append(
            Task(
                id=str(row.get("id", f"{file.stem}-{number}")),
                prompt=prompt,
                answer=row[label_key] if label_key is not None else None,
                info=info,
            )
        )
    if not tasks:
        raise ConfigError(f"prompt data {str(file)!r} has no tasks")
    if len({t.id for t in tasks}) != len(tasks):
        raise ConfigError(f"prompt data {str(file)!r} repeats an 'id'")
    return tasks
