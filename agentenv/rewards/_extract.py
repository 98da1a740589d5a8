"""Reading an answer out of a model's response: the text after its thinking, the last
``\\boxed{...}``, the last number, and a light normalisation of answer strings."""

from __future__ import annotations

import re

__all__ = ["after_thinking", "last_boxed", "last_number", "normalize_text"]

_THINK_OPEN, _THINK_CLOSE = "<think>", "</think>"
# -1,234.5 | 3/4 | .5 (a thousands comma only before three digits)
_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:/\d+)?")


def after_thinking(text: str) -> str | None:
    """The part of ``text`` after its last ``</think>``; ``text`` itself when it has no
    thinking; ``None`` when a ``<think>`` is never closed (the answer was cut off)."""
    if _THINK_CLOSE in text:
        return text.rsplit(_THINK_CLOSE, 1)[1]
    if _THINK_OPEN in text:
        return None
    return text


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in ``text``, braces
    balanced; ``\\boxed 5`` (no braces) gives ``5``. ``None`` when there is none, or the
    last one is never closed."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    rest = text[start + (6 if text.startswith("\\boxed", start) else 5) :]
    if rest.startswith(" "):  # \boxed 5: up to the end of the word
        word = rest.strip().split(maxsplit=1)
        return word[0].rstrip("$.") if word else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None


def last_number(text: str) -> str | None:
    """The last number written in ``text`` (``-1,234.5``, ``3/4``, ``.5``), thousands
    commas removed; ``None`` when there is none."""
    found = [m.group() for m in _NUMBER.finditer(text) if any(c.isdigit() for c in m.group())]
    if not found:
        return None
    return found[-1].replace(",", "")


def normalize_text(answer: str) -> str:
    """``answer`` for a string comparison: no surrounding ``$``, ``\\text{...}`` wrapper,
    spaces, ``\\left``/``\\right``, trailing period; ``\\dfrac``/``\\tfrac`` as
    ``\\frac``; lower case."""
    out = answer.strip().strip("$").strip()
    wrapped = re.fullmatch(r"\\text\{(.*)\}", out)
    if wrapped:
        out = wrapped.group(1)
    for old, new in (("\\left", ""), ("\\right", ""), ("\\dfrac", "\\frac"),
                     ("\\tfrac", "\\frac"), ("\\!", ""), (" ", ""), ("\n", "")):  # fmt: skip
        out = out.replace(old, new)
    return out.rstrip(".").lower()
