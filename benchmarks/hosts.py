"""Hosts on this one machine, for tests and benches of a cluster without one: each a
network namespace with an address of its own on a private subnet, joined by a bridge in a
namespace of its own (no route leaves them), and
Ray nodes started in them with ``ray start --block`` (each in a process group of its own,
so a host's node is killed, and only it, by its process group id).

    with Hosts(3) as hosts:                       # 10.213.N.1, .2, .3
        head = hosts.ray_head(0, port=6390, num_cpus=3)
        hosts.ray_worker(1, head, num_cpus=2, resources={"rollout": 1})
        hosts.run(0, ["python", "-m", "agentenv", "train", ...])
        hosts.kill_node(1)                         # SIGKILL to its process group
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BIN = Path(sys.executable).parent
#: The hosts' cluster is reachable only inside their namespaces: no token between them.
CLUSTER_ENV = {"RAY_AUTH_MODE": "disabled"}


def available() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    return None


__all__ = ["CLUSTER_ENV", "Hosts", "available", "popen"]


class Hosts:
    """``n`` namespaces ``ae<pid>h<i>`` with addresses ``10.213.<k>.<i + 1>/24``."""

    def __init__(self, n: int) -> None:
        self.n = n
        tag = f"ae{os.getpid() % 100000}"
        self.names = [f"{tag}h{i}" for i in range(n)]
        self.switch = f"{tag}sw"
        self.subnet = 10 + os.getpid() % 200
        self.nodes: dict[int, subprocess.Popen[bytes]] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="ae-hosts-"))
        self._made: list[str] = []

    def address(self, i: int) -> str:
        return f"10.213.{self.subnet}.{i + 1}"

    def __enter__(self) -> Hosts:
        try:
            self._ip("netns", "add", self.switch)
            self._made.append(self.switch)
            self._exec(self.switch, "ip", "link", "add", "br0", "type", "bridge")
            self._exec(self.switch, "ip", "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                self._ip("netns", "add", name)
                self._made.append(name)
                host, port = f"v{i}", f"p{i}"
                self._exec(name, "ip", "link", "add", host, "type", "veth", "peer", port)
                self._exec(name, "ip", "link", "set", port, "netns", self.switch)
                self._exec(self.switch, "ip", "link", "set", port, "master", "br0")
                self._exec(self.switch, "ip", "link", "set", port, "up")
                self._exec(name, "ip", "addr", "add", f"{self.address(i)}/24", "dev", host)
                self._exec(name, "ip", "link", "set", host, "up")
                self._exec(name, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for i in list(self.nodes):
            self.kill_node(i)
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)
        self._made.clear()
        shutil.rmtree(self.tmp, ignore_errors=True)

    def _ip(self, *args: str) -> None:
        subprocess.run(["ip", *args], check=True, capture_output=True)

    def _exec(self, name: str, *cmd: str) -> None:
        subprocess.run(["ip", "netns", "exec", name, *cmd], check=True, capture_output=True)

    def command(self, i: int, cmd: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.names[i], *cmd]

    # -- Ray nodes -------------------------------------------------------------------------
    def _start_node(self, i: int, args: list[str], env: dict[str, str]) -> None:
        temp = self.tmp / f"r{i}"
        cmd = [
            str(BIN / "ray"), "start", "--block", "--disable-usage-stats",
            f"--node-ip-address={self.address(i)}", f"--temp-dir={temp}", *args,
        ]  # fmt: skip
        with (self.tmp / f"ray-{i}.log").open("ab") as log:  # the node keeps its own copy
            self.nodes[i] = subprocess.Popen(
                self.command(i, cmd), stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True, env={**os.environ, **CLUSTER_ENV, **env},
            )  # fmt: skip

    def ray_head(
        self, i: int, *, port: int, num_cpus: int, env: dict[str, str] | None = None
    ) -> str:
        """A Ray head on host ``i``; its address (``IP:PORT``), once it answers."""
        self._start_node(
            i, ["--head", f"--port={port}", f"--num-cpus={num_cpus}", "--include-dashboard=false"],
            env or {},
        )  # fmt: skip
        address = f"{self.address(i)}:{port}"
        self.wait_nodes(i, address, 1)
        return address

    def ray_worker(
        self, i: int, head: str, *, num_cpus: int, resources: dict[str, float],
        env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        """A Ray worker node on host ``i``, joining ``head``."""
        args = [f"--address={head}", f"--num-cpus={num_cpus}"]
        self._start_node(i, [*args, f"--resources={json.dumps(resources)}"], env or {})

    def alive_nodes(self, i: int, head: str) -> int:
        """Alive nodes of the cluster, as seen from host ``i``."""
        probe = (
            "import ray, sys; ray.init(address=sys.argv[1], log_to_driver=False); "
            "print('alive', sum(1 for n in ray.nodes() if n['Alive']))"
        )
        out = subprocess.run(
            self.command(i, [sys.executable, "-c", probe, head]),
            capture_output=True, text=True, timeout=60, check=False,
            env={**os.environ, **CLUSTER_ENV},
        )  # fmt: skip
        # Ray may print its own warnings (a lagging heartbeat) on the same stream.
        counts = [x.split()[1] for x in out.stdout.splitlines() if x.startswith("alive ")]
        return int(counts[-1]) if out.returncode == 0 and counts else 0

    def wait_nodes(self, i: int, head: str, n: int, timeout: float = 120.0) -> None:
        """Until the cluster has ``n`` alive nodes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.alive_nodes(i, head) == n:
                return
            time.sleep(1.0)
        logs = {k: (self.tmp / f"ray-{k}.log").read_text()[-2000:] for k in self.nodes}
        raise TimeoutError(f"the cluster did not have {n} alive nodes in {timeout:g} s: {logs}")

    def kill_node(self, i: int) -> None:
        """SIGKILL to host ``i``'s Ray node: its process group (the node's processes)."""
        proc = self.nodes.pop(i, None)
        if proc is not None:
            self.stop(proc)

    @staticmethod
    def stop(proc: subprocess.Popen[Any]) -> None:
        """SIGKILL to a process started with :func:`popen` (its process group), reaped."""
        with contextlib.suppress(ProcessLookupError):  # the group may outlive its leader
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)

    def log(self, i: int) -> str:
        path = self.tmp / f"ray-{i}.log"
        return path.read_text() if path.exists() else ""


def popen(
    hosts: Hosts, i: int, cmd: list[str], env: dict[str, str], **kwargs: Any
) -> subprocess.Popen[str]:
    """``cmd`` on host ``i``, in a process group of its own, a client of the hosts'
    cluster."""
    return subprocess.Popen(
        hosts.command(i, cmd), start_new_session=True, text=True,
        env={**env, **CLUSTER_ENV}, **kwargs,
    )  # fmt: skip
