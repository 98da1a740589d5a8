"""Local resources: directories written whole or not at all (checkpoints, weight
exports), what an exported HF model directory takes from the model it was trained from
(tokenizer, chat template, generation config), and a free loopback port (servers and
process groups started for a run)."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MODEL_FILES", "copy_model_files", "free_port", "replace_dir"]

#: The files of an HF model directory besides its weights and ``config.json`` that
#: tokenizers, chat templates and generation defaults are read from (transformers'
#: ``AutoTokenizer``, SGLang, ``agentenv``): an export carries the source's over.
MODEL_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)


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


def copy_model_files(source: str | os.PathLike[str], directory: str | os.PathLike[str]) -> None:
    """Copy the :data:`MODEL_FILES` that ``source`` (an HF model directory) has into
    ``directory``, replacing those there: weights exported into ``directory`` then load
    as a complete model, with the tokenizer and chat template they were trained with."""
    src, dst = Path(source), Path(directory)
    for name in MODEL_FILES:
        if (src / name).is_file():
            shutil.copyfile(src / name, dst / name)


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port
