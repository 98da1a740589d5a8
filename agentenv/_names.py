"""``module:attr`` names (``--env``, ``--dynamic-sampling-filter-path``, a backend's
factory): the object one names, resolved by the standard library's
:func:`pkgutil.resolve_name`, or a :class:`ConfigError` that says what is wrong."""

from __future__ import annotations

import difflib
import pkgutil
from collections.abc import Iterable
from typing import Any

from agentenv._errors import ConfigError

__all__ = ["close_names", "resolve_name"]


def close_names(name: str, candidates: Iterable[str]) -> str:
    """The names in ``candidates`` closest to ``name`` ("A or B"), or "" when none is."""
    return " or ".join(difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6))


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
    close = close_names(last, [n for n in dir(owner) if not n.startswith("_")])
    raise ConfigError(
        f"{what} {spec!r}: {owner_spec!r} has no attribute {last!r}"
        + (f"; did you mean {close}?" if close else "")
    ) from None
