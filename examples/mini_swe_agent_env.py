"""mini-swe-agent, a command-line agent harness, trained unchanged on Harbor tasks.

The harness (PyPI ``mini-swe-agent`` 2.4.6, in a venv of its own: ``make
.venv-miniswe/.installed``) runs with its own ``mini.yaml``; its litellm model is pointed at
each episode's endpoint and its shell commands run in the task's container. The reward is
what the task's ``tests/test.sh`` says::

    agentenv eval --env examples/mini_swe_agent_env.py:MiniSweHarborEnv --n 2 \\
        --model scripted:examples/scripts/mini_swe_oracle.py --json
    agentenv train --env examples/mini_swe_agent_env.py:MiniSweHarborEnv \\
        --num-rollout 4 --rollout-batch-size 2 --n-samples-per-prompt 4 --json
"""

from __future__ import annotations

from environments.mini_swe import MiniSweEnv


class MiniSweHarborEnv(MiniSweEnv):
    """The bundled Harbor tasks; mini-swe-agent as the ``mini`` command configures it,
    at most ``step_limit`` model calls per episode."""

    def __init__(self, step_limit: int = 8) -> None:
        super().__init__(config=["mini.yaml"], step_limit=step_limit, command_timeout_s=30)
