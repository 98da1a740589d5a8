"""The opening every ``agentenv bench`` subcommand shares: its parser, with ``--quick`` and
``--json``."""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["bench_parser"]


def bench_parser(
    sub: Any,
    name: str,
    *,
    help: str,
    doc: str | None,
    quick: str | None = None,
    json: str = "print one JSON object last",
) -> argparse.ArgumentParser:
    """``agentenv bench NAME``'s parser: a subcommand of ``sub`` (``None``: a parser of its
    own, for the module run alone), described by ``doc`` (the module's docstring, kept as
    written), with ``--json`` and, when ``quick`` says what it shortens, ``--quick``."""
    kwargs: dict[str, Any] = {
        "description": doc,
        "formatter_class": argparse.RawDescriptionHelpFormatter,
    }
    if sub is None:
        parser = argparse.ArgumentParser(prog=f"agentenv bench {name}", **kwargs)
    else:
        parser = sub.add_parser(name, help=help, **kwargs)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", action="store_true", help=json)
    return parser
