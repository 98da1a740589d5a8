"""The ``agentenv`` command: ``eval``, ``serve``, ``bench``, ``buffer``, and plug-ins.

Every command that reports numbers prints them as one JSON object on its last line
with ``--json``. Run ``agentenv COMMAND --help`` for the flags.

Other packages add commands (``agentenv sandbox`` comes from ``sandboxes``) and
benchmarks (every ``agentenv bench BENCH`` comes from ``benchmarks``) through the
entry-point groups ``agentenv.commands`` and ``agentenv.benches``: each entry is a function
that takes the argparse sub-parsers object and adds its parser, whose ``handler`` returns
the exit status. agentenv itself never imports them by name. A command's flags come from
its settings through one generator: :func:`add_options` (:class:`Option`: a flag's name,
type, default, doc and range), :func:`add_model_arguments` for a pydantic model's fields.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from agentenv._errors import AgentEnvError
from agentenv.cli._config import (
    Option,
    add_config_argument,
    add_model_arguments,
    add_options,
    build_config,
    check_unknown_flags,
    command_parser,
    read_config_file,
)
from agentenv.cli._plugins import add_plugins

__all__ = [
    "Option",
    "add_config_argument",
    "add_model_arguments",
    "add_options",
    "add_plugins",
    "build_config",
    "main",
    "read_config_file",
]


def build_parser() -> argparse.ArgumentParser:
    from agentenv.cli import _bench, _buffer, _eval, _serve

    parser = argparse.ArgumentParser(
        prog="agentenv", description="RL of language models on agentic tasks"
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in (_eval, _serve, _bench, _buffer):
        command.add_parser(sub)
    add_plugins(sub, "agentenv.commands")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)  # after "--": a command's own
    ours = argv[:cut]
    server_flags: list[str] = []
    router_flags: list[str] = []
    if any(a.startswith(("--sglang-", "--router-")) for a in ours):
        from agentenv.sglang import split_passthrough  # loads the client (httpx)

        try:
            ours, server_flags, router_flags = split_passthrough(ours)
        except AgentEnvError as e:
            parser.error(str(e))
    args, extra = parser.parse_known_args(ours + argv[cut:])
    # A command that hands flags on (agentenv train: megatron's) names them lazily: the
    # names may need heavy imports.
    passthrough = getattr(args, "passthrough_flags", None)
    if extra:
        check_unknown_flags(
            command_parser(parser, args), [a for a in extra if a in ours],
            passthrough() if passthrough is not None else (),
        )  # fmt: skip
        if passthrough is None:
            parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.megatron_args = extra  # e.g. agentenv train --backend megatron --sequence-parallel
    if (server_flags or router_flags) and not getattr(args, "sglang_passthrough", False):
        parser.error(
            f"--sglang-* and --router-* flags are passed to SGLang by commands that launch "
            f"it (agentenv train --rollout-engine sglang), not by {args.command!r}"
        )
    args.sglang_args, args.router_args = server_flags, router_flags
    try:
        code: int = args.handler(args)
    except AgentEnvError as e:
        print(f"agentenv: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("agentenv: interrupted", file=sys.stderr)
        return 130
    return code
