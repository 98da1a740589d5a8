"""OpenAI chat completions on the wire: a request parsed into a :class:`ChatCall`, the
answer as OpenAI sends it (a ``chat.completion`` object, or SSE chunks), and errors in
OpenAI's shape, each refusal naming the field (``param``). Bodies are decoded JSON, so
their objects are checked as ``dict`` (cheaper than an ABC check)."""

from __future__ import annotations

import dataclasses
import json
import math
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from agentenv._errors import AgentEnvError
from agentenv._http import Response, sse
from agentenv._messages import Message

__all__ = [
    "ChatCall",
    "ChatError",
    "ChatReply",
    "Key",
    "ReplyToolCall",
    "ToolCallKey",
    "append_assistant",
    "bad_field",
    "chat_call",
    "check_function",
    "content_text",
    "parse_chat",
    "tool_call",
    "type_name",
]

# A message as the agent sees it, for matching a call against earlier calls' messages:
# (role, content, name or tool_call_id, tool calls as (id, name, arguments)).
ToolCallKey = tuple[str, str, str]
Key = tuple[str, str, str, tuple[ToolCallKey, ...]]

_ROLES = ("system", "developer", "user", "assistant", "tool")
_MAX_STOP = 4


class ChatError(AgentEnvError):
    """A request refused with OpenAI's error body; ``param`` names the field."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        retry: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.retry = retry

    def to_response(self) -> Response:
        body = {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }
        # The openai SDK retries 5xx answers unless told not to.
        headers = [] if self.retry else [("x-should-retry", "false")]
        return Response.json(body, status=self.status, headers=headers)


def bad_field(param: str, message: str, code: str | None = None) -> ChatError:
    """A 400 naming ``param``."""
    return ChatError(400, f"{param}: {message}", param=param, code=code)


@dataclasses.dataclass(frozen=True, slots=True)
class ChatCall:
    """One parsed ``POST /v1/chat/completions``.

    ``messages`` are chat-template messages (assistant messages as the agent sent them;
    the recorder swaps in the model's own text for replies it returned); ``keys`` are the
    same messages as the agent sees them, for matching against earlier calls.
    """

    messages: list[Message]
    keys: list[Key]
    tools: list[dict[str, Any]] | None
    tools_key: str
    parse_tools: bool
    model: str
    max_tokens: int | None
    temperature: float | None
    top_p: float | None
    stop: tuple[str, ...]
    seed: int | None
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool


@dataclasses.dataclass(frozen=True, slots=True)
class ReplyToolCall:
    """A tool call returned to the agent (``arguments`` is a JSON string, as OpenAI's)."""

    id: str
    name: str
    arguments: str


@dataclasses.dataclass(frozen=True, slots=True)
class ChatReply:
    """The assistant's answer to one call, with the exact tokens behind it (``tokens``,
    their texts, only when the call asked for log-probs; ``stop_sequence``, the stop
    string that ended it, left out of ``content``)."""

    content: str | None
    tool_calls: tuple[ReplyToolCall, ...]
    finish_reason: str
    token_ids: list[int]
    logprobs: list[float]
    tokens: list[str]
    prompt_tokens: int
    weight_version: str
    stop_sequence: str | None = None

    @property
    def key(self) -> Key:
        calls = tuple((c.id, c.name, c.arguments) for c in self.tool_calls)
        return ("assistant", self.content or "", "", calls)


def content_text(value: Any, param: str, *, allow_none: bool = False) -> str:
    """A message's content as text: a string, or a list of text parts joined."""
    if isinstance(value, str):
        return value
    if value is None and allow_none:
        return ""
    if isinstance(value, list):
        parts = []
        for j, part in enumerate(value):
            where = f"{param}[{j}]"
            if not isinstance(part, dict):
                raise bad_field(
                    where, f"a content part must be an object, got {type(part).__name__}"
                )
            kind = part.get("type")
            text_kind = "text" if kind in ("input_text", "output_text") else kind
            if text_kind in ("text", "refusal") and isinstance(part.get(text_kind), str):
                parts.append(part[text_kind])
            elif kind in ("image_url", "input_audio", "file", "input_image", "audio"):
                raise bad_field(
                    f"{where}.type",
                    f"{kind!r} content is not supported: this endpoint serves a text-only "
                    "model; send text parts only",
                )
            else:
                raise bad_field(
                    f"{where}.type", f'expected "text" with a string "text", got {kind!r}'
                )
        return "".join(parts)
    raise bad_field(param, f"expected a string or a list of text parts, got {type(value).__name__}")


def _tool_calls(value: Any, param: str) -> tuple[list[dict[str, Any]], tuple[Any, ...]]:
    """The template's form (arguments parsed when JSON) and the matching key."""
    if not isinstance(value, list):
        raise bad_field(param, f"expected a list, got {type(value).__name__}")
    calls: list[dict[str, Any]] = []
    key: list[ToolCallKey] = []
    for j, call in enumerate(value):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_field(where, 'expected {"id", "type": "function", "function": {"name", ...}}')
        arguments = fn.get("arguments", "")
        if not isinstance(arguments, str):
            raise bad_field(f"{where}.function.arguments", "expected a JSON string")
        call_id = call.get("id") or ""
        if not isinstance(call_id, str):
            raise bad_field(f"{where}.id", "expected a string")
        template, sent = tool_call(call_id, fn["name"], arguments)
        calls.append(template)
        key.append(sent)
    return calls, tuple(key)


def tool_call(call_id: str, name: str, arguments: str) -> tuple[dict[str, Any], ToolCallKey]:
    """A tool call as the chat template takes it (its JSON arguments parsed) and as the
    agent sent it (its key)."""
    try:
        parsed: Any = json.loads(arguments) if arguments else {}
    except ValueError:
        parsed = arguments
    function = {"name": name, "arguments": parsed}
    return {"type": "function", "id": call_id, "function": function}, (call_id, name, arguments)


def append_assistant(
    messages: list[Message],
    keys: list[Key],
    content: str,
    calls: Sequence[tuple[dict[str, Any], ToolCallKey]],
) -> None:
    """Append an assistant turn of ``content`` and ``calls`` (:func:`tool_call`'s)."""
    msg: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        msg["tool_calls"] = [template for template, _ in calls]
    messages.append(msg)  # type: ignore[arg-type]
    keys.append(("assistant", content, "", tuple(key for _, key in calls)))


def _message(i: int, m: Any) -> tuple[Message, Key]:
    param = f"messages[{i}]"
    if not isinstance(m, dict):
        raise bad_field(
            param, f"expected an object with 'role' and 'content', got {type(m).__name__}"
        )
    role = m.get("role")
    if role not in _ROLES:
        raise bad_field(
            f"{param}.role", f"unknown role {role!r}; expected one of {', '.join(_ROLES)}"
        )
    tpl_role = "system" if role == "developer" else role
    if role in ("audio",) or m.get("audio") is not None:
        raise bad_field(f"{param}.audio", "audio is not supported by this text-only endpoint")
    content = content_text(m.get("content"), f"{param}.content", allow_none=role == "assistant")
    name = m.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_field(f"{param}.name", "expected a string")
    msg: dict[str, Any] = {"role": tpl_role, "content": content}
    if name:
        msg["name"] = name
    if role == "assistant":
        raw = m.get("tool_calls")
        calls: tuple[Any, ...] = ()
        if raw:
            msg["tool_calls"], calls = _tool_calls(raw, f"{param}.tool_calls")
        return msg, ("assistant", content, "", calls)  # type: ignore[return-value]
    tag = name or ""
    if role == "tool":
        call_id = m.get("tool_call_id")
        if call_id is not None and not isinstance(call_id, str):
            raise bad_field(f"{param}.tool_call_id", "expected a string")
        if call_id:
            msg["tool_call_id"] = call_id
            tag = call_id
    return msg, (tpl_role, content, tag, ())  # type: ignore[return-value]


def _number(
    body: Mapping[str, Any], name: str, low: float, high: float, *, integer: bool = False
) -> Any:
    """``body[name]`` checked: absent or null (``None``), else a number (an integer if
    ``integer``) in ``[low, high]``."""
    value = body.get(name)
    if value is None:
        return None
    real = not integer and isinstance(value, float) and math.isfinite(value)
    if isinstance(value, bool) or not (isinstance(value, int) or real):
        raise bad_field(name, f"expected {'an integer' if integer else 'a number'}, got {value!r}")
    if not low <= value <= high:
        raise bad_field(name, f"must be in [{low}, {high}], got {value}")
    return value if integer else float(value)


def _tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad_field("tools", f"expected a list of function tools, got {type(tools).__name__}")
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
        ):
            raise bad_field(
                f"tools[{j}]", 'expected {"type": "function", "function": {"name", ...}}'
            )
        check_function(fn, f"tools[{j}].function")
    return [dict(t) for t in tools]


def check_function(fn: Mapping[str, Any], param: str, schema_key: str = "parameters") -> None:
    """A function tool's ``description``, ``parameters`` (or ``schema_key``'s, required
    then) and ``strict``, checked: the chat template renders them, the model reads them."""
    description = fn.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_field(f"{param}.description", f"expected a string, got {type_name(description)}")
    parameters = fn.get(schema_key)
    if (parameters is not None or schema_key != "parameters") and not isinstance(parameters, dict):
        hint = " (send the object itself, not its JSON text)" if isinstance(parameters, str) else ""
        schema = '{"type": "object", "properties": {...}}'
        raise bad_field(
            f"{param}.{schema_key}",
            f"expected a JSON Schema object such as {schema}, got {type_name(parameters)}{hint}",
        )
    strict = fn.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_field(f"{param}.strict", f"expected true or false, got {type_name(strict)}")


def type_name(value: Any) -> str:
    return "a string" if isinstance(value, str) else type(value).__name__


def parse_chat(body: Any) -> ChatCall:
    """Check a request body; :class:`ChatError` (400) names the first bad field."""
    if not isinstance(body, dict):
        raise ChatError(400, "the request body must be a JSON object", param=None)
    n = body.get("n")
    if n is not None and n != 1:
        raise bad_field("n", f"only n=1 is supported (one choice per call), got {n!r}")
    if body.get("audio") is not None or "audio" in (body.get("modalities") or ()):
        raise bad_field("modalities", "audio output is not supported by this text-only endpoint")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_field("messages", "expected a non-empty list of messages")
    messages: list[Message] = []
    keys: list[Key] = []
    for i, m in enumerate(raw):
        msg, key = _message(i, m)
        messages.append(msg)
        keys.append(key)
    return chat_call(body, messages, keys, _tools(body))


def chat_call(
    body: Mapping[str, Any],
    messages: list[Message],
    keys: list[Key],
    tools: list[dict[str, Any]] | None,
) -> ChatCall:
    """The :class:`ChatCall` of checked messages and the chat-completions fields of
    ``body`` (sampling, tool choice, streaming)."""
    choice = body.get("tool_choice")
    if (
        choice is not None
        and choice not in ("none", "auto", "required")
        and not (isinstance(choice, dict) and isinstance(choice.get("function"), dict))
    ):
        expected = '"none", "auto", "required" or a function'
        raise bad_field("tool_choice", f"expected {expected}, got {choice!r}")
    max_tokens = _number(body, "max_completion_tokens", 1, 1 << 30, integer=True)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", 1, 1 << 30, integer=True)
    stop = body.get("stop")
    stops: tuple[str, ...]
    if stop is None:
        stops = ()
    elif isinstance(stop, str):
        stops = (stop,) if stop else ()
    elif isinstance(stop, list) and all(isinstance(s, str) and s for s in stop):
        stops = tuple(stop)
    else:
        raise bad_field("stop", f"expected a string or a list of non-empty strings, got {stop!r}")
    if len(stops) > _MAX_STOP:
        raise bad_field("stop", f"at most {_MAX_STOP} stop sequences, got {len(stops)}")
    logprobs = body.get("logprobs") or False
    if not isinstance(logprobs, bool):
        raise bad_field("logprobs", f"expected true or false, got {logprobs!r}")
    top = _number(body, "top_logprobs", 0, 20, integer=True) or 0
    if top and not logprobs:
        raise bad_field("top_logprobs", "needs logprobs=true")
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise bad_field("stream", f"expected true or false, got {stream!r}")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise bad_field("stream_options", "expected an object")
    model = body.get("model") or ""
    if not isinstance(model, str):
        raise bad_field("model", f"expected a string, got {model!r}")
    return ChatCall(
        messages=messages,
        keys=keys,
        tools=tools,
        tools_key=json.dumps(tools, sort_keys=True) if tools else "",
        parse_tools=tools is not None and choice != "none",
        model=model,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", 0.0, 2.0),
        top_p=_number(body, "top_p", 1e-9, 1.0),
        stop=stops,
        seed=_number(body, "seed", -(1 << 63), (1 << 63) - 1, integer=True),
        logprobs=logprobs,
        top_logprobs=top,
        stream=stream,
        include_usage=bool(options.get("include_usage")),
    )


# -- answers ---------------------------------------------------------------------------


def _logprobs(call: ChatCall, reply: ChatReply) -> dict[str, Any] | None:
    if not call.logprobs:
        return None
    content = []
    for token, lp in zip(reply.tokens, reply.logprobs, strict=True):
        entry = {"token": token, "logprob": lp, "bytes": list(token.encode())}
        # The generator reports the sampled token's log-prob only: it is the one alternative.
        top = [dict(entry)] if call.top_logprobs else []
        content.append({**entry, "top_logprobs": top})
    return {"content": content, "refusal": None}


def _tool_calls_out(reply: ChatReply) -> list[dict[str, Any]]:
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in reply.tool_calls
    ]


def _usage(reply: ChatReply) -> dict[str, int]:
    n = len(reply.token_ids)
    return {
        "prompt_tokens": reply.prompt_tokens,
        "completion_tokens": n,
        "total_tokens": reply.prompt_tokens + n,
    }


def completion_body(call: ChatCall, reply: ChatReply, cid: str, model: str) -> dict[str, Any]:
    """The ``chat.completion`` object."""
    message: dict[str, Any] = {"role": "assistant", "content": reply.content, "refusal": None}
    if reply.tool_calls:
        message["tool_calls"] = _tool_calls_out(reply)
    return {
        "id": cid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": reply.weight_version,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": _logprobs(call, reply),
                "finish_reason": reply.finish_reason,
            }
        ],
        "usage": _usage(reply),
    }


def stream_chunks(call: ChatCall, reply: ChatReply, cid: str, model: str) -> Iterator[bytes]:
    """The SSE events of a streamed answer, as OpenAI sends them, ending ``[DONE]``."""
    head = {
        "id": cid,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": reply.weight_version,
    }
    extra: dict[str, Any] = {"usage": None} if call.include_usage else {}

    def chunk(delta: dict[str, Any], finish: str | None = None, lp: Any = None) -> bytes:
        choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return sse(json.dumps({**head, "choices": [choice], **extra}, separators=(",", ":")))

    yield chunk({"role": "assistant", "content": "", "refusal": None})
    if reply.content:
        yield chunk({"content": reply.content}, lp=_logprobs(call, reply))
    elif call.logprobs:
        yield chunk({}, lp=_logprobs(call, reply))
    for i, c in enumerate(_tool_calls_out(reply)):
        yield chunk({"tool_calls": [{"index": i, **c}]})
    yield chunk({}, reply.finish_reason)
    if call.include_usage:
        usage = {**head, "choices": [], "usage": _usage(reply)}
        yield sse(json.dumps(usage, separators=(",", ":")))
    yield sse("[DONE]")


def models_body(names: Sequence[str]) -> dict[str, Any]:
    """``GET /v1/models``."""
    return {
        "object": "list",
        "data": [{"id": n, "object": "model", "created": 0, "owned_by": "agentenv"} for n in names],
    }
