"""``agentenv train``'s flags, from the config tree's declarations
(:func:`~trainer.config.setting`) through agentenv's one flag generator
(:func:`agentenv.cli.add_options`), and the tree built back from the parsed flags over a
``--config`` file's settings.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from typing import Any

from agentenv.cli import Option, add_config_argument, add_options, read_config_file
from trainer.config import Flag, merge, nest
from trainer.run._config import TrainConfig, flag_table

__all__ = ["add_train_arguments", "config_from_args"]


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per declared setting of :class:`~trainer.TrainConfig` (values default to
    ``SUPPRESS``: the tree's defaults win) and ``--config FILE``."""
    add_config_argument(
        parser,
        "settings from a .yaml, .json or .toml file, nested by group or flat with the "
        "flags' names (flags override them)",
    )
    add_options(parser, (_option(flag) for flag in flag_table().values() if flag.cli))


def _option(flag: Flag) -> Option:
    """``flag`` as the generator's :class:`agentenv.cli.Option` (a switch is on when given:
    the flat form's ``true``)."""
    return Option(
        flag.name, flag.key, flag.annotation, flag.default, flag.doc, flag.metadata,
        flag.metavar, switch=flag.is_switch,
    )  # fmt: skip


def config_from_args(
    args: argparse.Namespace,
    *,
    sglang_args: Sequence[str] = (),
    megatron_args: Sequence[str] = (),
    router_args: Sequence[str] = (),
) -> TrainConfig:
    """The tree from parsed flags, over ``--config``'s settings (nested, flat or mixed);
    the pass-through flags, when given, replace the file's."""
    table = flag_table()
    groups = set(TrainConfig.model_fields)
    layers: list[Mapping[str, Any]] = []
    config_file = getattr(args, "config_file", None)
    if config_file is not None:
        layers.append(TrainConfig.nest(read_config_file(config_file)))
    given = {k: v for k, v in vars(args).items() if k in table}
    if sglang_args:
        given["sglang_args"] = list(sglang_args)
    if megatron_args:
        given["megatron_args"] = list(megatron_args)
    if router_args:
        given["router_args"] = list(router_args)
    layers.append(nest(given, table, groups))
    return TrainConfig.model_validate(merge(*layers))
