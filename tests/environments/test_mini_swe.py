"""mini-swe-agent (the real package, in its own venv) played through the episode endpoint on
Harbor tasks: a scripted model that solves a task scores 1 and one that does not scores 0,
both through the harness's own tool-call loop; a command whose output overflows the context
ends the episode as a truncated sample (``context_length_exceeded``)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

import agentenv
from agentenv import ChatTokenizer, ConfigError, Sample, ScriptedModel, Status
from environments.harbor import DEFAULT_TASKS, load_tasks
from environments.mini_swe import DEFAULT_PYTHON, MiniSweEnv

pytestmark = [pytest.mark.timeout(300)]

SOLUTIONS = {t.name: t.solution for t in load_tasks()}
INSTRUCTIONS = {t.name: t.instruction.strip() for t in load_tasks()}
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"


def bash_call(command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<tool_call>\n{call}\n</tool_call>"


def scripted(first: dict[str, str | None]) -> Any:
    """A model that, in task ``name``, runs ``first[name]`` through mini-swe-agent's bash
    tool, then (once a tool result is in its context) submits; for ``None`` it never
    calls the tool."""

    def script(ctx: Any) -> str:
        name = next(n for n, text in INSTRUCTIONS.items() if text in ctx.text)
        command = first[name]
        if command is None:
            return "I am not sure what to do."
        if "<|im_start|>tool" in ctx.text:
            return "Finished; submitting.\n" + bash_call(SUBMIT)
        return "Let me do it.\n" + bash_call(command)

    return script


@pytest.fixture(scope="module")
def tok() -> ChatTokenizer:
    return ChatTokenizer.load("smollm2-135m")


def play(tok: ChatTokenizer, task: str, command: str | None) -> list[Sample]:
    """Task ``task`` played once by mini-swe-agent and the scripted model."""
    env = MiniSweEnv(step_limit=5)
    tasks = [t for t in env.tasks() if t.id == task]
    model = ScriptedModel(tok, scripted({task: command}))
    return agentenv.run(env, model, tasks=tasks).samples


@pytest.mark.docker
def test_mini_swe_agent_solves_a_task(tok: ChatTokenizer) -> None:
    (solved,) = play(tok, "edit-config", str(SOLUTIONS["edit-config"]))
    assert solved.reward == 1.0 and solved.status is Status.COMPLETED
    # Both calls of the harness's loop are one conversation: one token-exact sample.
    assert solved.metadata["calls"] == 2 and solved.metadata["turns"] == 2
    assert solved.metadata["harness"]["exit_status"] == "Submitted"  # type: ignore[index]
    assert solved.metadata["verifier"]["reason"] == "from reward.txt"  # type: ignore[index]
    # The harness's mini.yaml prompt and bash tool schema, before the task's own words:
    # about a thousand tokens of SmolLM2's context (docs/ecosystem.md quotes it).
    instruction = len(tok.encode(INSTRUCTIONS["edit-config"]))
    assert 900 <= len(solved.prompt_ids) - instruction <= 1100


@pytest.mark.docker
def test_mini_swe_agent_that_does_not_solve_a_task_scores_0(tok: ChatTokenizer) -> None:
    (failed,) = play(tok, "shell-pipeline", "ls")
    assert failed.reward == 0.0 and failed.status is Status.COMPLETED
    assert failed.metadata["calls"] == 2 and failed.metadata["turns"] == 2
    assert failed.metadata["harness"]["exit_status"] == "Submitted"  # type: ignore[index]
    assert failed.metadata["verifier"]["reward"] == 0.0  # type: ignore[index]


@pytest.mark.docker
def test_replies_without_a_tool_call_are_samples_of_their_own(tok: ChatTokenizer) -> None:
    # A reply without a tool call is a format error: mini-swe-agent drops it from its
    # history and asks again, so each of its three tries is a fresh conversation; after
    # the third it gives up and the tests score what is there.
    tries = play(tok, "csv-summary", None)
    assert len(tries) == 3 and all(s.reward == 0.0 and s.status is Status.COMPLETED for s in tries)
    harness = tries[0].metadata["harness"]
    assert harness["exit_status"] == "RepeatedFormatError"  # type: ignore[index]
    assert harness["n_calls"] == 3  # type: ignore[index]


@pytest.mark.docker
def test_an_overflowing_context_ends_the_harness_as_a_truncated_sample(
    tok: ChatTokenizer,
) -> None:
    env = MiniSweEnv()
    tasks = [t for t in env.tasks() if t.id == "edit-config"]
    model = ScriptedModel(tok, scripted({"edit-config": "seq 1 3000"}))
    config = agentenv.RolloutConfig(limits=agentenv.Limits(context_length=2048))
    (sample,) = agentenv.run(env, model, tasks=tasks, config=config).samples
    assert sample.status is Status.TRUNCATED
    assert sample.reason is not None and sample.reason.startswith("context:"), sample.reason
    harness = sample.metadata["harness"]
    assert harness["exit_status"] == "ContextWindowExceededError", harness  # type: ignore[index]
    assert "would exceed context_length 2048" in harness["error"]  # type: ignore[index]
    # The tests still ran: the task was not solved.
    assert sample.reward == 0.0 and sample.metadata["verifier"]["reward"] == 0.0  # type: ignore[index]
    assert sample.metadata["refused_calls"] == 1


@pytest.mark.docker
def test_a_harness_past_the_tasks_agent_timeout_is_killed_and_named(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    task = tmp_path / "edit-config"
    shutil.copytree(DEFAULT_TASKS / "edit-config", task)
    toml = task / "task.toml"
    toml.write_text(toml.read_text().replace("timeout_sec = 300.0", "timeout_sec = 2.0"))
    env = MiniSweEnv(task, step_limit=1000)
    # The model never submits: the harness runs until the task's agent time is up.
    model = ScriptedModel(tok, lambda ctx: bash_call("sleep 5"))
    (sample,) = agentenv.run(env, model, tasks=env.tasks()).samples
    assert sample.status is Status.FAILED
    assert sample.reason is not None
    assert "ran past task 'edit-config''s agent timeout (2 s" in sample.reason, sample.reason


@pytest.mark.docker
def test_a_harness_that_dies_is_a_failed_sample_naming_its_last_words(
    tok: ChatTokenizer, tmp_path: Path
) -> None:
    dying = tmp_path / "python"
    dying.write_text("#!/bin/sh\necho 'harness: out of luck' >&2\nexit 3\n")
    dying.chmod(0o755)
    env = MiniSweEnv(python=dying)
    tasks = [t for t in env.tasks() if t.id == "edit-config"]
    (sample,) = agentenv.run(env, ScriptedModel(tok, lambda ctx: "x"), tasks=tasks).samples
    assert sample.status is Status.FAILED and sample.reason is not None
    assert "mini-swe-agent exited with status 3 before it finished" in sample.reason
    assert "harness: out of luck" in sample.reason


def test_a_missing_harness_python_is_refused_naming_the_fix(tmp_path: Path) -> None:
    env = MiniSweEnv(python=tmp_path / "nope" / "python")
    with pytest.raises(ConfigError, match=r"make \.venv-miniswe/\.installed"):
        env.check()


def test_the_default_harness_python_is_the_makefiles_venv() -> None:
    makefile = (Path(__file__).parents[2] / "Makefile").read_text()
    assert "mini-swe-agent==2.4.6" in makefile
    assert DEFAULT_PYTHON.parts[-3] in makefile
