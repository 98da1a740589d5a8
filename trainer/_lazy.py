"""Public names that load on first use: a package lists the module each of its names
lives in and takes its module-level ``__getattr__`` and ``__dir__`` from
:func:`lazy_names`, so that importing it imports none of those modules (most need torch).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, modules: Mapping[str, str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``package``'s ``__getattr__`` and ``__dir__`` for the names of ``modules`` (each
    name: the module that defines it). A name is imported at its first lookup and kept in
    the package's namespace, so later lookups skip ``__getattr__``; any other name is an
    :class:`AttributeError`."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        module = modules.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *modules})

    return __getattr__, __dir__
