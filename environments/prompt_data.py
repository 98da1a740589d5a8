"""``prompt_data``: prompts from a file, one answer each, scored by a reward type.

slime's data flags without any Python: the tasks are the rows of a JSONL, Parquet or
``datasets`` directory (:func:`agentenv.read_prompt_data`), the reward is slime's
``--rm-type`` or a custom function (:func:`agentenv.rewards.reward_rubric`)::

    agentenv train --prompt-data dapo.jsonl --input-key prompt --label-key label \\
        --rm-type deepscaler

Bad rows are skipped, each reported (logged as a warning with the file, line and key).
The ``test`` split is ``eval_path``'s rows (none without it).
"""

from __future__ import annotations

import logging
from typing import Any

from agentenv import ConfigError, SingleTurnEnv, Task, read_prompt_data
from agentenv.rewards import reward_rubric

log = logging.getLogger("environments.prompt_data")


class PromptDataEnv(SingleTurnEnv):
    """One answer per prompt of a prompt data file, scored by ``rm_type`` (or
    ``custom_rm_path``; the other keyword arguments as
    :func:`~agentenv.rewards.reward_rubric` takes them)."""

    name = "prompt_data"

    def __init__(
        self,
        path: str,
        *,
        eval_path: str | None = None,
        input_key: str = "prompt",
        label_key: str | None = "label",
        metadata_key: str | None = "metadata",
        system_prompt: str | None = None,
        rm_type: str | None = None,
        rm_url: str | None = None,
        reward_key: str | None = None,
        custom_rm_path: str | None = None,
        group_rm: bool = False,
        rm_timeout: float | None = None,
        rm_max_response_bytes: int | None = None,
    ) -> None:
        # label_key: a TRL reward function reads the answer as that column
        self.rubric = reward_rubric(
            rm_type, rm_url=rm_url, reward_key=reward_key, custom_rm_path=custom_rm_path,
            group_rm=group_rm, label_key=label_key, rm_timeout=rm_timeout,
            rm_max_response_bytes=rm_max_response_bytes,
        )  # fmt: skip
        self.system_prompt = system_prompt  # type: ignore[misc]
        keys: dict[str, Any] = dict(
            input_key=input_key, label_key=label_key, metadata_key=metadata_key,
            # A custom function may read rm_type values of its own; a reward type may not.
            check_rm_type=custom_rm_path is None,
        )  # fmt: skip
        self.splits: dict[str, list[Task]] = {"train": [], "test": []}
        self.skipped: list[str] = []  # why each skipped row was skipped
        for split, source in (("train", path), ("test", eval_path)):
            if source is None:
                continue
            data = read_prompt_data(source, **keys)
            for problem in data.skipped:
                log.warning("%s; skipped", problem)
            self.splits[split] = data.tasks
            self.skipped += data.skipped

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self.splits:
            raise ConfigError(f"split must be one of {sorted(self.splits)}, got {split!r}")
        return self.splits[split]
