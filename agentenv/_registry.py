"""Finding environments by name (``--env``): :func:`register`, the entry-point group
``agentenv.environments``, ``package.module:ClassName`` or ``path/to/file.py:ClassName``;
the keyword arguments are checked against the constructor's signature and type hints
before it is called (docs/guide.md, "Errors")."""

from __future__ import annotations

import importlib.metadata
import inspect
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, get_type_hints

import pydantic

from agentenv._environment import Environment
from agentenv._errors import ConfigError
from agentenv._names import did_you_mean, import_file, no_attribute, resolve_name

if TYPE_CHECKING:
    from agentenv._rewards import Rubric

__all__ = ["available_environments", "load_environment", "register"]

_REGISTRY: dict[str, type[Environment]] = {}
_GROUP = "agentenv.environments"

E = TypeVar("E", bound=type[Environment])


def register(name: str | None = None) -> Callable[[E], E]:
    """Class decorator: make an environment loadable as ``--env NAME`` (default: its ``name``)."""

    def wrap(cls: E) -> E:
        key = name or cls.name
        if not key:
            raise ConfigError(f"{cls.__name__} needs a name to be registered (set name = '...')")
        _REGISTRY[key] = cls
        return cls

    return wrap


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=_GROUP)}


def available_environments() -> list[str]:
    """Names usable with ``--env``."""
    return sorted(set(_REGISTRY) | set(_entry_points()))


def _import(spec: str) -> Any:
    module_name, _, attr = spec.rpartition(":")
    if not module_name.endswith(".py"):
        # Modules in the working directory are importable, as with `python -m`.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        return resolve_name(spec, what="environment", kind="Class")
    path = Path(module_name)
    # The file's own folder is importable, as when running `python file.py`.
    sys.path.insert(0, str(path.resolve().parent))
    module = import_file(path, path.stem, "environment file")
    if not hasattr(module, attr):
        raise no_attribute("environment", spec, module_name, attr, vars(module))
    return getattr(module, attr)


def _check_kwargs(cls: type[Environment], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """``kwargs`` checked against ``cls``'s constructor: names, then types from its hints.

    Returns the validated values (JSON numbers coerced as the hints say, e.g. 1 -> 1.0).
    """
    try:
        signature = inspect.signature(cls)
    except (TypeError, ValueError):  # no introspectable signature: let the call decide
        return dict(kwargs)
    params = signature.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [n for n, p in params.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    for key in kwargs:
        if key not in params and not takes_any:
            raise ConfigError(
                f"{cls.__name__} has no argument {key!r}"
                + did_you_mean(key, named, " (did you mean {}?)")
                + f"; its arguments: {named or 'none'}"
            )
    try:
        hints = get_type_hints(cls.__init__)
    except Exception:  # unresolvable hints: check names only
        hints = {}
    out = dict(kwargs)
    for key, value in kwargs.items():
        if key not in hints or key not in params:
            continue
        try:
            adapter: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(
                hints[key], config=pydantic.ConfigDict(arbitrary_types_allowed=True)
            )
            out[key] = adapter.validate_python(value)
        except (pydantic.PydanticSchemaGenerationError, pydantic.PydanticUserError, TypeError):
            continue  # a type pydantic cannot check (a Protocol): the constructor does
        except pydantic.ValidationError as e:
            problem = e.errors()[0]["msg"]
            raise ConfigError(
                f"{cls.__name__} argument {key!r} must be {_type_name(hints[key])}, got "
                f"{type(value).__name__} {value!r} ({problem})"
            ) from None
    return out


def _scored_by(cls: type[Environment], rubric: Rubric) -> type[Environment]:
    from agentenv._multiturn import MultiTurnEnv

    if not issubclass(cls, MultiTurnEnv):
        raise ConfigError(
            f"{cls.__name__} scores its own episodes in its rollout: a rubric replaces the "
            "rubric of a SingleTurnEnv, MultiTurnEnv or ToolEnv only"
        )
    namespace = {"rubric": rubric, "__module__": cls.__module__, "__qualname__": cls.__qualname__}
    return type(cls.__name__, (cls,), namespace)


def _type_name(hint: Any) -> str:
    return hint.__name__ if isinstance(hint, type) else str(hint).replace("typing.", "")


def environment_class(spec: str) -> type[Environment]:
    """The environment class of a registered name or ``module:Class``."""
    if spec in _REGISTRY:
        cls: Any = _REGISTRY[spec]
    elif ":" in spec:
        cls = _import(spec)
    else:
        eps = _entry_points()
        if spec not in eps:
            names = available_environments()
            raise ConfigError(
                f"unknown environment {spec!r}"
                + did_you_mean(spec, names, " (did you mean {}?)")
                + f"; registered: {names} (or pass module:Class or path/to/file.py:Class)"
            )
        cls = eps[spec].load()
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"{spec!r} is not an agentenv Environment subclass")
    found: type[Environment] = cls
    return found


def load_environment(
    spec: str, kwargs: Mapping[str, Any] | None = None, *, rubric: Rubric | None = None
) -> Environment:
    """An environment instance from a registered name or ``module:Class``, built with
    ``kwargs``. ``rubric``: scores its episodes in place of its own -- the environment is
    then of a subclass of its class with that rubric (as a subclass of one's own would
    set it), for the environments that score with a rubric (a :class:`SingleTurnEnv`,
    :class:`MultiTurnEnv` or :class:`ToolEnv`; others are refused)."""
    cls: type[Environment] = environment_class(spec)
    if rubric is not None:
        cls = _scored_by(cls, rubric)
    checked = _check_kwargs(cls, kwargs or {})
    try:
        env: Environment = cls(**checked)
        return env
    except TypeError as e:
        raise ConfigError(
            f"cannot construct {cls.__name__} with {dict(kwargs or {})}: {e}"
        ) from None
