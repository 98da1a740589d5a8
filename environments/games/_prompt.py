"""The messages each bundled game prompts a player with."""

from __future__ import annotations

from collections.abc import Sequence

from agentenv import Message


def prompt(rules: str, situation: str, legal: Sequence[str] | None = None) -> list[Message]:
    """``rules`` as the system message; ``situation``, then the ``legal`` moves (each in
    brackets) when given, then "Your move?" as the user's."""
    if legal is not None:
        situation += "\nLegal moves: " + ", ".join(f"[{a}]" for a in legal) + "."
    return [
        {"role": "system", "content": rules},
        {"role": "user", "content": f"{situation} Your move?"},
    ]
