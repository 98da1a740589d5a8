"""environments.verifiers against the real verifiers 0.4.0 (in .venv-verifiers): tiny
tasksets written with verifiers' own v1 API (tests/environments/verifiers_data) played by
verifiers' stock ``null`` harness, its model calls answered by agentenv's episode endpoint."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from agentenv import ChatTokenizer, ConfigError, Limits, ScriptedModel, Status, run
from agentenv._scripted import ScriptContext
from environments.verifiers import DEFAULT_PYTHON, VerifiersEnv

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.slow,
    pytest.mark.skipif(
        not DEFAULT_PYTHON.exists(),
        reason="needs .venv-verifiers (make .venv-verifiers/.installed; `make test` makes it)",
    ),
]

DATA = Path(__file__).with_name("verifiers_data")


def vf_env(taskset: str, **kwargs: Any) -> VerifiersEnv:
    config = {"taskset": {"id": taskset}, "agent": {"harness": {"id": "null"}}}
    return VerifiersEnv(config, pythonpath=[str(DATA)], **kwargs)


def script(ctx: ScriptContext) -> str:
    """Echo the number asked for; add with the tool, then state its result."""
    text = ctx.text
    result = re.findall(r"tool_response>\n(-?\d+)", text)
    if result:
        return f"The answer is {result[-1]}."
    add = re.findall(r"What is (\d+)\+(\d+)\?", text)
    if add:
        call = {"name": "add", "arguments": {"a": int(add[-1][0]), "b": int(add[-1][1])}}
        return f"<tool_call>{json.dumps(call)}</tool_call>"
    number = re.findall(r"Say the number (\d+)", text)
    return f"The number is {number[-1]}." if number else "hi"


def test_single_turn_taskset_scores_with_verifiers_rubric(smollm2: ChatTokenizer) -> None:
    env = vf_env("agentenv_vf_echo")
    assert [t.prompt for t in env.tasks()] == [f"Say the number {n}." for n in (3, 14, 15)]
    result = run(env, ScriptedModel(smollm2, script))
    assert len(result.samples) == 3
    for task, s in zip(
        env.tasks(), sorted(result.samples, key=lambda s: str(s.task_id)), strict=True
    ):
        assert s.status is Status.COMPLETED and s.reward == 1.0, s.reason
        assert s.metadata["calls"] == 1 and s.metadata["verifiers_turns"] == 1
        # Token-exact: the ids are the template's rendering of verifiers' request + reply.
        number = str(task.prompt).split()[-1].rstrip(".")
        assert smollm2.decode(s.completion_ids) == f"The number is {number}.<|im_end|>"
        assert "Say the number" in smollm2.decode(s.prompt_ids)


def test_toolset_taskset_runs_its_mcp_tool(chatml_tools: ChatTokenizer) -> None:
    env = vf_env("agentenv_vf_add")
    result = run(env, ScriptedModel(chatml_tools, script))
    assert len(result.samples) == 2
    for s in result.samples:
        assert s.status is Status.COMPLETED and s.reward == 1.0, s.reason
        assert s.metadata["calls"] == 2
        text = chatml_tools.decode(s.completion_ids)
        # The tool result in the sample came from verifiers' MCP tool server.
        answer = re.findall(r"tool_response>\n(\d+)", text)
        assert answer and text.endswith(f"The answer is {answer[0]}.<|im_end|>")


def test_rubric_that_raises_is_a_failed_sample_naming_it(smollm2: ChatTokenizer) -> None:
    result = run(vf_env("agentenv_vf_raises"), ScriptedModel(smollm2, script))
    [s] = result.samples
    assert s.status is Status.FAILED
    assert "BrokenTask" in (s.reason or "") and "broken on purpose" in (s.reason or "")


def test_dead_worker_fails_its_episode_and_is_restarted(smollm2: ChatTokenizer) -> None:
    env = vf_env("agentenv_vf_dies", max_concurrency=1)
    result = run(env, ScriptedModel(smollm2, script))
    by_task = {s.task_id: s for s in result.samples}
    dead, alive = by_task["verifiers/0"], by_task["verifiers/1"]
    assert dead.status is Status.FAILED
    assert "died with exit code 3" in (dead.reason or "")
    assert alive.status is Status.COMPLETED and alive.reward == 1.0, alive.reason


class HangsOnThree(ScriptedModel):
    """The echo script, but the call for "Say the number 3." never returns."""

    async def generate(self, input_ids: Any, params: Any, *, rid: str | None = None) -> Any:
        if "Say the number 3." in self.tokenizer.decode(list(input_ids)):
            await anyio.sleep_forever()
        return await super().generate(input_ids, params, rid=rid)


def test_an_episode_given_up_on_frees_its_worker_slot_at_once(smollm2: ChatTokenizer) -> None:
    """One worker, one episode at a time: the hung episode times out on our side, the worker
    cancels its harness, and the next episodes run in its slot (they would otherwise wait
    for verifiers' own timeout, and time out too)."""
    env = vf_env("agentenv_vf_echo", max_concurrency=1)
    result = run(env, HangsOnThree(smollm2, script), limits=Limits(timeout_s=45), concurrency=1)
    by_task = {s.task_id: s for s in result.samples}
    hung = by_task["verifiers/0"]
    assert hung.status is Status.FAILED and "timeout" in (hung.reason or ""), hung.reason
    for key in ("verifiers/1", "verifiers/2"):
        assert by_task[key].status is Status.COMPLETED and by_task[key].reward == 1.0, by_task[key]
    assert len(env._pool) == 1  # the same worker played them


def test_environment_that_cannot_be_loaded_is_named_with_the_fix() -> None:
    env = VerifiersEnv("agentenv_no_such_taskset", pythonpath=[str(DATA)])
    with pytest.raises(ConfigError) as info:
        env.tasks()
    message = str(info.value)
    assert "'agentenv_no_such_taskset' cannot be loaded" in message
    assert "taskset 'agentenv_no_such_taskset' not found" in message  # verifiers' own reason
    assert "fix:" in message and "pip install" in message


def test_missing_interpreter_names_the_make_target(tmp_path: Path) -> None:
    env = VerifiersEnv("agentenv_vf_echo", python=str(tmp_path / "nope" / "python"))
    with pytest.raises(ConfigError, match=r"make \.venv-verifiers/\.installed"):
        env.tasks()


def test_agentenv_eval_plays_a_verifiers_environment(tmp_path: Path) -> None:
    script_file = tmp_path / "echo.py"
    script_file.write_text(
        "import re\n\n\ndef reply(ctx):\n"
        "    return 'The number is ' + re.findall(r'Say the number (\\d+)', ctx.text)[-1]\n"
    )
    args = {
        "env": {"taskset": {"id": "agentenv_vf_echo"}, "agent": {"harness": {"id": "null"}}},
        "pythonpath": [str(DATA)],
    }
    out = subprocess.run(
        [sys.executable, "-m", "agentenv", "eval", "--env", "environments.verifiers:VerifiersEnv",
         "--env-args", json.dumps(args), "--model", f"scripted:{script_file}", "--json"],
        capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout.splitlines()[-1])
    assert summary["samples"] == 3 and summary["reward_mean"] == 1.0, summary


@pytest.mark.timeout(600)
def test_agentenv_train_trains_two_steps_on_a_verifiers_environment(tmp_path: Path) -> None:
    from tests._train import train_two_steps

    args = {
        "env": {"taskset": {"id": "agentenv_vf_shaped"}, "agent": {"harness": {"id": "null"}}},
        "pythonpath": [str(DATA)],
    }
    lines = train_two_steps(
        "environments.verifiers:VerifiersEnv", tmp_path / "run", "--env-args", json.dumps(args)
    )
    assert all(m["failed_episodes"] == 0 and m["samples"] == 2 for m in lines)
    trained = [m for m in lines if "train/grad_norm" in m]  # a step whose groups all tie skips
    assert trained and all(m["train/grad_norm"] > 0 for m in trained)
    # The trainer's log-probs of the recorded ids are the engine's: the samples are exact.
    assert all(m["train/rollout_train_logprob_abs_diff"] < 1e-4 for m in trained)


def test_harness_that_crashes_is_a_failed_sample_naming_it(smollm2: ChatTokenizer) -> None:
    config = {
        "taskset": {"id": "agentenv_vf_echo"},
        "agent": {"harness": {"id": "agentenv_vf_crash_harness"}},
    }
    result = run(VerifiersEnv(config, pythonpath=[str(DATA)]), ScriptedModel(smollm2, script))
    assert len(result.samples) == 3
    for s in result.samples:
        assert s.status is Status.FAILED and s.error_type == "VerifiersError"
        assert "crashed on purpose" in (s.reason or ""), s.reason
