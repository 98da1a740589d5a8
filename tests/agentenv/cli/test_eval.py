"""``agentenv eval`` end to end, in-process and as a subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from agentenv import Sample
from agentenv.cli import main

ROOT = Path(__file__).resolve().parents[3]
ORACLE = str(ROOT / "examples" / "scripts" / "arithmetic_oracle.py")


def test_eval_json_summary_and_samples_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s.jsonl"
    argv = [
        "eval",
        "--env",
        "arithmetic",
        "--model",
        f"scripted:{ORACLE}",
        "--n",
        "20",
        "--n-samples-per-prompt",
        "2",
        "--out",
        str(out),
        "--json",
        "--no-progress",
    ]
    assert main(argv) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads(last)
    for key in (
        "episodes",
        "samples",
        "reward_mean",
        "reward_std",
        "failed",
        "completion_tokens",
        "wall_s",
    ):
        assert key in summary
    assert summary["episodes"] == 40 and summary["samples"] == 40
    assert summary["failed"] == {}
    assert 0.5 < summary["reward_mean"] < 1.0  # the oracle is right 80 % of the time
    samples = [Sample.from_json(line) for line in out.read_text().splitlines()]
    assert len(samples) == 40
    assert sum(len(s.completion_ids) for s in samples) == summary["completion_tokens"]


def test_eval_calculator_uses_tools(capsys: pytest.CaptureFixture[str]) -> None:
    script = str(ROOT / "examples" / "scripts" / "calculator.json")
    assert (
        main(
            ["eval", "--env", "calculator", "--model", f"scripted:{script}", "--n", "10", "--json"]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["reward_mean"] == 1.0 and summary["turns"] == 30


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--env", "nope", "--model", "scripted:x.json"], "unknown environment 'nope'"),
        (["--env", "arithmetic", "--model", "scripted:/no/such.json"], "does not exist"),
        (
            ["--env", "arithmetic", "--model", "http://127.0.0.1:1"],
            "cannot reach the SGLang server at http://127.0.0.1:1",
        ),
        (["--env", "arithmetic", "--model", "/no/such/model"], "/no/such/model"),
        (["--env", "arithmetic", "--model", "scripted:x", "--n", "0"], "--n: Input should be"),
        (["--env", "arithmetic", "--model", "scripted:x", "--env-args", "{bad"], "JSON"),
        (["--env", "arithmetic", "--model", "scripted:x", "--split", "dev"], "invalid choice"),
    ],
)
def test_eval_bad_input_names_the_problem(argv: list[str], message: str) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "agentenv", "eval", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert proc.returncode != 0
    assert message in proc.stderr
    assert "Traceback" not in proc.stderr


def test_eval_out_directory_is_a_durable_buffer(tmp_path: Path) -> None:
    import anyio

    from agentenv.buffer import Buffer, BufferConfig

    out = tmp_path / "buf"
    argv = [
        "eval",
        "--env",
        "arithmetic",
        "--model",
        f"scripted:{ORACLE}",
        "--n",
        "5",
        "--n-samples-per-prompt",
        "3",
        "--out",
        str(out),
        "--no-progress",
    ]
    assert main(argv) == 0
    assert main(argv) == 0  # a second run adds new groups (new run id), never overwrites

    async def read() -> int:
        async with Buffer(BufferConfig(n_samples_per_prompt=3), path=out) as b:
            batch = await b.get_batch(10)
            assert all(len(g.samples) == 3 for g in batch.groups)
            return (await b.statistics()).ready

    assert anyio.run(read) == 0


def test_eval_shows_why_episodes_failed_and_exits_1_when_all_did(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    env_file = tmp_path / "broken_env.py"
    env_file.write_text(
        "from agentenv import Rubric, SingleTurnEnv, Task\n"
        "def grade(task, state):\n"
        "    return float(task.info['points'])\n"
        "class Broken(SingleTurnEnv):\n"
        "    rubric = Rubric(grade)\n"
        "    def tasks(self, split='train'):\n"
        "        return [Task(id=str(i), prompt='hi') for i in range(3)]\n"
    )
    script = tmp_path / "s.json"
    script.write_text('{"rules": [], "default": "x"}')
    argv = ["eval", "--env", f"{env_file}:Broken", "--model", f"scripted:{script}", "--json"]
    assert main([*argv, "--no-progress"]) == 1
    captured = capsys.readouterr()
    reason = f"KeyError: 'points' (at {env_file}:3 in grade)"
    assert f"why failed         3x {reason}" in captured.out
    assert json.loads(captured.out.strip().splitlines()[-1])["failure_reasons"] == [[reason, 3]]
    assert "every sample failed (3 of 3)" in captured.err


def test_eval_refuses_tasks_that_are_not_tasks(tmp_path: Path) -> None:
    env_file = tmp_path / "dict_env.py"
    env_file.write_text(
        "from agentenv import Rubric, SingleTurnEnv\n"
        "class Dicts(SingleTurnEnv):\n"
        "    rubric = Rubric(lambda task, state: 1.0)\n"
        "    def tasks(self, split='train'):\n"
        "        return [{'id': 'a', 'prompt': 'hi'}]\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "agentenv", "eval", "--env", f"{env_file}:Dicts",
         "--model", f"scripted:{ORACLE}"],
        capture_output=True, text=True, cwd=ROOT, timeout=120, check=False,
    )  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "Dicts.tasks('test') must be agentenv.Task objects, but item 0 is dict" in proc.stderr


LONG_ENV = """
from agentenv import Rubric, SingleTurnEnv, Task


class LongEnv(SingleTurnEnv):
    rubric = Rubric(lambda task, state: 1.0)
    sampling = {"max_new_tokens": 40, "temperature": 0.5}

    def tasks(self, split="train"):
        return [Task(id=str(i), prompt=f"say {i}") for i in range(3)]
"""


def test_the_command_line_wins_over_the_environments_sampling_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "long_env.py").write_text(LONG_ENV)
    (tmp_path / "long.py").write_text("def reply(ctx):\n    return 'word ' * 200\n")
    base = ["eval", "--env", f"{tmp_path / 'long_env.py'}:LongEnv", "--model",
            f"scripted:{tmp_path / 'long.py'}", "--json", "--no-progress"]  # fmt: skip
    assert main([*base, "--max-new-tokens", "8"]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["completion_tokens"] == 3 * 8  # the flag, not the environment's 40
    assert "--max-new-tokens 8 wins over LongEnv.sampling's max_new_tokens=40" in caplog.text
    caplog.clear()
    assert main(base) == 0  # not given: the environment's default replaces the command's
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert summary["completion_tokens"] == 3 * 40
    assert "wins over" not in caplog.text
