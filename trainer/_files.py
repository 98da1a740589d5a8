"""Directories written whole or not at all (checkpoints, weight exports)."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

__all__ = ["replace_dir"]


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
