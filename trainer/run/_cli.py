"""``agentenv train`` (an ``agentenv`` plug-in): GRPO on an environment, on the torch or
the megatron backend (``--backend``).

    agentenv train --env arithmetic --hf-checkpoint smollm2-135m --num-rollout 10 \\
        --rollout-batch-size 8 --n-samples-per-prompt 4 --lr 1e-6 --save runs/a --json
    agentenv train --config run.yaml --schedule async --rollout-engine sglang \\
        --sglang-mem-fraction-static 0.5      # SGLang's own flags, passed through

Flags use slime's names; ``--config FILE`` (YAML, JSON or TOML) holds any of them, flat
by those names or nested by group (``rollout: {rollout_batch_size: 8}``), and flags
override it. The configuration (the batch identity included) is validated before
anything heavy loads; ``--dry-run`` stops there, after checking that the environment
loads and the prompt data parses, and prints the resolved settings as JSON.

A run evaluates held-out tasks before and after training, shows a progress bar, and writes
to ``--save``: every step's metrics (``metrics.jsonl``, TensorBoard), checkpoints
(``--save-interval``, ``--keep-checkpoints``), the trained model, a plot and
``summary.json``. The same command again (or ``--load RUN``) resumes after the last
checkpoint. Rollouts run on the embedded engine in this process, on ``agentenv serve`` or
SGLang servers launched for the run (``--rollout-engine``; every ``--sglang-*`` flag goes to
SGLang) or on running servers (``--rollout-url``), their weights synced as ``--weight-sync``
says. docs/trainer.md has the whole of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agentenv import ConfigError

if TYPE_CHECKING:
    from trainer.run._config import TrainConfig

__all__ = ["add_parser", "config_from_flags"]


def add_parser(sub: Any) -> None:
    from trainer.run._flags import add_train_arguments

    parser: argparse.ArgumentParser = sub.add_parser(
        "train",
        help="train a model on an environment with GRPO",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_train_arguments(parser)
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the settings, the environment and the prompt data without loading a "
        "model; print the resolved settings as JSON",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object last")
    # slime's switch, accepted so that its launch scripts run unchanged: micro-batches are
    # always packed by --max-tokens-per-gpu here (docs/trainer.md, "Flags").
    parser.add_argument("--use-dynamic-batch-size", action="store_true", help=argparse.SUPPRESS)
    parser.set_defaults(handler=_main, sglang_passthrough=True, passthrough_flags=_megatron_flags)


def config_from_flags(flags: Sequence[str]) -> TrainConfig:
    """The :class:`~trainer.TrainConfig` that ``agentenv train FLAGS`` runs (its own
    parser: every flag, ``--config FILE`` included), validated; ``train(config)`` runs it.
    SGLang's and megatron's pass-through flags are the command's, not taken here."""
    from trainer.run._flags import config_from_args

    parser = argparse.ArgumentParser(prog="agentenv")
    add_parser(parser.add_subparsers())
    return config_from_args(parser.parse_args(["train", *flags]))


def _megatron_flags() -> tuple[str, ...]:
    """megatron's flags, which go through to the megatron backend (``--backend megatron``)."""
    from trainer.megatron import MEGATRON_FLAGS

    return MEGATRON_FLAGS


def _main(args: argparse.Namespace) -> int:
    from trainer.run._flags import config_from_args

    try:
        config = config_from_args(
            args, sglang_args=args.sglang_args, megatron_args=args.megatron_args,
            router_args=args.router_args,
        )  # fmt: skip
        if args.dry_run:
            from trainer.run._setup import dry_run

            print(json.dumps(dry_run(config), indent=2))
            return 0
        from trainer.run._train import train

        result = train(config)
    except ConfigError as e:
        print(f"agentenv train: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result))
    return 0
