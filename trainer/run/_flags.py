"""``agentenv train``'s flags, generated from the config tree's declarations
(:func:`~trainer.config._settings.setting`), and the tree built back from the parsed flags over a
``--config`` file's settings.

Each flag shows its value's kind (``N``, ``FLOAT``, ``TEXT``, ``PATH``, ``JSON``,
``{choices}`` or the declared metavar), its one-line doc, its range and its default.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import annotated_types

from trainer.config import Flag, merge, nest
from trainer.run._config import NOT_YET, TrainConfig, flag_table

__all__ = ["add_train_arguments", "config_from_args"]

_METAVARS: dict[Any, str] = {int: "N", float: "FLOAT", str: "TEXT", Path: "PATH"}
_BOUNDS = (
    (annotated_types.Ge, ">=", "ge"),
    (annotated_types.Gt, ">", "gt"),
    (annotated_types.Le, "<=", "le"),
    (annotated_types.Lt, "<", "lt"),
)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per declared setting of :class:`~trainer.TrainConfig` (values default to
    ``SUPPRESS``: the tree's defaults win), ``--config FILE``, and the flags of what is
    not supported yet (refused with what to do instead)."""
    parser.add_argument(
        "--config", dest="config_file", type=Path, metavar="FILE", default=argparse.SUPPRESS,
        help="settings from a .yaml, .json or .toml file, nested by group or flat with the "
        "flags' names (flags override them)",
    )  # fmt: skip
    for flag in flag_table().values():
        if flag.cli:
            parser.add_argument(flag.name, dest=flag.key, **_argument(flag))
    for name in NOT_YET:
        parser.add_argument(
            name, nargs="?", action=_NotYet, default=argparse.SUPPRESS, metavar="X",
            help="slime's flag, not supported yet (refused, naming what to use instead)",
        )  # fmt: skip


class _NotYet(argparse.Action):
    def __call__(self, parser: argparse.ArgumentParser, *args: Any, **kwargs: Any) -> None:
        parser.error(f"{self.option_strings[0]}: {NOT_YET[self.option_strings[0]]}")


def _argument(flag: Flag) -> dict[str, Any]:
    kind = _unwrap_optional(flag.annotation)
    kwargs: dict[str, Any] = {"help": _help(flag), "default": argparse.SUPPRESS}
    if flag.is_switch:
        kwargs.update(action="store_const", const=True)  # the flat form: a switch is on
    elif kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is Literal:
        kwargs["choices"] = list(typing.get_args(kind))
    else:
        kwargs["metavar"] = flag.metavar or (
            "JSON" if _is_json(kind) else _METAVARS.get(kind, "TEXT")
        )
        if kind in (int, float):
            kwargs["type"] = kind
        elif _is_json(kind) and flag.metavar is None:
            kwargs["type"] = _json
        else:
            kwargs["type"] = str  # the tree converts (Path, a filter's name, ...)
    return kwargs


def _help(flag: Flag) -> str:
    """The doc, the range, then the default unless the doc states it; ``%`` escaped."""
    text = flag.doc
    bounds = [
        f"{sign} {getattr(m, attr)}"
        for m in flag.metadata
        for kind, sign, attr in _BOUNDS
        if isinstance(m, kind)
    ]
    if bounds:
        text += f" [{', '.join(bounds)}]"
    default = flag.default
    if flag.is_switch:
        default = None  # a switch is off unless given
    if default is not None and not _required(flag) and "default:" not in text.lower():
        shown = json.dumps(default) if isinstance(default, (dict, list, tuple)) else str(default)
        text += f" (default: {shown})"
    return text.replace("%", "%%")


def _required(flag: Flag) -> bool:
    import pydantic_core

    return flag.default is pydantic_core.PydanticUndefined


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_json(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (dict, list, tuple) or annotation in (dict, list)


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def config_from_args(
    args: argparse.Namespace,
    *,
    sglang_args: Sequence[str] = (),
    megatron_args: Sequence[str] = (),
    router_args: Sequence[str] = (),
) -> TrainConfig:
    """The tree from parsed flags, over ``--config``'s settings (nested, flat or mixed);
    the pass-through flags, when given, replace the file's."""
    from agentenv.cli import read_config_file

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
