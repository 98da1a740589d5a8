"""``reasoning_gym``: datasets by name and config, seeded splits that never overlap, and
reasoning-gym's own verifier as the reward."""

from __future__ import annotations

from typing import Any

import pytest

from agentenv import ChatTokenizer, ConfigError, ScriptedModel, load_environment, run
from environments.reasoning_gym import ReasoningGymEnv, read_answer

DATASETS = ["basic_arithmetic", "gsm_symbolic", "countdown", "chain_sum", "leg_counting"]


@pytest.mark.parametrize("name", DATASETS)
def test_each_dataset_loads_seeded_with_disjoint_splits(name: str) -> None:
    env = ReasoningGymEnv(name, n_train=40, n_test=20, seed=3)
    train, test = env.tasks("train"), env.tasks("test")
    assert (len(train), len(test)) == (40, 20)
    assert not {t.prompt for t in train} & {t.prompt for t in test}
    again = ReasoningGymEnv(name, n_train=40, n_test=20, seed=3)
    assert [t.prompt for t in again.tasks("train")] == [t.prompt for t in train]
    other = ReasoningGymEnv(name, n_train=40, n_test=20, seed=4)
    assert [t.prompt for t in other.tasks("test")] != [t.prompt for t in test]


def test_a_small_question_space_still_gives_disjoint_splits() -> None:
    # One-digit sums of two terms: few distinct questions, many repeats across seeds.
    config = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1,
              "operators": ["+"], "allow_negation": False, "allow_parentheses": False}  # fmt: skip
    env = ReasoningGymEnv("basic_arithmetic", config, n_train=30, n_test=20)
    assert not {t.prompt for t in env.tasks("train")} & {t.prompt for t in env.tasks("test")}
    with pytest.raises(ConfigError, match=r"gave only \d+ distinct train questions that the"):
        ReasoningGymEnv("basic_arithmetic", config, n_train=100, n_test=60)


def test_the_reward_is_reasoning_gyms_own_verifier(smollm2: ChatTokenizer) -> None:
    env = load_environment("reasoning_gym", {"dataset": "leg_counting", "n_train": 12,
                                             "n_test": 2})  # fmt: skip
    answers = {t.prompt: str(t.answer) for t in env.tasks("train")}

    def reply(ctx: Any) -> str:
        right = next(a for q, a in answers.items() if q.strip() in ctx.text)
        # A third tagged and right, a third untagged (the last number) and right, a third wrong.
        return [f"<answer>{right}</answer>", f"I count {right} legs", "<answer>0</answer>"][
            int(right) % 3
        ]

    samples = run(env, ScriptedModel(smollm2, reply)).samples
    by_task = {t.id: str(t.answer) for t in env.tasks("train")}
    rewards = {s.group_id.split("@")[0]: s.reward for s in samples}
    assert rewards == {i: 0.0 if int(a) % 3 == 2 else 1.0 for i, a in by_task.items()}
    assert 0.0 in rewards.values() and 1.0 in rewards.values()
    wrong = next(s for s in samples if s.reward == 0.0)
    assert wrong.metadata["rm_answer"] == "0"


@pytest.mark.parametrize(
    ("reply", "mode", "answer"),
    [
        ("<answer>42</answer>", "tag", "42"),
        ("<answer>1</answer> then <answer> 2 </answer>", "tag", "2"),
        ("it is 42", "tag", None),
        ("it is 41, no 42", "tag_or_last_number", "42"),
        ("<answer>x</answer> 42", "tag_or_last_number", "x"),
        ("nothing", "tag_or_last_number", None),
    ],
)
def test_reading_the_answer(reply: str, mode: str, answer: str | None) -> None:
    assert read_answer(reply, mode) == answer


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"dataset": "leg_countin"}, "no dataset 'leg_countin'; did you mean leg_counting or"),
        ({"config": {"nope": 1}}, "unexpected keyword argument 'nope'"),
        ({"config": {"min_terms": 0}}, "min_terms must be positive"),
        ({"config": {"seed": 1}}, "config 'seed': the environment sets it"),
        ({"n_train": 0}, "n_train and n_test must be at least 1"),
    ],
)
def test_bad_names_and_configs_are_refused(args: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("?", r"\?")):
        ReasoningGymEnv(**args)  # type: ignore[arg-type]
