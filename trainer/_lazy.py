"""Public names that load on first use: a package lists its lazy names and the modules
that define them, and takes its module-level ``__getattr__`` and ``__dir__`` from
:func:`lazy_names`, so that importing it imports none of those modules (most need torch).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Sequence
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(
    package: str, names: Sequence[str], modules: Sequence[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``package``'s ``__getattr__`` and ``__dir__`` for ``names``, each taken from the
    first of ``modules`` whose ``__all__`` lists it (put the light modules first: they are
    imported on the way). A name is imported at its first lookup and kept in the package's
    namespace, so later lookups skip ``__getattr__``; any other name is an
    :class:`AttributeError`."""
    namespace = vars(sys.modules[package])

    def __getattr__(name: str) -> Any:
        if name in names:
            for path in modules:
                module = importlib.import_module(path)
                if name in module.__all__:
                    namespace[name] = value = getattr(module, name)
                    return value
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted({*namespace, *names})

    return __getattr__, __dir__
