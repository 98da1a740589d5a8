"""How a setting of the training config tree declares its command-line flag, and the base
class of every group of the tree.

Each field declares its flag once, with :func:`setting` (slime's name, the default, a
one-line doc and the range)::

    eps_clip: float = setting("--eps-clip", 0.2, "lower clip of the ratio", ge=0.0)

The CLI (``agentenv train``), the flat form of ``--config`` files and the messages of
invalid settings all read these declarations (:func:`flags`). A field without a flag is
set from Python or the nested form of a config file only.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Mapping
from typing import Any, Self

import pydantic
import pydantic_core

from agentenv import ConfigError

__all__ = ["Flag", "Group", "describe", "flags", "merge", "nest", "setting"]

_NO_CONST = "__no_const__"


def setting(
    flag: str | None,
    default: Any = pydantic_core.PydanticUndefined,
    doc: str = "",
    *,
    const: Any = _NO_CONST,
    metavar: str | None = None,
    sub: Mapping[str, tuple[str, str]] | None = None,
    flat: bool = False,
    **field: Any,
) -> Any:
    """A field of a config group with its command-line ``flag`` (``None``: none).

    ``const``: the flag is a switch that sets the field to this value (slime's
    ``--calculate-per-token-loss`` sets ``aggregation="per_token"``). ``sub``: flags for
    the fields of a record-valued field, ``{"temperature": ("--rollout-temperature",
    "doc")}``. ``metavar``: the value's name in ``--help`` (``DIR``, ``URL`` ...).
    ``flat``: no flag, but a key of the flat config form (its name; e.g. the flags passed
    through to SGLang, which the command line gathers itself). ``field``: pydantic's
    ``Field`` arguments (``ge``, ``default_factory`` ...)."""
    extra: dict[str, Any] = {"flag": flag}
    if flat:
        extra["flat"] = True
    if const != _NO_CONST:
        extra["const"] = const
    if metavar is not None:
        extra["metavar"] = metavar
    if sub is not None:
        extra["sub"] = {name: list(pair) for name, pair in sub.items()}
    return pydantic.Field(default, description=doc, json_schema_extra=extra, **field)


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """One command-line flag of a config tree: where its value goes and how it reads."""

    name: str  # --eps-clip
    path: tuple[str, ...]  # ("algorithm", "eps_clip"); a sub-flag's is one longer
    annotation: Any
    default: Any  # pydantic_core.PydanticUndefined: required
    doc: str
    metadata: tuple[Any, ...] = ()  # the range: annotated_types.Ge(0.0) ...
    const: Any = _NO_CONST
    metavar: str | None = None
    cli: bool = True  # False: a key of the flat config form only

    @property
    def key(self) -> str:
        """The flag's name in a flat config file and in argparse: ``eps_clip``."""
        return self.name.removeprefix("--").replace("-", "_")

    @property
    def is_switch(self) -> bool:
        return not (isinstance(self.const, str) and self.const == _NO_CONST)


def flags(model: type[pydantic.BaseModel], prefix: tuple[str, ...] = ()) -> list[Flag]:
    """Every flag declared in ``model`` and the groups it holds, in declaration order."""
    out: list[Flag] = []
    for name, info in model.model_fields.items():
        path = (*prefix, name)
        kind = info.annotation
        if isinstance(kind, type) and issubclass(kind, pydantic.BaseModel):
            out += flags(kind, path)
            continue
        extra = info.json_schema_extra if isinstance(info.json_schema_extra, dict) else {}
        flag = extra.get("flag")
        cli = not extra.get("flat")
        if not cli:
            flag = "--" + name.replace("_", "-")
        if isinstance(flag, str):
            const = extra.get("const", _NO_CONST)
            default = info.get_default(call_default_factory=True)
            metavar = extra.get("metavar")
            out.append(
                Flag(
                    flag, path, kind, default, info.description or "", tuple(info.metadata),
                    const, metavar if isinstance(metavar, str) else None, cli,
                )
            )  # fmt: skip
        sub = extra.get("sub")
        if isinstance(sub, dict):
            record = info.get_default(call_default_factory=True)
            types = {f.name: f.type for f in dataclasses.fields(record)}
            for field_name, pair in sub.items():
                sub_flag, doc = (str(x) for x in pair)  # type: ignore[union-attr]
                out.append(
                    Flag(
                        str(sub_flag), (*path, field_name), _resolve(types[field_name]),
                        getattr(record, field_name), str(doc),
                    )
                )  # fmt: skip
    return out


def _resolve(kind: Any) -> Any:
    """A dataclass field's type, which ``from __future__ import annotations`` leaves a
    string."""
    return {"int": int, "float": float, "str": str, "bool": bool}.get(kind, kind)


def nest(values: Mapping[str, Any], table: Mapping[str, Flag], groups: set[str]) -> dict[str, Any]:
    """A settings mapping in the nested form (``{"algorithm": {"eps_clip": 0.2}}``), the
    flat form (``{"eps_clip": 0.2}``, keys with ``-`` or ``_``) or a mix, as the nested
    form. A key that is neither is refused, naming the closest one."""
    out: dict[str, Any] = {}
    for raw, value in values.items():
        key = str(raw).replace("-", "_")
        # --optimizer's key is also its group's: a mapping is the group, else the flag.
        is_group = isinstance(value, Mapping | pydantic.BaseModel) or key not in table
        if key in groups and is_group:
            if isinstance(value, pydantic.BaseModel):  # a group: what it was given
                value = {name: getattr(value, name) for name in value.model_fields_set}
            if not isinstance(value, Mapping):
                raise ConfigError(f"{key!r} must be a mapping of its settings, got {value!r}")
            _merge(out, {key: {str(k).replace("-", "_"): v for k, v in value.items()}})
            continue
        flag = table.get(key)
        if flag is None:
            close = difflib.get_close_matches(key, [*table, *groups], n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(
                f"unknown setting {raw!r}: neither a flag's name (e.g. rollout_batch_size) "
                f"nor a group ({', '.join(sorted(groups))}){hint}"
            )
        if flag.is_switch:
            if value is not True and value is not False:
                raise ConfigError(f"{flag.name} is a switch: true or false, got {value!r}")
            if not value:
                continue
            value = flag.const
        node = out
        for part in flag.path[:-1]:
            node = node.setdefault(part, {})
        node[flag.path[-1]] = value
    return out


def _merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = dict(value) if isinstance(value, Mapping) else value


def merge(*layers: Mapping[str, Any]) -> dict[str, Any]:
    """Nested mappings, later ones winning key by key."""
    out: dict[str, Any] = {}
    for layer in layers:
        _merge(out, layer)
    return out


class Group(pydantic.BaseModel):
    """A group of settings: validated on construction (unknown names refused), immutable
    (``model_copy(update=...)`` for a changed copy); an invalid value raises
    :class:`~agentenv.ConfigError` naming its flag, the value and the rule."""

    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except pydantic.ValidationError as e:
            raise ConfigError(describe(e, type(self))) from None

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> Self:
        try:
            return super().model_validate(obj, **kwargs)
        except pydantic.ValidationError as e:
            raise ConfigError(describe(e, cls)) from None


def describe(error: pydantic.ValidationError, model: type[pydantic.BaseModel]) -> str:
    """``error``'s problems, each naming the flag (else the field's path), the value and
    the rule: ``--rollout-batch-size: Input should be greater than or equal to 1, got 0``."""
    names = {f.path: f.name for f in flags(model) if not f.is_switch}
    problems = []
    for err in error.errors():
        loc = tuple(str(p) for p in err["loc"])
        message = err["msg"].removeprefix("Value error, ")
        if err["type"] == "value_error" or not loc:
            problems.append(message if not loc else _nested(loc, names, message))
            continue
        where = names.get(loc) or ".".join(loc)
        got = "" if err["type"] == "missing" else f", got {err['input']!r}"
        problems.append(f"{where}: {message}{got}")
    return "; ".join(problems)


def _nested(loc: tuple[str, ...], names: Mapping[tuple[str, ...], str], message: str) -> str:
    """A message that names its flags already stays as it is; another (a group's field
    without a flag, a record's own check) gets the flag or the path in front."""
    flag = names.get(loc)
    if flag is not None and not message.startswith("--"):
        return f"{flag}: {message}"
    for path, name in names.items():  # a record's check names its field: the flag's
        if path[:-1] == loc and message.startswith(f"{path[-1]} "):
            return f"{name} ({path[-1]}){message.removeprefix(path[-1])}"
    field = re.match(r"[a-z_][a-z0-9_.]*: ", message)  # a group's field without a flag
    return f"{'.'.join(loc)}.{message}" if field else message
