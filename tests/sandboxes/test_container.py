"""``Container``: one locked-down container whose commands share a file system."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import anyio
import pytest

from sandboxes import SANDBOX_IMAGE, Container, Limits, SandboxError, build_image

pytestmark = [pytest.mark.anyio, pytest.mark.docker]


@pytest.fixture
async def box() -> AsyncIterator[Container]:
    limits = Limits(timeout_s=10, memory_mb=128, pids=64, tmpfs_mb=16, output_bytes=1000)
    async with Container(SANDBOX_IMAGE, limits=limits, host_usr=True) as c:
        yield c


async def processes(box: Container) -> str:
    """The command lines of every process in the container."""
    r = await box.exec(["sh", "-c", "cat /proc/[0-9]*/cmdline | tr '\\0' ' '"], user="0")
    return r.stdout


async def test_commands_share_files_and_run_as_the_user(box: Container) -> None:
    r = await box.exec(["sh", "-c", "echo kept > /tmp/f; id -u"])
    assert r.ok and r.stdout.strip() == "1000"
    assert (await box.exec(["cat", "/tmp/f"])).stdout == "kept\n"
    root = await box.exec(["id", "-u"], user="0")
    assert root.stdout.strip() == "0"


async def test_limits_timeouts_output_and_no_network(box: Container) -> None:
    big = await box.exec(["sh", "-c", "yes | head -c 100000"])
    assert big.stdout_truncated and len(big.stdout) == 1000
    slow = await box.exec(["sh", "-c", "sleep 60 & sleep 60"], timeout_s=1)
    assert slow.timed_out and slow.exit_code == -9
    assert "sleep 60" not in await processes(box)  # the whole process group died
    # Its processes, orphaned, are reaped by the container's init (no zombies fill `pids`).
    for _ in range(300):  # (a 60 s bound)
        zombies = await box.exec(["sh", "-c", "cat /proc/[0-9]*/stat | grep -c ') Z '"])
        if zombies.stdout.strip() == "0":
            break
        await anyio.sleep(0.2)
    assert zombies.stdout.strip() == "0"
    net = await box.exec(
        ["python3", "-c", "import socket; socket.create_connection(('1.1.1.1', 53), 2)"]
    )
    assert net.exit_code != 0
    ro = await box.exec(["touch", "/usr/x"], user="0")
    assert ro.exit_code != 0 and "Read-only" in ro.stderr


async def test_put_replaces_what_was_there_and_kill_all_keeps_the_container(
    box: Container,
) -> None:
    # put writes the image's file system (``docker cp`` cannot reach a tmpfs like /tmp).
    await box.exec(["sh", "-c", "mkdir -p /srv/t && echo fake > /srv/t/old"], user="0")
    await box.exec(["ln", "-s", "/srv/t", "/srv/link"], user="0")
    await box.put({"/srv/link/x": {"a/b.txt": b"hi"}, "/srv/t": {"new": b"1"}})
    assert (await box.exec(["ls", "/srv/t"])).stdout == "new\n"
    assert await box.read("/srv/link/x/a/b.txt") == b"hi"
    assert (await box.exec(["test", "-L", "/srv/link"])).exit_code == 1  # the link is gone
    denied = await box.exec(["sh", "-c", "echo x > /srv/t/new"])
    assert denied.exit_code != 0
    await box.exec(["sh", "-c", "setsid sleep 600 >/dev/null 2>&1 &"])
    await box.exec(["sh", "-c", "setsid sleep 601 >/dev/null 2>&1 &"], user="0")
    await box.kill_all()
    left = await processes(box)
    assert "sleep 600" not in left and "sleep 601" not in left and "while :" in left  # init
    assert await box.read("/tmp/none") is None
    with pytest.raises(SandboxError, match="absolute"):
        await box.put({"relative": {}})


async def test_a_failed_build_names_the_error(tmp_path: Path) -> None:
    (tmp_path / "Dockerfile").write_text(f"FROM {SANDBOX_IMAGE}\nRUN exit 3\n")
    with pytest.raises(SandboxError, match=r"docker build of .* failed"):
        await build_image(tmp_path, "agentenv-test-broken:1", timeout_s=120)
