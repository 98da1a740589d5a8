"""The torch thread count: usable CPUs from fake affinity masks and cgroup files, the rule
per kind of work, and the user's own setting kept."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from agentenv.engine._threads import (
    cgroup_cpu_limit,
    choose_threads,
    physical_cores,
    usable_cpus,
)


def write(root: Path, path: str, **files: str) -> None:
    directory = root / path
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name.replace("_", ".", 1)).write_text(text)


def test_affinity_alone_without_a_quota(tmp_path: Path) -> None:
    write(tmp_path, "job", cpu_max="max 100000\n")
    assert usable_cpus({0, 1, 2, 3}, "0::/job\n", tmp_path) == 4
    assert usable_cpus({3}, "", tmp_path) == 1


def test_cgroup_v2_quota_rounds_down(tmp_path: Path) -> None:
    write(tmp_path, "job", cpu_max="150000 100000\n")
    assert cgroup_cpu_limit("0::/job\n", tmp_path) == 1.5
    assert usable_cpus(range(8), "0::/job\n", tmp_path) == 1


def test_cgroup_v2_a_parent_quota_limits_its_children(tmp_path: Path) -> None:
    write(tmp_path, "slice", cpu_max="200000 100000\n")
    write(tmp_path, "slice/job", cpu_max="max 100000\n")
    assert usable_cpus(range(16), "0::/slice/job\n", tmp_path) == 2


def test_cgroup_v2_beside_v1_controllers(tmp_path: Path) -> None:
    write(tmp_path, "unified/job", cpu_max="300000 100000\n")
    assert usable_cpus(range(16), "1:cpu:/\n0::/job\n", tmp_path) == 3


def test_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    write(
        tmp_path,
        "cpu,cpuacct/docker/abc",
        cpu_cfs_quota_us="250000\n",
        cpu_cfs_period_us="100000\n",
    )
    proc = "5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n"
    assert usable_cpus(range(8), proc, tmp_path) == 2


def test_cgroup_v1_no_quota(tmp_path: Path) -> None:
    write(tmp_path, "cpu", cpu_cfs_quota_us="-1\n", cpu_cfs_period_us="100000\n")
    assert cgroup_cpu_limit("1:cpu:/\n", tmp_path) is None
    assert usable_cpus(range(6), "1:cpu:/\n", tmp_path) == 6


def test_cgroup_v1_inside_a_container_reads_the_mount_itself(tmp_path: Path) -> None:
    # The host's path is named, but the container sees its own cgroup at the mount.
    write(tmp_path, "cpu", cpu_cfs_quota_us="100000\n", cpu_cfs_period_us="100000\n")
    assert usable_cpus(range(4), "1:cpu:/docker/host-side-id\n", tmp_path) == 1


def test_unreadable_or_odd_cgroup_files_do_not_limit(tmp_path: Path) -> None:
    write(tmp_path, "job", cpu_max="garbage\n")
    assert usable_cpus(range(4), "0::/job\nnot a line\n", tmp_path) == 4
    assert usable_cpus(range(4), "0::/missing\n", tmp_path / "absent") == 4


def test_physical_cores_count_thread_siblings_once(tmp_path: Path) -> None:
    for cpu, siblings in enumerate(["0,2", "1,3", "0,2", "1,3"]):
        write(tmp_path, f"cpu{cpu}/topology", thread_siblings_list=f"{siblings}\n")
    assert physical_cores(tmp_path) == 2


@pytest.mark.parametrize(
    ("work", "cpus", "default", "threads"),
    [
        ("engine", 2, 2, 1),  # the event loop keeps a core
        ("engine", 1, 2, 1),
        ("engine", 16, 8, 8),  # never more than torch's own default
        ("trainer", 2, 2, 2),
        ("trainer", 1, 4, 1),
        ("trainer", 16, 8, 8),
    ],
)
def test_the_count_per_work(work: str, cpus: int, default: int, threads: int) -> None:
    choice = choose_threads(work, cpus=cpus, default=default, environ={}, user_threads=None)  # type: ignore[arg-type]
    assert choice.threads == threads
    assert f"{cpus} usable CPU(s)" in choice.reason


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_a_thread_variable_of_the_user_is_kept(name: str) -> None:
    choice = choose_threads("engine", cpus=8, default=8, environ={name: "3"}, user_threads=None)
    assert choice.threads is None and f"{name}=3" in choice.reason


def test_the_users_torch_set_num_threads_is_kept() -> None:
    choice = choose_threads("trainer", cpus=8, default=8, environ={}, user_threads=5)
    assert choice.threads is None and "torch.set_num_threads(5)" in choice.reason


def test_unknown_work_is_refused() -> None:
    with pytest.raises(ValueError, match="work must be one of"):
        choose_threads("gpu", cpus=2, default=2, environ={}, user_threads=None)  # type: ignore[arg-type]


def run_fresh(code: str) -> str:
    """Run ``code`` in a fresh interpreter (torch's thread counts are per process)."""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return out.stdout.strip()


@pytest.mark.slow  # a fresh interpreter imports torch
def test_use_torch_threads_sets_each_works_thread() -> None:
    out = run_fresh(
        """
        import threading, torch
        from agentenv.engine._threads import choose_threads, physical_cores, usable_cpus
        from agentenv.engine._threads import use_torch_threads
        expect = [
            choose_threads(w, cpus=usable_cpus(), default=physical_cores(), environ={},
                           user_threads=None).threads
            for w in ("engine", "trainer")
        ]
        got = []
        def work(kind):
            got.append((use_torch_threads(kind), torch.get_num_threads()))
        for kind in ("engine", "trainer"):
            t = threading.Thread(target=work, args=(kind,))
            t.start()
            t.join()
        print(got == [(n, n) for n in expect], got, expect)
        """
    )
    assert out.startswith("True"), out


@pytest.mark.slow  # a fresh interpreter imports torch
def test_use_torch_threads_keeps_the_users_set_num_threads() -> None:
    out = run_fresh(
        """
        import torch
        from agentenv.engine._threads import physical_cores, use_torch_threads
        mine = physical_cores() + 1  # a count torch would not choose itself
        torch.set_num_threads(mine)
        print(use_torch_threads("engine"), torch.get_num_threads() == mine)
        """
    )
    assert out == "None True"
