"""The command line's flags: a mistyped flag of any command is named with the closest
known one."""

from __future__ import annotations

import pytest

from agentenv.cli import main


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["eval", "--env", "arithmetic", "--model", "x", "--max-tokens", "32"],
         "agentenv eval: error: unknown flag --max-tokens; did you mean --max-new-tokens?"),
        (["eval", "--env", "arithmetic", "--model", "x", "--temprature=0.5"],
         "unknown flag --temprature; did you mean --temperature?"),
        (["serve", "--modle", "smollm2-135m"],
         "agentenv serve: error: unknown flag --modle; did you mean --model?"),
        (["bench", "engine", "--grops=3", "--nothing-like-it"],
         "agentenv bench engine: error: unknown flag --grops; did you mean --groups?; "
         "unknown flag --nothing-like-it"),
        (["eval", "--env", "arithmetic", "--model", "x", "stray"],
         "unrecognized arguments: stray"),
    ],
)  # fmt: skip
def test_a_mistyped_flag_is_named_with_the_closest_known_one(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err
