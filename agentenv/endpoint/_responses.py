"""OpenAI's Responses API (``POST /v1/responses``, the Agents SDK's default) on the same
machinery as chat completions: ``instructions`` and ``input`` items become the
:class:`ChatCall` a chat request would, the reply a ``response`` object or its events.
Stateless only (``previous_response_id`` is refused); an assistant ``message`` item and
the ``function_call`` items after it are one assistant turn."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from typing import Any

from agentenv._http import sse
from agentenv._messages import Message
from agentenv.endpoint._protocol import (
    ChatCall,
    ChatReply,
    Key,
    ToolCallKey,
    append_assistant,
    bad_field,
    chat_call,
    check_function,
    content_text,
    tool_call,
)

__all__ = ["parse_responses", "response_body", "response_events"]

# An assistant turn being assembled: its content and its tool calls.
_Pending = tuple[str, list[tuple[dict[str, Any], ToolCallKey]]]


def _function_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    tools = body.get("tools")
    if not tools:
        return None
    if not isinstance(tools, list):
        raise bad_field("tools", f"expected a list of function tools, got {type(tools).__name__}")
    out = []
    for j, t in enumerate(tools):
        if (
            not isinstance(t, dict)
            or t.get("type") != "function"
            or not isinstance(t.get("name"), str)
        ):
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise bad_field(
                f"tools[{j}]",
                'only function tools ({"type": "function", "name", ...}) are served, '
                f"got {kind!r}",
            )
        check_function(t, f"tools[{j}]")
        function = {k: t[k] for k in ("name", "description", "parameters") if k in t}
        out.append({"type": "function", "function": function})
    return out


def _flush(pending: _Pending | None, messages: list[Message], keys: list[Key]) -> None:
    if pending is not None:
        append_assistant(messages, keys, *pending)


def _items(body: Mapping[str, Any]) -> tuple[list[Message], list[Key]]:
    messages: list[Message] = []
    keys: list[Key] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise bad_field("instructions", "expected a string")
        messages.append({"role": "system", "content": instructions})
        keys.append(("system", instructions, "", ()))
    raw = body.get("input")
    items = [{"role": "user", "content": raw}] if isinstance(raw, str) else raw
    if not isinstance(items, list) or not items:
        raise bad_field("input", "expected a string or a non-empty list of input items")
    pending: _Pending | None = None  # the assistant turn being assembled
    for i, item in enumerate(items):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_field(param, f"expected an input item object, got {type(item).__name__}")
        kind = item.get("type", "message")
        if kind == "message" and item.get("role") == "assistant":
            _flush(pending, messages, keys)
            text = content_text(item.get("content"), f"{param}.content", allow_none=True)
            pending = (text, [])
        elif kind == "function_call":
            name, arguments, call_id = (
                item.get("name"),
                item.get("arguments", ""),
                item.get("call_id"),
            )
            if (
                not isinstance(name, str)
                or not isinstance(arguments, str)
                or not isinstance(call_id, str)
            ):
                raise bad_field(
                    param, 'expected {"type": "function_call", "call_id", "name", "arguments"}'
                )
            if pending is None:
                pending = ("", [])
            pending[1].append(tool_call(call_id, name, arguments))
        elif kind == "function_call_output":
            _flush(pending, messages, keys)
            pending = None
            call_id = item.get("call_id")
            if not isinstance(call_id, str):
                raise bad_field(f"{param}.call_id", "expected a string")
            output = content_text(item.get("output"), f"{param}.output")
            messages.append({"role": "tool", "content": output, "tool_call_id": call_id})
            keys.append(("tool", output, call_id, ()))
        elif kind == "message":
            _flush(pending, messages, keys)
            pending = None
            role = item.get("role")
            if role not in ("system", "developer", "user"):
                raise bad_field(
                    f"{param}.role",
                    f"unknown role {role!r}; expected one of system, developer, user, assistant",
                )
            text = content_text(item.get("content"), f"{param}.content")
            message: Message = {"role": "user" if role == "user" else "system", "content": text}
            messages.append(message)  # a developer message is a system message
            keys.append((message["role"], text, "", ()))
        else:
            raise bad_field(
                f"{param}.type",
                f"{kind!r} items are not supported; send message, function_call and "
                "function_call_output items",
            )
    _flush(pending, messages, keys)
    return messages, keys


def parse_responses(body: Any) -> ChatCall:
    """Check a ``POST /v1/responses`` body; :class:`ChatError` (400) names the bad field."""
    if not isinstance(body, dict):
        raise bad_field("input", "the request body must be a JSON object")
    for name in ("previous_response_id", "conversation"):
        if body.get(name):
            raise bad_field(name, "stored responses are not kept: send the whole input instead")
    messages, keys = _items(body)
    tools = _function_tools(body)
    text = body.get("text") or {}
    if isinstance(text, dict) and (text.get("format") or {}).get("type") not in (None, "text"):
        raise bad_field("text.format", "only plain text output is supported")
    chat: dict[str, Any] = {
        "model": body.get("model"),
        "tool_choice": body.get("tool_choice"),
        "max_completion_tokens": body.get("max_output_tokens"),
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "stream": body.get("stream"),
        "logprobs": bool(body.get("top_logprobs")),
        "top_logprobs": body.get("top_logprobs"),
    }
    if isinstance(chat["tool_choice"], dict) and "name" in chat["tool_choice"]:
        chat["tool_choice"] = {
            "type": "function",
            "function": {"name": chat["tool_choice"]["name"]},
        }
    return chat_call(chat, messages, keys, tools)


def response_body(call: ChatCall, reply: ChatReply, rid: str, model: str) -> dict[str, Any]:
    """The ``response`` object."""
    output: list[dict[str, Any]] = []
    if reply.content:
        part: dict[str, Any] = {"type": "output_text", "text": reply.content, "annotations": []}
        if call.logprobs:
            part["logprobs"] = [
                {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
                for t, lp in zip(reply.tokens, reply.logprobs, strict=True)
            ]
        output.append(
            {
                "type": "message",
                "id": f"msg_{rid}",
                "status": "completed",
                "role": "assistant",
                "content": [part],
            }
        )
    for c in reply.tool_calls:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{c.id}",
                "call_id": c.id,
                "name": c.name,
                "arguments": c.arguments,
                "status": "completed",
            }
        )
    n = len(reply.token_ids)
    incomplete = reply.finish_reason == "length"
    return {
        "id": f"resp_{rid}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "instructions": None,
        "metadata": {},
        "temperature": None,
        "top_p": None,
        "usage": {
            "input_tokens": reply.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": n,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": reply.prompt_tokens + n,
        },
    }


def response_events(call: ChatCall, reply: ChatReply, rid: str, model: str) -> Iterator[bytes]:
    """The streamed form: created, each output item added and done, completed."""
    done = response_body(call, reply, rid, model)
    seq = iter(range(1 << 30))

    def event(kind: str, **data: Any) -> bytes:
        payload = {"type": kind, "sequence_number": next(seq), **data}
        return sse(json.dumps(payload, separators=(",", ":")), event=kind)

    yield event("response.created", response={**done, "status": "in_progress", "output": []})
    for i, item in enumerate(done["output"]):
        opening = {**item, "status": "in_progress"}
        if item["type"] == "message":
            opening["content"] = []
        elif item["type"] == "function_call":
            opening["arguments"] = ""
        yield event("response.output_item.added", output_index=i, item=opening)
        if item["type"] == "message":
            text = item["content"][0]["text"]
            yield event(
                "response.output_text.delta",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                delta=text,
                logprobs=[],
            )
            yield event(
                "response.output_text.done",
                item_id=item["id"],
                output_index=i,
                content_index=0,
                text=text,
                logprobs=[],
            )
        else:
            yield event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=i,
                arguments=item["arguments"],
            )
        yield event("response.output_item.done", output_index=i, item=item)
    yield event("response.completed", response=done)
