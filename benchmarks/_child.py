"""Running one benchmark measurement in a process of its own, and printing its result."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from agentenv import ConfigError

__all__ = ["ROOT", "emit", "free_port", "run_child"]

# The checkout: children put it on their path (the verifiers venv does not have agentenv).
ROOT = str(Path(__file__).resolve().parents[1])


def run_child(
    module: str,
    args: list[str],
    *,
    python: str | None = None,
    timeout: float = 600,
    one_thread: bool = True,
) -> dict[str, Any]:
    """Run ``python -m module args`` and return the last JSON object it printed.

    ``one_thread``: limit the child's native thread pools (OpenMP, Rayon) to one thread,
    for measurements pinned to one core; leave them alone for the engine benchmark, which
    measures torch on every core. Raises :class:`ConfigError` with the child's last lines
    when it fails or prints no JSON.
    """
    env = dict(
        os.environ,
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        # The verifiers venv does not have agentenv installed: import it from the checkout.
        PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH", "")) if p),
    )
    if one_thread:
        env.update(RAYON_NUM_THREADS="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [python or sys.executable, "-m", module, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise ConfigError(f"benchmark child {module} {' '.join(args)} failed: {' | '.join(tail)}")
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def emit(result: dict[str, Any], as_json: bool) -> None:
    """Print a bench's result: one JSON line (``--json``), or indented."""
    if as_json:
        print(json.dumps(result, separators=(",", ":")))
    else:
        print(json.dumps(result, indent=2))


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
