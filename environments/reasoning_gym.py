"""``reasoning_gym``: any of reasoning-gym's procedural datasets (``basic_arithmetic``,
``gsm_symbolic``, ``countdown``, ``chain_sum``, ``leg_counting``, ...) by name and config,
scored by the dataset's own verifier. No download: the tasks are generated from a seed.

The ``test`` split is generated first, from its own seed; the ``train`` split from
another, without any question the test split asks, so the two never overlap (and no
question repeats within a split). Needs the
``reasoning`` extra (``reasoning-gym``). Run it with::

    agentenv train --env reasoning_gym \\
        --env-args '{"dataset": "leg_counting", "config": {"max_animals": 2}}'

The answer is the last ``<answer>...</answer>`` of the reply (reasoning-gym's format);
with ``answer="tag_or_last_number"`` (the default) a reply without one is read by its last
number, as a small model first answers.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any, Literal

import anyio

from agentenv import ConfigError, Rubric, SingleTurnEnv, State, Task

_SPLIT_SEEDS = {"test": 1, "train": 0}  # offsets from the environment's seed
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
_TAG = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)


def _import() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ConfigError(
            "the reasoning_gym environment needs reasoning-gym: pip install "
            "'agentenv[reasoning]' (or reasoning-gym==0.1.25)"
        ) from None
    return reasoning_gym


def read_answer(reply: str, mode: str) -> str | None:
    """The answer in ``reply``: its last ``<answer>`` tag; with ``tag_or_last_number`` and
    no tag, its last number; ``None`` when there is neither."""
    tags = _TAG.findall(reply)
    if tags:
        return str(tags[-1]).strip()
    if mode == "tag_or_last_number":
        numbers = _NUMBER.findall(reply)
        return numbers[-1] if numbers else None
    return None


class ReasoningGymEnv(SingleTurnEnv):
    """One reasoning-gym dataset (``dataset`` and its ``config``; see the module
    docstring): ``n_train`` and ``n_test`` tasks, seeded by ``seed``."""

    name = "reasoning_gym"

    def __init__(
        self,
        dataset: str = "basic_arithmetic",
        config: Mapping[str, Any] | None = None,
        *,
        n_train: int = 1000,
        n_test: int = 200,
        seed: int = 0,
        system_prompt: str | None = None,
        answer: Literal["tag", "tag_or_last_number"] = "tag_or_last_number",
    ) -> None:
        if min(n_train, n_test) < 1:
            raise ConfigError(f"n_train and n_test must be at least 1, got {n_train}, {n_test}")
        if answer not in ("tag", "tag_or_last_number"):
            raise ConfigError(f"answer must be 'tag' or 'tag_or_last_number', got {answer!r}")
        rg = _import()
        self.dataset_name = dataset
        self.answer_mode = answer
        if system_prompt is None:
            from reasoning_gym.utils import SYSTEM_PROMPTS

            system_prompt = SYSTEM_PROMPTS["default"]
        self.system_prompt = system_prompt  # type: ignore[misc]
        self.rubric = Rubric(self.verified)
        self._entries: dict[str, dict[str, Any]] = {}
        self._datasets: dict[str, Any] = {}
        self.splits: dict[str, list[Task]] = {}
        asked: set[str] = set()
        for split, size in (("test", n_test), ("train", n_train)):
            # Room for the questions skipped: repeats, and train questions the test asks.
            pool = 4 * size + (n_test if split == "train" else 0)
            data = self._create(rg, dict(config or {}), seed * 2 + _SPLIT_SEEDS[split], pool)
            self._datasets[split] = data
            tasks: list[Task] = []
            for index in range(len(data)):
                if len(tasks) == size:
                    break
                entry = data[index]
                if entry["question"] in asked:  # each question once, in one split
                    continue
                asked.add(entry["question"])
                task_id = f"{dataset}-{split}-{index}"
                self._entries[task_id] = entry
                info = {"dataset": dataset, "split": split, "index": index}
                tasks.append(
                    Task(id=task_id, prompt=entry["question"], answer=str(entry["answer"]),
                         info=info)
                )  # fmt: skip
            if len(tasks) < size:
                raise ConfigError(
                    f"reasoning-gym {dataset!r} gave only {len(tasks)} distinct {split} "
                    f"questions that the test split does not ask (asked for {size}): lower "
                    f"n_{split} or widen the config"
                )
            self.splits[split] = tasks

    def _create(self, rg: Any, config: dict[str, Any], seed: int, size: int) -> Any:
        known = sorted(rg.factory.DATASETS)
        if self.dataset_name not in known:
            close = difflib.get_close_matches(self.dataset_name, known, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            raise ConfigError(
                f"reasoning-gym has no dataset {self.dataset_name!r}{hint} (it has "
                f"{len(known)}: {', '.join(known[:8])}, ...)"
            )
        for key in ("seed", "size"):
            if key in config:
                raise ConfigError(
                    f"config {key!r}: the environment sets it (pass seed=, n_train=, n_test=)"
                )
        try:
            return rg.create_dataset(self.dataset_name, seed=seed, size=size, **config)
        except (TypeError, ValueError, AssertionError) as e:
            raise ConfigError(f"reasoning-gym {self.dataset_name!r} config {config}: {e}") from None

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in self.splits:
            raise ConfigError(f"split must be one of {sorted(self.splits)}, got {split!r}")
        return self.splits[split]

    async def verified(self, task: Task, state: State) -> float:
        """reasoning-gym's own score of the reply's answer (0 when none is found)."""
        entry = self._entries.get(task.id)
        if entry is None:
            raise ConfigError(
                f"task {task.id!r} is not one of this environment's (reasoning-gym tasks "
                "carry their dataset entry; pass tasks from env.tasks())"
            )
        answer = read_answer(state.completion, self.answer_mode)
        state.info["rm_answer"] = answer
        if answer is None:
            state.info["rm_reason"] = "no answer: no <answer> tag" + (
                " and no number" if self.answer_mode == "tag_or_last_number" else ""
            )
            return 0.0
        data = self._datasets[str(task.info["split"])]
        value = await anyio.to_thread.run_sync(lambda: data.score_answer(answer, entry))
        return float(value)
