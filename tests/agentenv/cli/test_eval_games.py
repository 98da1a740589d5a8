"""``agentenv eval`` on game environments: win/draw/loss per seat, intervals, invalid
moves, ``--opponent`` (a named player or a frozen model) and ``--seat``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agentenv.cli import main

ROOT = Path(__file__).resolve().parents[3]
FIRST_LEGAL = f"scripted:{ROOT / 'examples' / 'scripts' / 'first_legal_move.py'}"
TICTACTOE = "environments.games.tictactoe:TicTacToeEnv"


def run_eval(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["eval", *argv, "--json", "--no-progress"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    summary: dict[str, Any] = json.loads(out[-1])
    return summary


def test_against_the_optimal_player(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--env", TICTACTOE, "--model", FIRST_LEGAL, "--opponent", "optimal", "--n", "20"]
    summary = run_eval(argv, capsys)
    assert summary["opponent"] == "optimal"
    for scope in (summary, summary["seats"]["x"], summary["seats"]["o"]):
        for key in ("win_rate", "draw_rate", "loss_rate", "invalid_move_rate"):
            assert key in scope and f"{key}_ci" in scope
    # playing the first free cell never beats perfect play
    assert summary["win_rate"] == 0.0 and summary["seats"]["x"]["episodes"] == 10
    assert summary["loss_rate"] + summary["draw_rate"] == 1.0
    lo, hi = summary["seats"]["o"]["loss_rate_ci"]
    assert lo <= summary["seats"]["o"]["loss_rate"] <= hi and hi - lo < 0.5
    assert summary["invalid_move_rate"] == 0.0 and summary["failed_episodes"] == 0


def test_table_and_a_fixed_seat(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["eval", "--env", TICTACTOE, "--model", FIRST_LEGAL, "--opponent", "random"]
    assert main([*argv, "--seat", "o", "--n", "12", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "opponent           random" in out
    assert "  o                  win " in out and "(n=12)" in out
    assert "  x  " not in out  # only the o seat was played


def test_invalid_moves_are_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = tmp_path / "mute.json"
    script.write_text(json.dumps({"rules": [], "default": "I would rather not say."}))
    argv = ["--env", TICTACTOE, "--model", f"scripted:{script}", "--opponent", "random"]
    summary = run_eval([*argv, "--n", "6", "--env-args", '{"retries": 1}'], capsys)
    assert summary["invalid_move_rate"] == 1.0 and summary["attempts"] == 12
    assert summary["loss_rate"] == 1.0 and summary["forfeits"] == 6


def test_self_play_and_a_frozen_model_opponent(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--env", "environments.games.kuhn_poker:KuhnPokerEnv", "--model", FIRST_LEGAL]
    summary = run_eval([*argv, "--n", "30"], capsys)
    assert summary["opponent"] == "self-play" and summary["seat_episodes"] == 60
    assert set(summary["seats"]) == {"player_0", "player_1"}
    summary = run_eval([*argv, "--n", "30", "--opponent", FIRST_LEGAL], capsys)
    assert summary["opponent"] == FIRST_LEGAL and summary["seat_episodes"] == 30
    # both always check: the higher card wins the ante, whoever holds it
    assert summary["mean_return"] == pytest.approx(0.0, abs=0.5)
    assert summary["draw_rate"] == 0.0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--env", "arithmetic", "--opponent", "random"],
            "--opponent and --seat are for game environments; 'arithmetic' (ArithmeticEnv)",
        ),
        (
            ["--env", TICTACTOE, "--opponent", "optimall"],
            "--opponent 'optimall' is neither a player of",
        ),
        (
            ["--env", TICTACTOE, "--opponent", "random", "--seat", "z"],
            "seat must be 'alternate', 'random' or a role of tictactoe ['x', 'o'], got 'z'",
        ),
        (
            ["--env", TICTACTOE, "--seat", "o"],
            "--seat o needs --opponent: in self-play the model plays every seat",
        ),
    ],
)
def test_bad_opponent_flags(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", *argv, "--model", FIRST_LEGAL, "--n", "2", "--no-progress"]) == 2
    assert message in capsys.readouterr().err
