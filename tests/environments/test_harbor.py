"""Harbor-format tasks: every bundled task played by its reference solution (reward 1) and by
a wrong agent (reward 0) through the ``bash`` tool; bad task directories refused at load; a
task whose image does not build fails alone, by name; an agent's tampering scores 0."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from agentenv import (
    ChatTokenizer,
    ConfigError,
    ListSink,
    RolloutConfig,
    SamplingParams,
    ScriptedModel,
    Status,
    run_rollouts,
)
from environments.harbor import DEFAULT_TASKS, HarborEnv, Verdict, format_output, load_tasks

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(600)]

TASKS = sorted(d.name for d in DEFAULT_TASKS.iterdir() if d.is_dir())
CONFIG = RolloutConfig(n_samples_per_prompt=1, sampling=SamplingParams(max_new_tokens=2048))


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
async def env() -> HarborEnv:
    """The bundled tasks with every image built once for the module."""
    harbor = HarborEnv(command_timeout_s=30)
    assert await harbor.build_all() == {name: None for name in TASKS}
    return harbor


def bash_call(command: str) -> str:
    call = json.dumps({"name": "bash", "arguments": {"command": command}})
    return f"<tool_call>\n{call}\n</tool_call>"


def agent(commands: dict[str, str]) -> Any:
    """A scripted agent: in task ``name``'s first turn it runs ``commands[name]`` with the
    bash tool, then it says it is done."""

    def script(ctx: Any) -> str:
        group, _, _, turn = ctx.rid.split("/")[:4]
        return bash_call(commands[group.split("@")[0]]) if int(turn) == 0 else "Done."

    return script


async def play(
    env: HarborEnv, tokenizer: ChatTokenizer, commands: dict[str, str]
) -> dict[str, Any]:
    sink = ListSink()
    tasks = [t for t in env.tasks() if t.id in commands]
    await run_rollouts(
        env, tasks, ScriptedModel(tokenizer, agent(commands)), tokenizer=tokenizer,
        sink=sink, config=CONFIG,
    )  # fmt: skip
    # Group ids are the task's id and a run tag: ``edit-config@1a2b3c4d``.
    return {str(s.group_id).split("@")[0]: s for s in sink.samples}


def test_the_bundled_tasks_are_in_harbor_format() -> None:
    tasks = load_tasks()
    assert len(tasks) >= 6
    for t in tasks:
        assert t.solution, t.name
        assert "test.sh" in t.tests and t.instruction.strip(), t.name
        assert t.dockerfile.is_file(), t.name


@pytest.mark.docker
@pytest.mark.slow
async def test_every_task_scores_1_for_its_solution_and_0_for_a_wrong_agent(
    env: HarborEnv, chatml_tools: ChatTokenizer
) -> None:
    oracle = await play(env, chatml_tools, {n: env.harbor_tasks[n].solution or "" for n in TASKS})
    wrong = await play(env, chatml_tools, dict.fromkeys(TASKS, "ls -la; cat *.md 2>/dev/null"))
    assert sorted(oracle) == sorted(wrong) == TASKS
    assert {n: s.reward for n, s in oracle.items()} == dict.fromkeys(TASKS, 1.0), {
        n: s.metadata for n, s in oracle.items()
    }
    assert {n: s.reward for n, s in wrong.items()} == dict.fromkeys(TASKS, 0.0)
    for s in [*oracle.values(), *wrong.values()]:
        assert s.status is Status.COMPLETED, s.reason
        assert s.metadata["tool_calls"] == 1
    text = chatml_tools.decode(list(oracle["fix-failing-test"].completion_ids))
    assert "Ran 3 tests" in text and "OK" in text  # the solution's output reached the model
    verdict = wrong["fix-failing-test"].metadata["verifier"]
    assert isinstance(verdict, dict) and "FAIL" in str(verdict["output"])


def copy_task(name: str, into: Path) -> Path:
    return Path(shutil.copytree(DEFAULT_TASKS / name, into / name))


def test_a_task_without_tests_is_refused_by_name(tmp_path: Path) -> None:
    copy_task("edit-config", tmp_path)
    broken = copy_task("shell-pipeline", tmp_path)
    (broken / "tests" / "test.sh").unlink()
    with pytest.raises(ConfigError, match=r"'shell-pipeline'.*tests/test\.sh"):
        HarborEnv(tmp_path)
    (broken / "tests" / "test.sh").write_text("#!/bin/bash\n")
    (broken / "task.toml").write_text("[verifier]\ntimeout_sec = -1\n")
    with pytest.raises(ConfigError, match=r"shell-pipeline.*timeout_sec must be a positive"):
        HarborEnv(tmp_path)


@pytest.mark.docker
async def test_a_task_whose_image_fails_to_build_fails_alone_by_name(
    tmp_path: Path, chatml_tools: ChatTokenizer
) -> None:
    good = copy_task("edit-config", tmp_path)
    bad = copy_task("shell-pipeline", tmp_path)
    (bad / "environment" / "Dockerfile").write_text("FROM agentenv-sandbox:2\nRUN exit 3\n")
    harbor = HarborEnv(tmp_path)
    solutions = {t.name: t.solution or "" for t in harbor.harbor_tasks.values()}
    samples = await play(harbor, chatml_tools, solutions)
    assert samples[good.name].reward == 1.0 and samples[good.name].status is Status.COMPLETED
    failed = samples["shell-pipeline"]
    assert failed.status is Status.FAILED and failed.error_type == "HarborBuildError"
    assert "'shell-pipeline'" in (failed.reason or "") and "did not build" in (failed.reason or "")
    report = await harbor.build_all()
    assert report["edit-config"] is None and "shell-pipeline" in (report["shell-pipeline"] or "")


async def tamper(env: HarborEnv, task: str, *commands: str) -> Verdict:
    """Run the agent's ``commands`` in a fresh container of ``task``, then its tests."""
    async with env.session(task) as session:
        for command in commands:
            await session.bash(command, timeout_s=20)
        return await session.verify()


# Each hack runs where it has the most power: edit-config's agent is root.
HACKS = {
    "edit the task's visible tests": (
        "fix-failing-test",
        "printf 'import unittest\\nclass T(unittest.TestCase):\\n    def test(self): pass\\n'"
        " > /app/test_stats.py && python3 -m unittest test_stats",
    ),
    "exit early from the code under test": (
        "fix-failing-test",
        "printf 'import os\\nos._exit(0)\\n' > /app/stats.py",
    ),
    "code under test writes the reward": (
        "csv-summary",
        'printf \'import os\\nos.makedirs("/logs/verifier", exist_ok=True)\\n'
        'open("/logs/verifier/reward.txt", "w").write("1")\\n\' > /app/summarize.py',
    ),
    "fake reward file and tests beforehand": (
        "edit-config",
        "mkdir -p /logs/verifier /tests && echo 1 > /logs/verifier/reward.txt && "
        "echo '{\"reward\": 1}' > /logs/verifier/reward.json && "
        "printf '#!/bin/bash\\necho 1 > /logs/verifier/reward.txt\\n' > /tests/test.sh",
    ),
    "a process left behind rewrites the reward": (
        "edit-config",
        "nohup setsid sh -c 'while :; do mkdir -p /logs/verifier; echo 1 > "
        "/logs/verifier/reward.txt; echo exit > /tests/test.sh; sleep 0.01; done' "
        ">/dev/null 2>&1 &",
    ),
    "replace bash and python": (
        "edit-config",
        "cp /bin/true /usr/bin/python3; cp /bin/true /bin/bash; printf '#!/bin/sh\\nexit 0\\n'"
        " > /sbin/python3; chmod +x /sbin/python3; mkdir -p /root; "
        "echo 'PATH=/sbin' >> /root/.bashrc; true",
    ),
    "kill everything": ("edit-config", "kill -9 -1; kill -9 1; true"),
    "kill everything as the agent's user": ("find-permissions", "kill -9 -1; true"),
}


@pytest.mark.docker
@pytest.mark.slow
@pytest.mark.parametrize("hack", sorted(HACKS))
async def test_tampering_scores_0(env: HarborEnv, hack: str) -> None:
    task, command = HACKS[hack]
    verdict = await tamper(env, task, command)
    assert verdict.reward == 0.0, verdict
    assert verdict.reason == "from reward.txt" and "FAIL" in verdict.output, verdict


@pytest.mark.docker
async def test_the_tests_still_pass_after_an_agent_killed_everything(env: HarborEnv) -> None:
    solve = env.harbor_tasks["edit-config"].solution or ""
    verdict = await tamper(env, "edit-config", solve, "kill -9 -1; kill -9 1; true")
    assert verdict.reward == 1.0, verdict


@pytest.mark.docker
async def test_bash_output_is_capped_and_commands_time_out(env: HarborEnv) -> None:
    async with env.session("shell-pipeline") as session:
        big = await session.bash("yes 0123456789 | head -c 10000000", timeout_s=20)
        assert big.stdout_truncated and len(big.stdout) <= 1 << 16  # the host keeps 64 KiB
        seen = format_output(big, env.output_chars)  # what the model reads
        assert len(seen) <= env.output_chars + 100 and seen.endswith("[output truncated]")
        slow = await session.bash("sleep 2 & sleep 30", timeout_s=1)
        assert slow.timed_out
        net = await session.bash(
            "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), 2)'",
            timeout_s=20,
        )
        assert net.exit_code != 0 and "unreachable" in net.stderr.lower(), net
        who = await session.bash("id -u; touch /usr/x /etc/x 2>&1 | wc -l", timeout_s=20)
        assert who.stdout.split() == ["1000", "2"]


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.docker
@pytest.mark.slow
def test_the_docs_example_runs_as_shown() -> None:
    doc = (ROOT / "docs" / "ecosystem.md").read_text()
    section = doc.split("## Harbor tasks (Terminal-Bench format)", 1)[1].split("\n## ", 1)[0]
    oracle = (ROOT / "examples" / "scripts" / "harbor_oracle.py").read_text()
    assert f"```python\n{oracle}```" in section
    command = re.search(r"```bash\n(agentenv eval .*?)```", section, re.DOTALL)
    assert command is not None
    argv = command.group(1).replace("\\\n", " ").split()
    out = subprocess.run(
        [str(Path(sys.executable).with_name("agentenv")), *argv[1:]],
        cwd=ROOT, capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["episodes"] == len(TASKS) and report["reward_mean"] == 1.0, report


@pytest.mark.docker
async def test_a_cancelled_episode_removes_its_container(env: HarborEnv) -> None:
    names: list[str] = []
    started = asyncio.Event()

    async def episode() -> None:
        async with env.session("edit-config") as session:
            names.append(session.container.name)
            started.set()
            await session.bash("sleep 60", timeout_s=120)

    task = asyncio.create_task(episode())
    await asyncio.wait_for(started.wait(), 120)
    task.cancel()
    for _ in range(5):  # into the clean-up, then cancelled again (a run shutting down)
        await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(600):  # the removal runs shielded, past the cancellations (2 min bound)
        ps = await asyncio.create_subprocess_exec(
            "docker", "ps", "-aq", "--filter", f"name={names[0]}",
            stdout=asyncio.subprocess.PIPE,
        )  # fmt: skip
        left = (await ps.communicate())[0].decode().strip()
        if not left:
            break
        await asyncio.sleep(0.2)
    assert left == ""


@pytest.mark.docker
async def test_the_agent_timeout_ends_the_episode_and_the_tests_still_run(
    tmp_path: Path, chatml_tools: ChatTokenizer
) -> None:
    task = copy_task("edit-config", tmp_path)
    toml = (task / "task.toml").read_text().replace("timeout_sec = 300.0", "timeout_sec = 2.0")
    (task / "task.toml").write_text(toml)
    harbor = HarborEnv(tmp_path)
    assert harbor.harbor_tasks["edit-config"].config.agent_timeout_s == 2.0
    samples = await play(harbor, chatml_tools, {"edit-config": "sleep 60; echo never"})
    s = samples["edit-config"]
    assert s.status is Status.TRUNCATED and s.reason == "agent timeout: 2 s", s.reason
    assert s.reward == 0.0 and "FAIL" in str(s.metadata["verifier"])
    assert s.metadata["tool_calls"] == 1  # the command was killed at the deadline
