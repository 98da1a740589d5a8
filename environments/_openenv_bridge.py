"""The client side of :mod:`environments.openenv`, run in the interpreter that has OpenEnv.

OpenEnv's pins clash with agentenv's (it would downgrade ``mcp`` and ``pillow``), so it
lives in an environment of its own and this script is the only code that imports it. It
holds one OpenEnv session (``GenericEnvClient``, OpenEnv's own client: a WebSocket to
the server) and answers one JSON line on stdout per JSON line read on stdin::

    {"op": "reset", "kwargs": {...}} -> {"ok": true, "observation": {...}, "reward": r, "done": d}
    {"op": "step", "action": {...}}  -> the same
    {"op": "close"}                  -> {"ok": true} and exit

Any error of the client or the server comes back as ``{"ok": false, "error": "..."}``;
the session is then dropped and the next ``reset`` opens a new one.

Usage: ``python _openenv_bridge.py BASE_URL MESSAGE_TIMEOUT_S``. It imports nothing of
agentenv (it runs where agentenv is not installed).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from typing import Any


def _result(result: Any) -> dict[str, Any]:
    return {
        "ok": True,
        "observation": result.observation,
        "reward": result.reward,
        "done": bool(result.done),
    }


async def main(base_url: str, message_timeout_s: float) -> None:
    from openenv.core.generic_client import GenericEnvClient  # type: ignore[import-not-found]

    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    client: Any = None

    def reply(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    async def drop() -> None:  # best effort: the session is over or broken
        with contextlib.suppress(Exception):
            await asyncio.wait_for(client.close(), timeout=5)

    while True:
        line = await reader.readline()
        if not line:
            break
        request = json.loads(line)
        op = request.get("op")
        if op == "close":
            reply({"ok": True})
            break
        try:
            if op == "reset":
                if client is None:
                    client = GenericEnvClient(
                        base_url=base_url,
                        connect_timeout_s=message_timeout_s,
                        message_timeout_s=message_timeout_s,
                    )
                    await client.connect()
                reply(_result(await client.reset(**request.get("kwargs", {}))))
            elif op == "step":
                if client is None:
                    raise RuntimeError("step before reset")
                reply(_result(await client.step(request["action"])))
            else:
                raise ValueError(f"unknown op {op!r}")
        except Exception as e:  # every failure goes back to the adapter, as data
            reply({"ok": False, "error": f"{type(e).__name__}: {e}"})
            if client is not None:  # broken: the next reset opens a new session
                await drop()
                client = None
    if client is not None:
        await drop()


if __name__ == "__main__":
    # This script's folder holds agentenv's ``openenv.py``, which would shadow the package.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
