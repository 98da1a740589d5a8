"""Answer extraction shared by the arithmetic environments."""

from __future__ import annotations

import re

_INT = re.compile(r"-?\d[\d,]*")


def last_integer(text: str) -> int | None:
    """The last integer written in ``text`` (``1,234`` counts as 1234), or ``None``."""
    found = _INT.findall(text)
    if not found:
        return None
    try:
        return int(found[-1].replace(",", ""))
    except ValueError:
        return None
