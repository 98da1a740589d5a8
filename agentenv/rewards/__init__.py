"""Rewards that RL-for-reasoning runs train on: slime's ``--rm-type`` names (``math``,
``deepscaler``, ``dapo``, ``f1``, ``remote_rm``), a user's function
(``--custom-rm-path``; TRL's reward functions through :func:`from_trl`), and an LLM
judge (:class:`JudgeRubric`).

:func:`reward_rubric` builds the :class:`~agentenv.Rubric` slime's flags describe;
:func:`score` judges one response by a rule-based type. ``math`` and ``deepscaler`` check
equivalence with ``math-verify`` (the ``rewards`` extra) in worker processes
(:class:`MathVerifier`). See ``docs/rewards.md``.
"""

from agentenv.rewards._extract import after_thinking, last_boxed, last_number, normalize_text
from agentenv.rewards._judge import (
    JUDGE_TEMPLATE,
    JudgeRubric,
    JudgeStats,
    label_verdict,
    score_verdict,
)
from agentenv.rewards._remote import RemoteReward
from agentenv.rewards._rules import minerva_normalize
from agentenv.rewards._trl import from_trl
from agentenv.rewards._types import (
    RM_TYPES,
    RuleReward,
    check_rm_type,
    load_reward_function,
    reward_rubric,
    score,
)
from agentenv.rewards._verdict import Verdict
from agentenv.rewards._verifier import Equivalence, MathVerifier

__all__ = [
    "JUDGE_TEMPLATE",
    "RM_TYPES",
    "Equivalence",
    "JudgeRubric",
    "JudgeStats",
    "MathVerifier",
    "RemoteReward",
    "RuleReward",
    "Verdict",
    "after_thinking",
    "check_rm_type",
    "from_trl",
    "label_verdict",
    "last_boxed",
    "last_number",
    "load_reward_function",
    "minerva_normalize",
    "normalize_text",
    "reward_rubric",
    "score",
    "score_verdict",
]
