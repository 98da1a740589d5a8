"""Command-line flags generated from a pydantic config model.

Every field becomes ``--field-name`` with its type, default and description; the parsed
values are validated by the model, so a bad flag fails with the model's message.
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from typing import Any, Literal, TypeVar

import pydantic

M = TypeVar("M", bound=pydantic.BaseModel)


def _unwrap_optional(annotation: Any) -> Any:
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return annotation


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON: {e}") from None


def add_model_arguments(parser: argparse.ArgumentParser, model: type[pydantic.BaseModel]) -> None:
    """Add one flag per field of ``model``; values default to ``SUPPRESS`` (model defaults win)."""
    for name, field in model.model_fields.items():
        key = field.alias or name
        flag = "--" + key.replace("_", "-")
        annotation = _unwrap_optional(field.annotation)
        help_text = field.description or ""
        if not field.is_required():
            help_text += f" (default: {field.default})"
        kwargs: dict[str, Any] = {"help": help_text, "default": argparse.SUPPRESS}
        if field.is_required():
            kwargs["required"] = True
        if annotation is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(annotation) is Literal:
            kwargs["choices"] = list(typing.get_args(annotation))
        elif annotation in (int, float, str):
            kwargs["type"] = annotation
            kwargs["metavar"] = annotation.__name__.upper()
        elif typing.get_origin(annotation) is dict or annotation is dict:
            kwargs["type"] = _json_object
            kwargs["metavar"] = "JSON"
        else:
            kwargs["type"] = str
        parser.add_argument(flag, dest=key, **kwargs)


def build_config(model: type[M], namespace: argparse.Namespace) -> M:
    """Validate parsed flags into ``model``; errors name the flag."""
    keys = {field.alias or name for name, field in model.model_fields.items()}
    values = {k: v for k, v in vars(namespace).items() if k in keys}
    try:
        return model.model_validate(values)
    except pydantic.ValidationError as e:
        problems = "; ".join(
            f"--{str(err['loc'][0]).replace('_', '-')}: {err['msg']}" if err["loc"] else err["msg"]
            for err in e.errors()
        )
        raise SystemExit(f"agentenv: error: {problems}") from None
