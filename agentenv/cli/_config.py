"""Command-line flags generated from declared settings: the one generator of every
command's flags (``agentenv eval``, ``serve``, ``buffer serve``; ``agentenv train``'s from its
config tree).

Each setting is an :class:`Option`: its flag, where the value goes, its type, default,
one-line doc and range. :func:`add_options` makes each one flag whose help is the doc, the
range (``[>= 1]``) and the default appended as ``(default: X)`` unless the doc already says
what the default is (a ``None`` default is "not set": the doc says what that means), and
whose metavar names the kind of value: ``N`` (int), ``FLOAT``, ``TEXT`` (str), ``PATH``,
``JSON`` (dict, list, tuple), ``{a,b}`` (a ``Literal``), or a more precise one the setting
declares (``DIR``, ``FILE``, ``URL``, ...). A ``bool`` is ``--x/--no-x``; a switch only
``--x``. :func:`add_model_arguments` makes the options of a flat pydantic model's fields.
The parsed values are validated by the model, so a bad flag fails with the model's message.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import re
import sys
import types
import typing
from collections.abc import Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar

import annotated_types
import pydantic
import pydantic_core

M = TypeVar("M", bound=pydantic.BaseModel)

# The metavar of each value type (argparse would print the upper-cased flag name instead).
TYPE_METAVARS: dict[Any, str] = {int: "N", float: "FLOAT", str: "TEXT", Path: "PATH"}
_BOUNDS = (
    (annotated_types.Ge, ">=", "ge"),
    (annotated_types.Gt, ">", "gt"),
    (annotated_types.Le, "<=", "le"),
    (annotated_types.Lt, "<", "lt"),
)


@dataclasses.dataclass(frozen=True, slots=True)
class Option:
    """One command-line flag: its ``name`` (``--eps-clip``), the ``dest`` its value is
    parsed into, the value's ``annotation``, its ``default`` (``PydanticUndefined``: none),
    one-line ``doc``, range (``metadata``: ``annotated_types.Ge(0.0)`` ...), a declared
    ``metavar``; ``switch``: the flag takes no value and sets ``True``; ``required``:
    argparse insists on it."""

    name: str
    dest: str
    annotation: Any
    default: Any = pydantic_core.PydanticUndefined
    doc: str = ""
    metadata: tuple[Any, ...] = ()
    metavar: str | None = None
    switch: bool = False
    required: bool = False


def add_options(parser: argparse.ArgumentParser, options: Iterable[Option]) -> None:
    """One flag per option; values default to ``SUPPRESS`` (the settings' defaults win)."""
    for option in options:
        parser.add_argument(option.name, dest=option.dest, **_argument(option))


def add_config_argument(
    parser: argparse.ArgumentParser,
    help: str = "settings from a .yaml, .json or .toml file (flags override them)",
) -> None:
    """``--config FILE`` (parsed into ``config_file``; :func:`read_config_file` reads it)."""
    parser.add_argument(
        "--config", dest="config_file", type=Path, metavar="FILE", default=argparse.SUPPRESS,
        help=help,
    )  # fmt: skip


def _argument(option: Option) -> dict[str, Any]:
    kind = _unwrap_optional(option.annotation)
    kwargs: dict[str, Any] = {"help": _help(option), "default": argparse.SUPPRESS}
    if option.required:
        kwargs["required"] = True
    if option.switch:
        kwargs.update(action="store_const", const=True)
    elif kind is bool:
        kwargs["action"] = argparse.BooleanOptionalAction
    elif typing.get_origin(kind) is Literal:
        kwargs["choices"] = list(typing.get_args(kind))
    else:
        kwargs["metavar"] = option.metavar or (
            "JSON" if _is_json(kind) else TYPE_METAVARS.get(kind, "TEXT")
        )
        if kind in (int, float):
            kwargs["type"] = kind
        elif _is_json(kind) and option.metavar is None:
            kwargs["type"] = _json_object
        else:
            kwargs["type"] = str  # the model converts (Path, a filter's name, ...)
    return kwargs


def _help(option: Option) -> str:
    """The doc, the range, then the default unless the doc states it; ``%`` escaped
    (argparse formats help strings)."""
    text = option.doc
    bounds = [
        f"{sign} {getattr(m, attr)}"
        for m in option.metadata
        for kind, sign, attr in _BOUNDS
        if isinstance(m, kind)
    ]
    if bounds:
        text += f" [{', '.join(bounds)}]"
    default = option.default
    unset = default is None or default is pydantic_core.PydanticUndefined or option.switch
    if not unset and "default:" not in text.lower():
        shown = (
            json.dumps(default, default=str)
            if isinstance(default, (dict, list, tuple))
            else str(default)
        )
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    return text.replace("%", "%%")


def _unwrap_optional(annotation: Any) -> Any:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _is_json(annotation: Any) -> bool:
    return typing.get_origin(annotation) in (dict, list, tuple) or annotation in (dict, list)


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def add_model_arguments(
    parser: argparse.ArgumentParser,
    model: type[pydantic.BaseModel],
    *,
    config_file: bool = False,
    exclude: Collection[str] = (),
    metavars: Mapping[str, str] | None = None,
) -> None:
    """Add one flag per field of ``model`` (but ``exclude``): ``--field-name`` (its alias,
    if any), the field's description as the doc. With ``config_file``, ``--config FILE``
    reads any of the fields from a YAML, JSON or TOML file; flags on the command line
    override it. ``metavars`` maps field names to a more precise metavar than their
    type's (``{"save": "DIR"}``)."""
    unknown = sorted(set(metavars or ()) - set(model.model_fields))
    if unknown:
        raise TypeError(f"metavars name fields that {model.__name__} does not have: {unknown}")
    if config_file:
        add_config_argument(parser)
    options = []
    for name, field in model.model_fields.items():
        if name in exclude:
            continue
        key = field.alias or name
        options.append(
            Option(
                "--" + key.replace("_", "-"), key, field.annotation,
                field.get_default(call_default_factory=True), field.description or "",
                tuple(field.metadata), (metavars or {}).get(name),
                required=field.is_required() and not config_file,  # else the file may hold it
            )
        )  # fmt: skip
    add_options(parser, options)


def read_config_file(path: Path) -> dict[str, Any]:
    """A settings file's top-level mapping, keys with ``-`` or ``_``; errors name the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        _usage_error(f"cannot read --config {str(path)!r}: {e}")
    suffix = path.suffix.lower()
    try:
        if suffix == ".json":
            data = json.loads(text)
        elif suffix == ".toml":
            import tomllib

            data = tomllib.loads(text)
        elif suffix in (".yaml", ".yml"):
            try:
                import yaml
            except ImportError:
                _usage_error(
                    "YAML config files need PyYAML (pip install pyyaml); "
                    "or write the file as .json or .toml"
                )
            data = yaml.safe_load(text)
        else:
            _usage_error(f"--config {str(path)!r}: expected a .yaml, .yml, .json or .toml file")
    except Exception as e:  # each parser has its own error type (SystemExit is none)
        _usage_error(f"--config {str(path)!r} does not parse: {e}")
    if not isinstance(data, dict):
        _usage_error(f"--config {str(path)!r} must hold a mapping of settings")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def build_config(model: type[M], namespace: argparse.Namespace) -> M:
    """Validate parsed flags (over ``--config``'s settings) into ``model``; errors name
    the flag."""
    keys = {field.alias or name for name, field in model.model_fields.items()}
    values: dict[str, Any] = {}
    config_file = getattr(namespace, "config_file", None)
    if config_file is not None:
        values.update(read_config_file(config_file))
    values.update({k: v for k, v in vars(namespace).items() if k in keys})
    try:
        return model.model_validate(values)
    except pydantic.ValidationError as e:
        problems = "; ".join(
            f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}"
            if err["loc"]
            else err["msg"].removeprefix("Value error, ")
            for err in e.errors()
        )
        _usage_error(problems)


def add_command(sub: Any, name: str, help: str, doc: str | None) -> argparse.ArgumentParser:
    """Sub-command ``name`` of the sub-parsers ``sub``; its ``--help`` shows ``doc`` (the
    command's module docstring) as written."""
    parser: argparse.ArgumentParser = sub.add_parser(
        name, help=help, description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    return parser


def command_parser(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> argparse.ArgumentParser:
    """The (sub-)parser of the command ``args`` ran: ``agentenv bench engine``'s, not
    ``agentenv``'s."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            chosen = getattr(args, action.dest, None)
            if chosen in action.choices:
                return command_parser(action.choices[chosen], args)
    return parser


def check_unknown_flags(
    parser: argparse.ArgumentParser, extra: Sequence[str], passthrough: Collection[str] = ()
) -> None:
    """Exit (status 2, argparse's way) naming each flag of ``extra`` -- what ``parser``
    did not know -- that is not one of ``passthrough`` (flags handed on to another
    program, e.g. megatron's), with the closest known flag: ``unknown flag --num-rolout;
    did you mean --num-rollout?``. Close by spelling, else by the words of the flags'
    help (``--learning-rate``: ``--lr``, the "peak learning rate")."""
    known: dict[str, str] = {}
    for action in parser._actions:
        for option in action.option_strings:
            known[option] = action.help or ""
    known.update({flag: "" for flag in passthrough if flag not in known})
    problems = []
    for token in extra:
        name = token.split("=", 1)[0]
        if not _is_flag(name) or name in passthrough:
            continue
        close = _close_flags(name, known)
        hint = f"; did you mean {_either(close)}?" if close else ""
        problems.append(f"unknown flag {name}{hint}")
    if problems:
        more = " (--help lists the flags)" if not any("did you mean" in p for p in problems) else ""
        parser.error("; ".join(problems) + more)


def _is_flag(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)  # a negative number is a value
    except ValueError:
        return True
    return False


def _close_flags(name: str, known: Mapping[str, str]) -> list[str]:
    flags = [f for f in known if f.startswith("--")]
    close = difflib.get_close_matches(name, flags, n=1, cutoff=0.75)
    if close:
        return close
    # Another library's name for a flag: every word of it in that flag's help, the
    # shortest help (the flag that is about just that) first.
    words = {w for w in re.split(r"[^a-z]+", name.lower()) if len(w) > 2}
    if not words:
        return []
    found = [f for f in flags if words <= set(re.split(r"[^a-z]+", known[f].lower()))]
    return sorted(found, key=lambda f: len(known[f]))[:3]


def _either(names: Sequence[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _usage_error(message: str) -> NoReturn:
    """Exit like argparse does on a bad flag: the message on stderr, status 2."""
    print(f"agentenv: error: {message}", file=sys.stderr)
    raise SystemExit(2)
