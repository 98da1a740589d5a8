"""``module:attr`` names (``--env``, ``--dynamic-sampling-filter-path``, a backend's
factory): the object one names, resolved by the standard library's
:func:`pkgutil.resolve_name`, or a :class:`ConfigError` that says what is wrong."""

from __future__ import annotations

import difflib
import importlib.util
import pkgutil
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

from agentenv._errors import ConfigError

__all__ = ["did_you_mean", "import_file", "no_attribute", "resolve_name"]


def did_you_mean(name: str, candidates: Iterable[str], form: str = "; did you mean {}?") -> str:
    """``form`` holding the names in ``candidates`` closest to ``name`` ("A or B"), or ""
    when none is."""
    close = " or ".join(difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6))
    return form.format(close) if close else ""


def no_attribute(what: str, spec: str, owner: str, attr: str, names: Iterable[str]) -> ConfigError:
    """The error for ``owner`` (of ``spec``) lacking ``attr``, naming its closest public
    ``names``."""
    public = [n for n in names if not n.startswith("_")]
    return ConfigError(
        f"{what} {spec!r}: {owner!r} has no attribute {attr!r}" + did_you_mean(attr, public)
    )


def import_file(path: Path, module: str, what: str) -> ModuleType:
    """The Python file ``path`` imported as module ``module`` (registered in
    ``sys.modules``, as an imported module is), or a :class:`ConfigError` naming ``what``."""
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r}: no such file")
    spec = importlib.util.spec_from_file_location(module, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what} {str(path)!r}: cannot import it")
    loaded = importlib.util.module_from_spec(spec)
    sys.modules[module] = loaded
    spec.loader.exec_module(loaded)
    return loaded


def resolve_name(spec: str, *, what: str, kind: str = "name") -> Any:
    """The object that ``spec`` names: ``package.module:attr`` or ``package.module.attr``
    (``attr`` may be dotted, ``Class.method``).

    Raises :class:`ConfigError` starting with ``what`` (the flag or role, e.g.
    ``--dynamic-sampling-filter-path``) and ``spec``: for a name without a module (``kind``
    says what the name should be, e.g. ``function``), a module that does not import, or a
    missing attribute (with the closest names the owner has).
    """
    module, colon, attr = spec.partition(":")
    if not module or (colon and not attr) or (not colon and "." not in spec):
        raise ConfigError(f"{what} {spec!r}: expected module:{kind} or module.{kind}")
    try:
        return pkgutil.resolve_name(spec)
    except ValueError:
        raise ConfigError(f"{what} {spec!r}: expected module:{kind} or module.{kind}") from None
    except ImportError as e:
        importing = module if colon else spec.rpartition(".")[0]
        raise ConfigError(f"{what} {spec!r}: cannot import {importing!r}: {e}") from None
    except AttributeError:
        pass
    owner_spec, _, last = spec.rpartition(".") if "." in (attr or spec) else (module, "", attr)
    owner = pkgutil.resolve_name(owner_spec)  # resolved a moment ago, up to ``last``
    raise no_attribute(what, spec, owner_spec, last, dir(owner)) from None
