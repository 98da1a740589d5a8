"""Anthropic's Messages API (``POST /v1/messages``) on the same machinery as chat
completions: a request's ``system`` and ``messages`` become the :class:`ChatCall` a chat
request would (so the same :class:`EpisodeRecorder` records them), the reply a
``message`` object or its events, and errors Anthropic's shape. What maps to what, and
what is refused: docs/agents.md ("Anthropic's Messages API")."""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from typing import Any

from agentenv._errors import short_repr
from agentenv._http import HTTPError, Response, sse
from agentenv._messages import Message
from agentenv.endpoint._protocol import (
    ChatCall,
    ChatError,
    ChatReply,
    Key,
    ToolCallKey,
    append_assistant,
    bad_field,
    chat_call,
    check_function,
    tool_call,
)
from agentenv.endpoint._protocol import type_name as _kind

__all__ = [
    "anthropic_error",
    "anthropic_refusal",
    "message_body",
    "message_events",
    "parse_count_tokens",
    "parse_messages",
]

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors).
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}
# Chat-completions fields a message field is checked as, renamed back in the refusal.
_FIELDS = {"stop": "stop_sequences", "max_completion_tokens": "max_tokens"}
_UNSUPPORTED = ("image", "document", "search_result", "container_upload")
_THINKING = ("thinking", "redacted_thinking")
_KNOWN_IDS = 5  # tool_use ids a refused tool_result's message lists (the latest)


def anthropic_error(e: ChatError) -> Response:
    """``e`` in Anthropic's error shape (same status)."""
    # The anthropic SDK retries 5xx (and 408/409/429) answers unless told not to.
    headers = [] if e.retry else [("x-should-retry", "false")]
    return _error(e.status, e.message, headers)


def anthropic_refusal(e: HTTPError) -> Response:
    """A refusal of the HTTP layer (413, 408, 429, 410, 503, ...) of a request to a
    Messages route, in Anthropic's error shape: the route's clients parse no other."""
    return _error(e.status, e.message, e.headers)


def _error(status: int, message: str, headers: list[tuple[str, str]]) -> Response:
    kind = _ERROR_TYPES.get(status, "invalid_request_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return Response.json(body, status=status, headers=headers)


def _text(value: Any, param: str) -> str:
    """A string, or a list of ``text`` blocks joined (tool results, ``system``)."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise bad_field(param, f"expected a string or a list of text blocks, got {_kind(value)}")
    parts = []
    for j, block in enumerate(value):
        where = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        else:
            _refuse_block(block, where, "text")
    return "".join(parts)


def _refuse_block(block: Any, where: str, expected: str) -> None:
    if not isinstance(block, dict):
        raise bad_field(where, f"a content block must be an object, got {_kind(block)}")
    kind = block.get("type")
    if kind in _UNSUPPORTED:
        raise bad_field(
            f"{where}.type",
            f"{kind!r} content is not supported: this endpoint serves a text-only model; "
            "send text blocks only",
        )
    if kind in _THINKING:
        raise bad_field(
            f"{where}.type",
            f"{kind!r} blocks are not supported: this endpoint never returns them; "
            "leave them out of the history",
        )
    if kind in ("text", "tool_use", "tool_result"):
        raise bad_field(where, f"a malformed {kind!r} block: expected {expected}")
    raise bad_field(
        f"{where}.type", f"unknown content block type {short_repr(kind)}; expected {expected}"
    )


def _blocks(value: Any, param: str) -> list[Any]:
    if isinstance(value, str):
        return [{"type": "text", "text": value}]
    if not isinstance(value, list):
        raise bad_field(param, f"expected a string or a list of content blocks, got {_kind(value)}")
    return value


def _user(
    i: int, content: Any, seen: dict[str, None], messages: list[Message], keys: list[Key]
) -> None:
    """A user message: consecutive text blocks are one user message, each tool result a
    tool message, in the order sent."""
    param = f"messages[{i}].content"
    text: list[str] | None = None
    results = 0
    for j, block in enumerate(_blocks(content, param)):
        where = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text = text or []
            text.append(block["text"])
            continue
        if kind != "tool_result":
            _refuse_block(block, where, '"text" or "tool_result"')
        if text is not None:
            messages.append({"role": "user", "content": "".join(text)})
            keys.append(("user", "".join(text), "", ()))
            text = None
        use_id = block.get("tool_use_id")
        if not isinstance(use_id, str) or use_id not in seen:
            known = ", ".join(list(seen)[-_KNOWN_IDS:]) or "none"
            raise bad_field(
                f"{where}.tool_use_id",
                f"{short_repr(use_id)} matches no earlier tool_use block ({len(seen)} sent "
                f"so far, the latest: {known}); answer each tool_use with a tool_result "
                "carrying its id",
            )
        output = _text(block.get("content", ""), f"{where}.content")
        messages.append({"role": "tool", "content": output, "tool_call_id": use_id})
        keys.append(("tool", output, use_id, ()))
        results += 1
    if text is not None or not results:
        joined = "".join(text or [])
        messages.append({"role": "user", "content": joined})
        keys.append(("user", joined, "", ()))


def _assistant(
    i: int, content: Any, seen: dict[str, None], messages: list[Message], keys: list[Key]
) -> None:
    """An assistant message: its text blocks joined, its tool_use blocks its tool calls
    (arguments as the JSON text the reply carried, so a returned reply is recognised)."""
    param = f"messages[{i}].content"
    text: list[str] = []
    calls: list[tuple[dict[str, Any], ToolCallKey]] = []
    for j, block in enumerate(_blocks(content, param)):
        where = f"{param}[{j}]"
        kind = block.get("type") if isinstance(block, dict) else None
        if kind == "text" and isinstance(block.get("text"), str):
            text.append(block["text"])
            continue
        if kind != "tool_use":
            _refuse_block(block, where, '"text" or "tool_use"')
        use_id, name, arguments = block.get("id"), block.get("name"), block.get("input", {})
        if not isinstance(use_id, str) or not use_id:
            raise bad_field(f"{where}.id", f"expected a non-empty string, got {short_repr(use_id)}")
        if not isinstance(name, str) or not name:
            raise bad_field(f"{where}.name", f"expected a non-empty string, got {short_repr(name)}")
        if not isinstance(arguments, dict):
            raise bad_field(f"{where}.input", f"expected an object, got {_kind(arguments)}")
        seen[use_id] = None
        calls.append(tool_call(use_id, name, json.dumps(arguments, ensure_ascii=False)))
    append_assistant(messages, keys, "".join(text), calls)


def _conversation(body: Mapping[str, Any]) -> tuple[list[Message], list[Key]]:
    messages: list[Message] = []
    keys: list[Key] = []
    system = body.get("system")
    if system is not None:
        text = _text(system, "system")
        if text:
            messages.append({"role": "system", "content": text})
            keys.append(("system", text, "", ()))
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_field("messages", "expected a non-empty list of messages")
    seen: dict[str, None] = {}  # the tool_use ids sent so far, in order
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad_field(
                f"messages[{i}]", f"expected an object with 'role' and 'content', got {_kind(m)}"
            )
        role = m.get("role")
        if role == "user":
            _user(i, m.get("content"), seen, messages, keys)
        elif role == "assistant":
            if i == len(raw) - 1:
                raise bad_field(
                    f"messages[{i}].role",
                    "a final assistant message (prefill) is not supported: end the "
                    "conversation with a user message",
                )
            _assistant(i, m.get("content"), seen, messages, keys)
        else:
            raise bad_field(
                f"messages[{i}].role",
                f"unknown role {short_repr(role)}; expected 'user' or 'assistant'",
            )
    return messages, keys


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad_field("tools", f"expected a list of tools, got {_kind(tools)}")
    out = []
    for j, t in enumerate(tools):
        where = f"tools[{j}]"
        if not isinstance(t, dict):
            raise bad_field(where, f"expected a tool object, got {_kind(t)}")
        if t.get("type", "custom") != "custom":
            raise bad_field(
                f"{where}.type",
                f"{t.get('type')!r} tools are Anthropic's server tools, not served here; "
                'send custom tools ({"name", "description", "input_schema"})',
            )
        name = t.get("name")
        if not isinstance(name, str) or not name:
            raise bad_field(f"{where}.name", f"expected a non-empty string, got {short_repr(name)}")
        check_function(t, where, "input_schema")
        function = {k: t[k] for k in ("name", "description") if t.get(k) is not None}
        out.append({"type": "function", "function": {**function, "parameters": t["input_schema"]}})
    return out


def _tool_choice(body: Mapping[str, Any]) -> Any:
    choice = body.get("tool_choice")
    if choice is None:
        return None
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_field(
        "tool_choice",
        'expected {"type": "auto"}, {"type": "any"}, {"type": "none"} or '
        f'{{"type": "tool", "name": ...}}, got {short_repr(choice)}',
    )


def _stop_sequences(body: Mapping[str, Any]) -> list[str] | None:
    stops = body.get("stop_sequences")
    if stops is None:
        return None
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad_field(
            "stop_sequences", f"expected a list of non-empty strings, got {short_repr(stops)}"
        )
    return stops


def _call(body: Any, *, count: bool) -> ChatCall:
    if not isinstance(body, dict):
        raise bad_field("messages", "the request body must be a JSON object")
    if not count and body.get("max_tokens") is None:
        raise bad_field("max_tokens", "required: the most tokens the reply may have, e.g. 1024")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad_field("model", f"expected a string, got {short_repr(model)}")
    messages, keys = _conversation(body)
    chat: dict[str, Any] = {
        "model": model,
        "tool_choice": _tool_choice(body),
        "max_tokens": None if count else body.get("max_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "stop": _stop_sequences(body),
        "stream": False if count else body.get("stream"),
    }
    try:
        return chat_call(chat, messages, keys, _tools(body))
    except ChatError as e:
        name = _FIELDS.get(e.param or "")
        if name is None:
            raise
        raise bad_field(name, e.message.removeprefix(f"{e.param}:").strip()) from None


def parse_messages(body: Any) -> ChatCall:
    """Check a ``POST /v1/messages`` body; :class:`ChatError` (400) names the bad field."""
    return _call(body, count=False)


def parse_count_tokens(body: Any) -> ChatCall:
    """Check a ``POST /v1/messages/count_tokens`` body (no ``max_tokens``)."""
    return _call(body, count=True)


# -- answers ---------------------------------------------------------------------------


def _content(reply: ChatReply) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    if reply.content:
        out.append({"type": "text", "text": reply.content})
    for c in reply.tool_calls:
        try:
            arguments = json.loads(c.arguments) if c.arguments else {}
        except ValueError:
            arguments = None
        # A call whose arguments are not a JSON object (the model's malformed call) is
        # handed over with empty input: Anthropic's tool_use carries an object.
        out.append(
            {
                "type": "tool_use",
                "id": c.id,
                "name": c.name,
                "input": arguments if isinstance(arguments, dict) else {},
            }
        )
    return out


def _stop(call: ChatCall, reply: ChatReply) -> tuple[str, str | None]:
    if reply.finish_reason == "length":
        return "max_tokens", None
    if reply.finish_reason == "tool_calls":
        return "tool_use", None
    if reply.stop_sequence is not None and reply.stop_sequence in call.stop:
        return "stop_sequence", reply.stop_sequence
    return "end_turn", None


def _usage(reply: ChatReply) -> dict[str, Any]:
    return {
        "input_tokens": reply.prompt_tokens,
        "output_tokens": len(reply.token_ids),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
    }


def message_body(call: ChatCall, reply: ChatReply, mid: str, model: str) -> dict[str, Any]:
    """The ``message`` object."""
    reason, sequence = _stop(call, reply)
    return {
        "id": mid,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": _content(reply),
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": _usage(reply),
    }


def message_events(call: ChatCall, reply: ChatReply, mid: str, model: str) -> Iterator[bytes]:
    """The streamed form: ``message_start``, each content block's start, delta and stop,
    ``message_delta`` (the stop reason and output tokens), ``message_stop``."""

    def event(kind: str, **data: Any) -> bytes:
        return sse(json.dumps({"type": kind, **data}, separators=(",", ":")), event=kind)

    done = message_body(call, reply, mid, model)
    usage = {**done["usage"], "output_tokens": 0}
    start = {**done, "content": [], "stop_reason": None, "stop_sequence": None, "usage": usage}
    yield event("message_start", message=start)
    for i, block in enumerate(done["content"]):
        if block["type"] == "text":
            yield event("content_block_start", index=i, content_block={"type": "text", "text": ""})
            delta = {"type": "text_delta", "text": block["text"]}
        else:
            yield event("content_block_start", index=i, content_block={**block, "input": {}})
            partial = json.dumps(block["input"], ensure_ascii=False)
            delta = {"type": "input_json_delta", "partial_json": partial}
        yield event("content_block_delta", index=i, delta=delta)
        yield event("content_block_stop", index=i)
    yield event(
        "message_delta",
        delta={"stop_reason": done["stop_reason"], "stop_sequence": done["stop_sequence"]},
        usage={"output_tokens": done["usage"]["output_tokens"]},
    )
    yield event("message_stop")
