"""How much memory the processes of a run have held at most, read from ``/proc`` (Linux):
one reading for the driver, the trainer ranks, the engines and the rollout workers alike."""

from __future__ import annotations

import os

__all__ = ["peak_rss_gib"]


def peak_rss_gib(pid: int | None = None, *, descendants: bool = False) -> float:
    """The peak resident set of process ``pid`` (default: this one) in GiB, as Linux
    keeps it (``VmHWM`` in ``/proc/PID/status``: a lifetime peak, never reset); with
    ``descendants`` the largest over it and every process below it (a server's
    schedulers). 0.0 for a process that is gone or unreadable."""
    pids = [os.getpid() if pid is None else pid]
    if descendants:
        pids += _descendants(pids[0])
    return max(_vm_hwm_kib(p) for p in pids) / 2**20


def _vm_hwm_kib(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return 0


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` now (its children, theirs, ...), from ``/proc``."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                # "PID (COMM) STATE PPID ...": COMM may hold spaces and parentheses.
                ppid = int(f.read().rpartition(")")[2].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    out: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
