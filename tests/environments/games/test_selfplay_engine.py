"""Self-play on the real small model (SmolLM2-135M on the embedded engine), end to end:
both seats generate, each turn is a sample with the engine's log-probs, and the episode's
outcome is recorded whatever the untrained model writes."""

from __future__ import annotations

import anyio
import pytest

from agentenv import ChatTokenizer, ListSink, RolloutConfig, SamplingParams, Status, run_rollouts
from agentenv.games import GameTally
from environments.games.tictactoe import TicTacToeEnv

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def test_self_play_on_the_embedded_engine(smollm2: ChatTokenizer) -> None:
    from agentenv.engine import Engine

    env = TicTacToeEnv(max_moves=2)
    sink = ListSink()

    async def go() -> None:
        async with Engine("smollm2-135m", tokenizer=smollm2) as engine:
            await run_rollouts(
                env,
                env.tasks("train")[:1],
                engine,
                tokenizer=smollm2,
                sink=sink,
                config=RolloutConfig(
                    n_samples_per_prompt=2,
                    sampling=SamplingParams(max_new_tokens=8, temperature=1.0),
                    seed=3,
                ),
            )

    anyio.run(go)
    samples = sink.samples
    assert samples and all(s.status is not Status.FAILED for s in samples)
    assert {s.role for s in samples} <= {"x", "o"} and "x" in {s.role for s in samples}
    trained = [s for s in samples if s.trainable]
    assert trained and all(s.rollout_logprobs is not None for s in trained)
    assert all(s.weight_versions for s in trained)
    assert all(s.num_generated <= 8 for s in trained)
    tally = GameTally()
    tally.add(samples)
    summary = tally.summary()
    assert sum(seat["episodes"] for seat in summary["seats"].values()) == 4  # 2 seats x 2
