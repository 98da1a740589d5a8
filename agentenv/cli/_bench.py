"""``agentenv bench BENCH``: the benchmarks, each added by an entry point of the group
``agentenv.benches`` (the ``benchmarks`` package, installed beside agentenv, adds them all;
see docs/benchmarks.md). Run ``agentenv bench BENCH --help`` for a bench's flags."""

from __future__ import annotations

from typing import Any

from agentenv.cli._config import add_command
from agentenv.cli._plugins import add_plugins


def add_parser(sub: Any) -> None:
    parser = add_command(sub, "bench", "benchmarks", __doc__)
    kinds = parser.add_subparsers(dest="bench", required=True, metavar="BENCH")
    add_plugins(kinds, "agentenv.benches")
