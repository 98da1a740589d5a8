"""Finding environments by name: ``register``, entry points, or ``module:Class``.

Packages register environments under the entry-point group ``agentenv.environments``
(the bundled ones do, in ``pyproject.toml``); code can call :func:`register`. ``--env``
also accepts ``package.module:ClassName`` for anything importable and
``path/to/file.py:ClassName`` for a file.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from agentenv._environment import Environment
from agentenv._errors import ConfigError

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
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise ConfigError(f"environment file {module_name!r} does not exist")
        loaded = importlib.util.spec_from_file_location(path.stem, path)
        if loaded is None or loaded.loader is None:
            raise ConfigError(f"cannot import environment file {module_name!r}")
        module = importlib.util.module_from_spec(loaded)
        sys.modules[path.stem] = module
        # The file's own folder is importable, as when running `python file.py`.
        sys.path.insert(0, str(path.resolve().parent))
        loaded.loader.exec_module(module)
    else:
        # Modules in the working directory are importable, as with `python -m`.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as e:
            raise ConfigError(f"cannot import environment module {module_name!r}: {e}") from None
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"module {module_name!r} has no attribute {attr!r}") from None


def load_environment(spec: str, kwargs: Mapping[str, Any] | None = None) -> Environment:
    """An environment instance from a registered name or ``module:Class``."""
    if spec in _REGISTRY:
        cls: Any = _REGISTRY[spec]
    elif ":" in spec:
        cls = _import(spec)
    else:
        eps = _entry_points()
        if spec not in eps:
            raise ConfigError(
                f"unknown environment {spec!r}; registered: {available_environments()} "
                "(or pass module:Class or path/to/file.py:Class)"
            )
        cls = eps[spec].load()
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ConfigError(f"{spec!r} is not an agentenv Environment subclass")
    try:
        env: Environment = cls(**dict(kwargs or {}))
        return env
    except TypeError as e:
        raise ConfigError(
            f"cannot construct {cls.__name__} with {dict(kwargs or {})}: {e}"
        ) from None
