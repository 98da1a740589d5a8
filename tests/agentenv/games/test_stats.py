"""Outcomes of general-sum games, and the per-role figures a training step logs."""

from __future__ import annotations

import pytest

from agentenv import (
    ChatTokenizer,
    Game,
    GameEnv,
    ListSink,
    Message,
    RolloutConfig,
    Sample,
    ScriptedModel,
    run_rollouts,
)
from agentenv._scripted import ScriptContext
from agentenv.cli import main
from agentenv.games import GameTally

pytestmark = pytest.mark.timeout(60)


class Split(Game):
    """A general-sum game: the proposer offers the responder ``k`` of 10 coins; accepted,
    the proposer keeps ``10 - k``, both gain; rejected, neither gets anything."""

    name = "split"
    roles = ("proposer", "responder")

    def reset(self, seed: int) -> None:
        self.moves: list[str] = []

    def current_role(self) -> str | None:
        return self.roles[len(self.moves)] if len(self.moves) < 2 else None

    def legal_actions(self) -> list[str] | None:
        return [str(k) for k in range(11)] if not self.moves else ["accept", "reject"]

    def apply(self, action: str) -> None:
        self.moves.append(action)

    def returns(self) -> dict[str, float]:
        offer = int(self.moves[0])
        if self.moves[1] == "reject":
            return {"proposer": 0.0, "responder": 0.0}
        return {"proposer": 10.0 - offer, "responder": float(offer)}

    def observation(self, role: str) -> list[Message]:
        return [{"role": "user", "content": f"You are the {role}. Moves: {self.moves}"}]


class SplitEnv(GameEnv):
    def __init__(self, **kwargs: object) -> None:
        super().__init__(Split, n_test=4, **kwargs)  # type: ignore[arg-type]


def offering(k: int, answer: str = "accept"):  # type: ignore[no-untyped-def]
    def reply(ctx: ScriptContext) -> str:
        return f"[{k}]" if "You are the proposer" in ctx.text else f"[{answer}]"

    return reply


async def outcomes(tok: ChatTokenizer, k: int, answer: str = "accept") -> dict[str, object]:
    env = SplitEnv()
    sink = ListSink()
    await run_rollouts(env, env.tasks("test")[:2], ScriptedModel(tok, offering(k, answer)),
                       tokenizer=tok, sink=sink, config=RolloutConfig())  # fmt: skip
    tally = GameTally()
    tally.add(sink.samples)
    return tally.summary()["seats"]  # type: ignore[no-any-return]


@pytest.mark.anyio
async def test_a_seat_wins_only_by_beating_every_other_seat(smollm2: ChatTokenizer) -> None:
    # Both seats gain 6 and 4 coins: the proposer wins, the responder loses (not two wins).
    seats = await outcomes(smollm2, 4)
    assert seats["proposer"]["win_rate"] == 1.0 and seats["responder"]["loss_rate"] == 1.0  # type: ignore[index]
    assert seats["proposer"]["mean_return"] == 6.0 and seats["responder"]["mean_return"] == 4.0  # type: ignore[index]
    even = await outcomes(smollm2, 5)  # 5 and 5: a draw for both
    assert even["proposer"]["draw_rate"] == 1.0 and even["responder"]["draw_rate"] == 1.0  # type: ignore[index]
    nothing = await outcomes(smollm2, 3, "reject")  # 0 and 0
    assert nothing["proposer"]["draw_rate"] == 1.0  # type: ignore[index]


def test_eval_shows_each_seats_return(capsys: pytest.CaptureFixture[str], tmp_path: object) -> None:
    from pathlib import Path

    script = Path(str(tmp_path)) / "offer.json"
    script.write_text(
        '{"rules": [{"pattern": "You are the proposer", "reply": "[4]"}], "default": "[accept]"}'
    )
    argv = ["eval", "--env", f"{__file__}:SplitEnv", "--model", f"scripted:{script}"]
    assert main([*argv, "--n", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "proposer           win 1.000" in out and "return 6.000" in out
    assert "responder          win 0.000" in out and "loss 1.000" in out


def _turn(role: str, reward: float, outcome: str, invalid: int, final: bool) -> Sample:
    meta = {"outcome": outcome, "return": reward, "attempts": 1 + invalid, "invalid": invalid}
    return Sample(prompt_ids=[1], completion_ids=[2], reward=reward, role=role, group_id="g",
                  metadata={**meta, "final": final} if final else meta)  # fmt: skip


def test_game_metrics_per_role_for_a_training_step() -> None:
    from agentenv.games import game_metrics

    samples = [
        _turn("x", 1.0, "win", 0, False),
        _turn("x", 1.0, "win", 1, True),
        _turn("o", -1.0, "loss", 0, True),
        _turn("x", 0.0, "draw", 0, True),
        _turn("o", 0.0, "draw", 1, True),
    ]
    m = game_metrics(samples)
    assert m["game/x/win_rate"] == 0.5 and m["game/x/draw_rate"] == 0.5
    assert m["game/o/win_rate"] == 0.0 and m["game/o/loss_rate"] == 0.5
    assert m["game/x/reward_mean"] == pytest.approx(2 / 3)
    assert m["game/o/reward_mean"] == -0.5
    assert m["game/x/invalid_move_rate"] == 0.25  # 1 invalid reply in 4
    assert m["game/o/invalid_move_rate"] == pytest.approx(1 / 3)
    assert m["game/win_rate"] == 0.25 and m["game/invalid_move_rate"] == pytest.approx(2 / 7)
    assert game_metrics([Sample(prompt_ids=[1], completion_ids=[2], reward=1.0)]) == {}
