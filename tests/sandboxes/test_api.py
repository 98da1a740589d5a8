"""The sandbox API and CLI: bad input, a missing daemon, a container killed mid-job."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from sandboxes import Job, Limits, Sandbox, SandboxError, SandboxUnavailable
from sandboxes import _sandbox as sandbox_module
from sandboxes._docker import DockerBackend
from sandboxes._protocol import run_command

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

CLI = [sys.executable, "-m", "agentenv"]


@pytest.mark.parametrize(
    ("limits", "message"),
    [
        ({"timeout_s": -1}, "timeout_s must be between"),
        ({"timeout_s": float("nan")}, "timeout_s must be between"),
        ({"memory_mb": 10**9}, "memory_mb must be between"),
        ({"pids": 0}, "pids must be between"),
        ({"memory_mb": 1.5}, "memory_mb must be an integer"),
        ({"cpus": "2"}, "cpus must be a number"),
        ({"output_bytes": True}, "output_bytes must be a number"),
    ],
)
def test_bad_limits_are_refused_with_the_field_named(
    limits: dict[str, object], message: str
) -> None:
    with pytest.raises(SandboxError, match=message):
        Limits(**limits)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("../escape.py", "relative path inside"),
        ("/etc/passwd", "relative path inside"),
        ("", "non-empty"),
        ("bad\udcffname", "not valid UTF-8"),
        ("dir/", "relative path inside"),
    ],
)
def test_bad_file_names_are_refused(name: str, message: str) -> None:
    with pytest.raises(SandboxError, match=message):
        Job(cmd=["true"], files={name: "x"})


def test_oversized_files_and_bad_commands_are_refused() -> None:
    with pytest.raises(SandboxError, match=r"more than the \d+ bytes the working directory holds"):
        Job(cmd=["true"], files={"big": b"x" * (2 << 20)}, limits=Limits(tmpfs_mb=1))
    with pytest.raises(SandboxError, match="cmd must be a list of strings"):
        Job(cmd="python3 -c 1")  # type: ignore[arg-type]
    with pytest.raises(SandboxError, match="cmd must name a program"):
        Job(cmd=[])
    with pytest.raises(SandboxError, match="backend must be"):
        Sandbox("podman")  # type: ignore[arg-type]


async def test_a_missing_daemon_is_a_clear_error_not_a_hang() -> None:
    backend = DockerBackend(docker="/nonexistent/docker")
    with pytest.raises(
        SandboxUnavailable, match=r"no Docker daemon answers.*dockerd --bridge=none"
    ):
        await asyncio.wait_for(backend.start(), 30)


async def test_auto_falls_back_to_bwrap_with_a_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_daemon(*args: object, **kwargs: object) -> str:
        return "Cannot connect to the Docker daemon"

    monkeypatch.setattr(sandbox_module, "docker_available", no_daemon)
    with pytest.warns(RuntimeWarning, match="bubblewrap"):
        sandbox = await Sandbox("auto", size=1).start()
    try:
        assert sandbox.backend == "bwrap"
        r = await sandbox.run(["python3", "-c", "print(6 * 7)"])
        assert r.ok and r.stdout == "42\n" and r.backend == "bwrap"
    finally:
        await sandbox.aclose()


@pytest.mark.parametrize("backend", [pytest.param("docker", marks=pytest.mark.docker), "bwrap"])
async def test_a_missing_command_is_reported(backend: str) -> None:
    async with Sandbox(backend, size=1) as sandbox:  # type: ignore[arg-type]
        r = await sandbox.run(["no-such-command", "x"])
        assert r.exit_code == 127 and r.error == "command not found: no-such-command"
        assert not r.ok
        r = await sandbox.run(["python3", "main.py"], files={"main.py": "print('after')"})
        assert r.ok and r.stdout == "after\n"


@pytest.mark.docker
async def test_a_container_killed_mid_job_fails_the_job_and_the_pool_heals() -> None:
    async with Sandbox("docker", size=1) as sandbox:
        job = asyncio.ensure_future(sandbox.run(["sleep", "30"]))
        pool = sandbox._backend.pool_id  # type: ignore[union-attr]
        async with asyncio.timeout(60):  # until the job runs in the pool's container
            while True:
                names = (
                    await run_command(
                        "docker", "ps", "-q", "--filter", f"label=agentenv.sandbox={pool}"
                    )
                ).split()
                assert len(names) <= 1
                if names and "sleep 30" in await run_command("docker", "top", names[0]):
                    break
                await asyncio.sleep(0.05)
        await run_command("docker", "rm", "-f", *names)
        r = await asyncio.wait_for(job, 30)
        assert not r.ok and r.error and "container" in r.error
        r = await sandbox.run(["python3", "-c", "print('healed')"])
        assert r.ok and r.stdout == "healed\n"


def test_cli_exec_prints_one_json_record(tmp_path: Path) -> None:
    script = tmp_path / "main.py"
    script.write_text("print(input()[::-1])\n")
    stdin = tmp_path / "in.txt"
    stdin.write_text("olleh\n")
    out = subprocess.run(
        [*CLI, "sandbox", "exec", "--backend", "bwrap", "--timeout", "5",
         "--file", f"main.py={script}", "--stdin", str(stdin), "--", "python3", "main.py"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    record = json.loads(out.stdout)
    assert record["stdout"] == "hello\n" and record["exit_code"] == 0
    assert record["backend"] == "bwrap" and set(record) >= {
        "exit_code", "stdout", "stderr", "stdout_truncated", "stderr_truncated",
        "timed_out", "oom_killed", "duration_s", "backend",
    }  # fmt: skip


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--file", "x.py=/nonexistent"], "cannot read file '/nonexistent'"),
        (["--file", "noequals"], "--file takes NAME=PATH"),
        (["--timeout", "-3"], "timeout_s must be between"),
        (["--memory", "999999999"], "memory_mb must be between"),
    ],
)
def test_cli_exec_bad_input_exits_2(args: list[str], message: str) -> None:
    out = subprocess.run(
        [*CLI, "sandbox", "exec", "--backend", "bwrap", *args, "--", "true"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_cli_batch_keeps_input_order_and_ids(tmp_path: Path) -> None:
    jobs = tmp_path / "jobs.jsonl"
    lines = [
        {"id": "slow", "cmd": ["python3", "-c", "import time; time.sleep(0.5); print('s')"]},
        {"id": "fast", "files": {"a.py": "print('f')"}, "cmd": ["python3", "a.py"]},
        "not json",
        {"id": "late", "cmd": ["sleep", "5"], "timeout": 0.5},
    ]
    jobs.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines) + "\n")
    out = subprocess.run(
        [*CLI, "sandbox", "batch", str(jobs), "--backend", "bwrap", "--concurrency", "2"],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1  # one line was not a job
    records = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["id"] for r in records] == ["slow", "fast", None, "late"]
    assert records[0]["stdout"] == "s\n" and records[1]["stdout"] == "f\n"
    assert "bad job: line 3" in records[2]["error"]
    assert records[3]["timed_out"]
