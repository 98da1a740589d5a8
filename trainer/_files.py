"""Local resources: directories written whole or not at all (checkpoints, weight
exports), and a free loopback port (servers and process groups started for a run)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

__all__ = ["free_port", "replace_dir"]


@contextlib.contextmanager
def replace_dir(directory: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty sibling directory to write into; on success it replaces
    ``directory``. A crash before the end leaves the previous ``directory`` whole (a reader
    never sees a half-written one); a crash between the two renames leaves it as
    ``NAME.old``."""
    final = Path(directory)
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    yield tmp
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
