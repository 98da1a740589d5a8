"""Chat messages: the OpenAI-style dicts chat templates consume, validated at the boundary."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal, NotRequired, TypedDict

from agentenv._errors import MessageError

__all__ = ["ROLES", "Message", "validate_messages"]

Role = Literal["system", "user", "assistant", "tool"]
ROLES: frozenset[str] = frozenset({"system", "user", "assistant", "tool"})


class Message(TypedDict):
    """One chat message. ``content`` is always a string (multimodal parts are out of scope)."""

    role: Role
    content: str
    name: NotRequired[str]
    tool_call_id: NotRequired[str]
    tool_calls: NotRequired[list[dict[str, Any]]]


_OPTIONAL_STR = ("name", "tool_call_id")


def validate_messages(messages: Iterable[Mapping[str, Any]] | str) -> list[Message]:
    """Check chat messages and return them as a new list of plain dicts.

    A bare string is shorthand for one user message. Raises :class:`MessageError`
    naming the offending index and field.
    """
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    out: list[Message] = []
    for i, m in enumerate(messages):
        if type(m) is not dict and not isinstance(m, Mapping):  # dict first: ABC checks are slow
            raise MessageError(
                f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}"
            )
        role = m.get("role")
        if role not in ROLES:
            raise MessageError(
                f"message {i} has unknown role {role!r}; expected one of {sorted(ROLES)}"
            )
        content = m.get("content")
        if content is None and role == "assistant" and m.get("tool_calls"):
            content = ""
        if not isinstance(content, str):
            raise MessageError(
                f"message {i} ({role}) must have string 'content', got {type(content).__name__}"
            )
        for key in _OPTIONAL_STR:
            if key in m and not isinstance(m[key], str):
                raise MessageError(f"message {i} field {key!r} must be a string")
        unknown = set(m) - {"role", "content", "tool_calls", *_OPTIONAL_STR}
        if unknown:
            raise MessageError(f"message {i} has unknown fields {sorted(unknown)}")
        msg: dict[str, Any] = dict(m)
        msg["content"] = content
        out.append(msg)  # type: ignore[arg-type]
    return out
