"""How many threads torch's CPU kernels get: chosen once per process, from the CPUs the
process may use and the work the thread does (the rule, and the measurements behind it:
docs/inference.md, "Threads (CPU)").

torch's default, one OpenMP thread per physical core, ignores the process's affinity and
cgroup quota, and that the engine's model thread shares the process with an event loop;
OpenMP threads spin while they wait, so a thread too many costs far more than it gains.
:func:`use_torch_threads` sets, on the thread that runs the work: for ``engine`` the usable
CPUs less one for the event loop, for ``trainer`` every usable CPU; at least 1, never more
than torch's default, and never where the user chose (``OMP_NUM_THREADS`` /
``MKL_NUM_THREADS`` set, or ``torch.set_num_threads`` called before agentenv's first
choice). Usable CPUs: the affinity mask's, capped by the cgroup quota (v2 ``cpu.max``, v1
``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) of the process's cgroup and its parents.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import threading
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Literal

__all__ = [
    "ThreadChoice",
    "Work",
    "choose_threads",
    "physical_cores",
    "usable_cpus",
    "use_torch_threads",
]

log = logging.getLogger("agentenv.engine")

Work = Literal["engine", "trainer"]
WORKS: tuple[Work, ...] = ("engine", "trainer")
# Environment variables that set OpenMP's / MKL's thread count: the user's choice.
USER_VARIABLES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


@dataclasses.dataclass(frozen=True, slots=True)
class ThreadChoice:
    """A thread count for one kind of work, and why.

    Attributes:
        threads: the count to set; ``None``: leave the user's setting as it is.
        reason: one line for the log.
    """

    threads: int | None
    reason: str


def cgroup_cpu_limit(proc_cgroup: str, root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The CPUs the cgroup quota allows (``1.5`` for ``docker --cpus 1.5``), the smallest
    along the process's cgroup and its parents; ``None`` when nothing limits it.

    Args:
        proc_cgroup: the text of ``/proc/self/cgroup``.
        root: where the cgroup file systems are mounted.
    """
    limits: list[float] = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one hierarchy, cpu.max = "<quota|max> <period>"
            hybrid = root / "unified"  # v2 beside v1 controllers (systemd's hybrid layout)
            mount = hybrid if hybrid.is_dir() else root
            limits += _quotas(mount, path, ("cpu.max",))
        elif "cpu" in controllers.split(","):  # v1: mounted as cpu,cpuacct or cpu
            for mount in (root / controllers, root / "cpu"):
                if mount.is_dir():
                    limits += _quotas(mount, path, ("cpu.cfs_quota_us", "cpu.cfs_period_us"))
                    break
    return min(limits) if limits else None


def _quotas(mount: Path, path: str, files: tuple[str, ...]) -> list[float]:
    """The quotas of the cgroup at ``path`` under ``mount`` and of its parents. In a
    container the path is often the host's and the container's cgroup is the mount
    itself: then only the mount's own files are read."""
    here = mount / path.strip("/")
    if not here.is_dir():
        here = mount
    out: list[float] = []
    while True:
        limit = _quota(here, files)
        if limit is not None:
            out.append(limit)
        if here == mount or mount not in here.parents:
            return out
        here = here.parent


def _quota(directory: Path, files: tuple[str, ...]) -> float | None:
    try:
        texts = [(directory / f).read_text().split() for f in files]
    except (OSError, ValueError):
        return None
    if len(files) == 1:  # v2 cpu.max: "<quota|max> [<period>]"
        parts = texts[0]
        quota = parts[0] if parts else "max"
        period = parts[1] if len(parts) > 1 else "100000"
    else:  # v1: a quota of -1 is no limit
        quota, period = (t[0] if t else "" for t in texts)
    try:
        q, p = float(quota), float(period)
    except ValueError:  # "max", or an empty file: no limit
        return None
    return q / p if q > 0 and p > 0 else None


def usable_cpus(
    affinity: Collection[int] | None = None,
    proc_cgroup: str | None = None,
    root: Path = Path("/sys/fs/cgroup"),
) -> int:
    """The CPUs this process may keep busy: its affinity mask, capped by its cgroup quota
    (rounded down, at least 1). The arguments default to the process's own."""
    if affinity is None:
        affinity = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else ()
    cpus = len(affinity) or os.cpu_count() or 1
    if proc_cgroup is None:
        try:
            proc_cgroup = Path("/proc/self/cgroup").read_text()
        except OSError:
            proc_cgroup = ""
    limit = cgroup_cpu_limit(proc_cgroup, root)
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return max(1, cpus)


def physical_cores(root: Path = Path("/sys/devices/system/cpu")) -> int:
    """The machine's physical cores (torch's default thread count), from sysfs; the
    logical CPUs when sysfs does not tell."""
    cores: set[str] = set()
    for cpu in root.glob("cpu[0-9]*"):
        try:
            cores.add((cpu / "topology" / "thread_siblings_list").read_text().strip())
        except OSError:
            continue
    return len(cores) or os.cpu_count() or 1


def choose_threads(
    work: Work, *, cpus: int, default: int, environ: Mapping[str, str], user_threads: int | None
) -> ThreadChoice:
    """The thread count for ``work`` (the rule in the module docstring).

    Args:
        work: ``engine`` or ``trainer``.
        cpus: :func:`usable_cpus`.
        default: torch's own default count (:func:`physical_cores`).
        environ: the process's environment.
        user_threads: the count the user set with ``torch.set_num_threads``, if any.
    """
    if work not in WORKS:
        raise ValueError(f"work must be one of {WORKS}, got {work!r}")
    for name in USER_VARIABLES:
        if environ.get(name, "").strip():
            return ThreadChoice(None, f"kept {name}={environ[name]} (set by the user)")
    if user_threads is not None:
        return ThreadChoice(None, f"kept torch.set_num_threads({user_threads}) (set by the user)")
    if work == "engine":
        threads = max(1, min(default, cpus - 1))
        why = "less one for the event loop beside the model thread"
    else:
        threads = max(1, min(default, cpus))
        why = "all of them for the trainer's steps"
    return ThreadChoice(
        threads,
        f"{threads} torch thread(s) for the {work}: {cpus} usable CPU(s) (affinity and "
        f"cgroup quota), {why}; set OMP_NUM_THREADS to choose",
    )


_lock = threading.Lock()
_chosen: dict[Work, ThreadChoice] = {}
_user_threads: list[int | None] = []  # read once, before agentenv's first choice


def use_torch_threads(work: Work) -> int | None:
    """Set torch's thread count for ``work`` on the calling thread (call it on the thread
    that runs the work, before its first torch operation; threads started later inherit
    the count). Returns the count, or ``None`` where the user's setting was kept."""
    import torch

    with _lock:
        choice = _chosen.get(work)
        if choice is None:
            default = physical_cores()
            if not _user_threads:  # nothing of agentenv's has set a count yet
                now = torch.get_num_threads()
                _user_threads.append(now if now != default else None)
            choice = choose_threads(
                work,
                cpus=usable_cpus(),
                default=default,
                environ=os.environ,
                user_threads=_user_threads[0],
            )
            _chosen[work] = choice
            log.info("torch threads: %s", choice.reason)
    if choice.threads is not None and torch.get_num_threads() != choice.threads:
        torch.set_num_threads(choice.threads)
    return choice.threads
