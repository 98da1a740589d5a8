"""The held-out evaluation of a training run (``config.eval``): the mean reward of one
episode per held-out task, greedy by default."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from agentenv import Environment, Task, Tokenizer
    from trainer.engines import RolloutEngine
    from trainer.run._config import TrainConfig

__all__ = ["Evaluator"]


@dataclasses.dataclass(frozen=True, slots=True)
class Evaluator:
    """``await evaluator(policy, concurrency)``: the mean reward on ``tasks`` (``None``
    when there are none)."""

    env: Environment
    tasks: Sequence[Task]
    tokenizer: Tokenizer
    config: TrainConfig
    seed: int = 12345  # the same episodes before, during and after training

    async def __call__(self, policy: RolloutEngine, concurrency: int) -> float | None:
        from agentenv import run_rollouts

        if not self.tasks:
            return None
        rollout = self.config.rollout
        stats = await run_rollouts(
            self.env,
            self.tasks,
            policy,
            tokenizer=self.tokenizer,
            # The rounds' config (template arguments, episode timeout) with one episode a
            # task, the rollouts' sampling at --eval-temperature and the fixed seed.
            config=dataclasses.replace(
                rollout.rollout_config(concurrency),
                n_samples_per_prompt=1,
                sampling=rollout.sampling.replace(temperature=self.config.eval.eval_temperature),
                seed=self.seed,
            ),
        )
        return stats.reward_mean
