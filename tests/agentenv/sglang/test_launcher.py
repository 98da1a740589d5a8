"""The launcher: command construction with --sglang-*/--router-* pass-through, and the
lifecycle (health wait, early exit, timeout, clean stop of the process group) against a
stand-in executable."""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

import anyio
import pytest

from agentenv import ConfigError
from agentenv.sglang import Launcher, SGLangError, router_command, server_command, split_passthrough

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

STANDIN = [sys.executable, str(Path(__file__).with_name("standin_server.py"))]


def test_passthrough_strips_the_prefix_and_keeps_values() -> None:
    ours, server, router = split_passthrough(
        [
            "--model",
            "m",
            "--sglang-mem-fraction-static",
            "0.8",
            "--sglang-enable-metrics",
            '--sglang-json-model-override-args={"a": 1}',
            "--sglang-cuda-graph-bs",
            "1",
            "2",
            "4",
            "--sglang-some-offset",
            "-1",
            "--router-policy",
            "consistent_hashing",
            "--steps",
            "3",
        ]
    )
    assert ours == ["--model", "m", "--steps", "3"]
    assert server == [
        "--mem-fraction-static",
        "0.8",
        "--enable-metrics",
        '--json-model-override-args={"a": 1}',
        "--cuda-graph-bs",
        "1",
        "2",
        "4",
        "--some-offset",
        "-1",
    ]
    assert router == ["--policy", "consistent_hashing"]
    with pytest.raises(ConfigError, match="names no flag"):
        split_passthrough(["--sglang-"])


def test_commands() -> None:
    cmd = server_command("/ckpt", port=31000, extra=["--tp-size", "2"])
    assert cmd == [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        "/ckpt",
        "--host",
        "127.0.0.1",
        "--port",
        "31000",
        "--tp-size",
        "2",
    ]
    r = router_command(["http://a:1", "http://b:2"], port=30100, extra=["--policy", "x"])
    assert r[1:3] == ["-m", "sglang_router.launch_router"]
    assert r[r.index("--worker-urls") + 1 : r.index("--worker-urls") + 3] == [
        "http://a:1",
        "http://b:2",
    ]
    assert r[-2:] == ["--policy", "x"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its parent) counts as gone.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


async def test_waits_for_health_passes_flags_and_stops_the_group(tmp_path: Path) -> None:
    port = _port()
    record = tmp_path / "argv.json"
    cmd = server_command(
        "/ckpt",
        port=port,
        program=STANDIN,
        extra=[
            "--record",
            str(record),
            "--unhealthy-polls",
            "3",
            "--child",
            "--mem-fraction-static",
            "0.8",
        ],
    )
    async with Launcher(cmd, f"http://127.0.0.1:{port}", health_timeout=30) as server:
        assert json.loads(await anyio.Path(record).read_text())[-2:] == [
            "--mem-fraction-static",
            "0.8",
        ]
        child = int(await anyio.Path(str(record) + ".child").read_text())
        assert server.process is not None and _alive(server.process.pid) and _alive(child)
        main = server.process.pid
    assert not _alive(main)
    for _ in range(1200):  # the group's SIGKILL reaches the orphaned child (a 60 s bound)
        if not _alive(child):
            break
        await anyio.sleep(0.05)
    assert not _alive(child)


async def test_a_process_that_exits_early_is_reported_with_its_output(tmp_path: Path) -> None:
    port = _port()
    cmd = server_command(
        "/ckpt", port=port, program=STANDIN, extra=["--record", str(tmp_path / "r"), "--exit-early"]
    )
    with pytest.raises(SGLangError, match=r"exited with code 3(.|\n)*CUDA out of memory"):
        async with Launcher(cmd, f"http://127.0.0.1:{port}", health_timeout=30):
            pass


async def test_health_timeout_and_a_process_that_ignores_sigterm(tmp_path: Path) -> None:
    port = _port()
    cmd = server_command(
        "/ckpt",
        port=port,
        program=STANDIN,
        extra=["--record", str(tmp_path / "r"), "--unhealthy-polls", "100000", "--ignore-term"],
    )
    launcher = Launcher(cmd, f"http://127.0.0.1:{port}", health_timeout=1, stop_timeout=0.5)
    with pytest.raises(SGLangError, match="not healthy within 1 s"):
        async with launcher:
            pass
    assert launcher.process is None  # stopped (SIGKILL after SIGTERM was ignored)


async def test_a_missing_program_is_a_clear_error() -> None:
    with pytest.raises(SGLangError, match="cannot start"):
        async with Launcher(["/no/such/program"], "http://127.0.0.1:1"):
            pass
