"""Local resources: directories written whole or not at all (checkpoints, weight
exports), what an exported HF model directory takes from the model it was trained from
(tokenizer, chat template, generation config), a free loopback port (servers and
process groups started for a run), and how much memory the processes of a run hold and
have held at most, read from ``/proc`` (Linux): one reading for the driver, the trainer
ranks, the engines and the rollout workers alike."""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

__all__ = ["MODEL_FILES", "copy_model_files", "free_port", "peak_rss_gib", "replace_dir", "rss_mib"]

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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the OS picks it)."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def peak_rss_gib(pid: int | None = None, *, descendants: bool = False) -> float:
    """The peak resident set of process ``pid`` (default: this one) in GiB, as Linux
    keeps it (``VmHWM`` in ``/proc/PID/status``: a lifetime peak, never reset); with
    ``descendants`` the largest over it and every process below it (a server's
    schedulers). 0.0 for a process that is gone or unreadable."""
    pids = [os.getpid() if pid is None else pid]
    if descendants:
        pids += _descendants(pids[0])
    return max(_status_kib(p, "VmHWM") for p in pids) / 2**20


def rss_mib() -> float:
    """This process's resident set now (``VmRSS``), in MiB."""
    return _status_kib(os.getpid(), "VmRSS") / 1024


def _status_kib(pid: int, field: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
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
