"""Joining the Ray cluster a run places itself on (``--ray-address``): a running one
(``auto``, ``HOST:PORT``, ``ray://HOST:PORT``), a new one for this run (``local``), or,
without an address, Ray's own choice (a cluster running on this machine, else a new one).
A cluster this process already joined is used as it is. An address that does not answer
is refused within seconds (Ray itself would retry for minutes)."""

from __future__ import annotations

import os
import socket
from typing import Any

from agentenv import ConfigError

__all__ = ["connect", "node_address"]

#: Seconds an address given as ``HOST:PORT`` has to accept a connection.
ANSWER_TIMEOUT_S = 5.0


def connect(address: str | None, *, num_cpus: int | None = None) -> Any:
    """Join (or start) the cluster; returns the ``ray`` module. ``num_cpus``: the logical
    CPUs of a cluster ``local`` starts (this machine's cores, at least ``num_cpus``)."""
    import ray

    if address not in (None, "auto", "local"):
        _check_answers(address)
    if ray.is_initialized():
        return ray
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if address == "local":
        kwargs["num_cpus"] = max(os.cpu_count() or 1, num_cpus or 0)
    try:
        ray.init(address=address, **kwargs)
    except ConnectionError as e:
        raise ConfigError(
            f"--ray-address {address}: no Ray cluster answers ({e}); start one (ray start "
            "--head) or pass --ray-address local to start one for this run"
        ) from None
    return ray


def _check_answers(address: str) -> None:
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=ANSWER_TIMEOUT_S):
            pass
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"--ray-address {address}: nothing answers there within {ANSWER_TIMEOUT_S:g} s "
            f"({e}); start the cluster's head there (ray start --head --port {port}), pass "
            "the address `ray start` printed, or --ray-address local"
        ) from None


def node_address() -> str:
    """This node's address as Ray knows it (the one other nodes reach it at)."""
    import ray

    ip: str = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
    return ip
