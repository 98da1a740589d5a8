"""The ``agentenv`` command: ``eval``, ``serve``, ``bench``, ``buffer``.

Every command that reports numbers prints them as one JSON object on its last line
with ``--json``. Run ``agentenv COMMAND --help`` for the flags.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from agentenv._errors import AgentEnvError

__all__ = ["main"]


def build_parser() -> argparse.ArgumentParser:
    from agentenv.cli import _bench, _buffer, _eval, _serve

    parser = argparse.ArgumentParser(
        prog="agentenv", description="RL of language models on agentic tasks"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _eval.add_parser(sub)
    _serve.add_parser(sub)
    _bench.add_parser(sub)
    _buffer.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.handler(args)
    except AgentEnvError as e:
        print(f"agentenv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentenv: interrupted", file=sys.stderr)
        return 130
    return code
