"""Sub-commands and benchmarks that other packages add through entry points."""

from __future__ import annotations

import importlib.metadata
import sys


def add_plugins(sub: object, group: str) -> None:
    """Let every entry point of ``group`` add its sub-command to ``sub``."""
    for ep in sorted(importlib.metadata.entry_points(group=group), key=lambda e: e.name):
        try:
            add = ep.load()
        except ImportError as e:  # a broken plug-in must not take the other commands down
            print(f"agentenv: warning: plug-in {ep.name!r} ({ep.value}): {e}", file=sys.stderr)
            continue
        add(sub)
