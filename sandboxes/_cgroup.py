"""Per-job cgroups for the bubblewrap backend: a real pids cap and memory limit.

Without them a job run by root-owned bubblewrap is only bounded by rlimits, and the kernel
does not apply ``RLIMIT_NPROC`` to processes that are root outside the user namespace: a
fork bomb would fill the host's pid table until the namespace dies. Where the cgroup v1
``pids`` and ``memory`` hierarchies are writable (root), each job gets its own group under
``agentenv/``; where they are not, the backend falls back to rlimits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid
from pathlib import Path

__all__ = ["JobCgroup", "cgroups_available"]

ROOT = Path("/sys/fs/cgroup")
PARENT = "agentenv-sandbox"


def cgroups_available() -> bool:
    """Whether per-job pids and memory groups can be made here."""
    for controller in ("pids", "memory"):
        base = ROOT / controller
        if not (base / "cgroup.procs").exists():
            return False
        try:
            (base / PARENT).mkdir(exist_ok=True)
        except OSError:
            return False
        if not os.access(base / PARENT, os.W_OK):
            return False
    return True


class JobCgroup:
    """One job's pids and memory groups; processes join by writing their pid."""

    def __init__(self, *, pids: int, memory_mb: int) -> None:
        name = uuid.uuid4().hex[:16]
        self.pids_dir = ROOT / "pids" / PARENT / name
        self.memory_dir = ROOT / "memory" / PARENT / name
        self.pids_dir.mkdir()
        self.memory_dir.mkdir()
        (self.pids_dir / "pids.max").write_text(str(pids))
        limit = str(memory_mb << 20)
        (self.memory_dir / "memory.limit_in_bytes").write_text(limit)
        with contextlib.suppress(OSError):  # swap accounting may be off
            (self.memory_dir / "memory.memsw.limit_in_bytes").write_text(limit)

    @property
    def procs_files(self) -> tuple[str, str]:
        return (str(self.pids_dir / "cgroup.procs"), str(self.memory_dir / "cgroup.procs"))

    def oom_kills(self) -> int:
        with contextlib.suppress(OSError, ValueError):
            for line in (self.memory_dir / "memory.oom_control").read_text().splitlines():
                name, _, value = line.partition(" ")
                if name == "oom_kill":
                    return int(value)
        return 0

    def remove(self) -> None:
        """Kill whatever is left in the groups and delete them."""
        for _ in range(200):
            pids = self._pids()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.005)
        for d in (self.pids_dir, self.memory_dir):
            with contextlib.suppress(OSError):
                d.rmdir()

    def _pids(self) -> list[int]:
        try:
            text = (self.pids_dir / "cgroup.procs").read_text()
        except OSError:
            return []
        return [int(p) for p in text.split()]
