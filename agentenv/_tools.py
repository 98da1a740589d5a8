"""Tools: typed Python functions offered to the model, and the parser for its calls.

``@tool`` turns a function into a :class:`Tool` whose OpenAI function schema comes from
its type hints and docstring (Google-style ``Args:``). Calls are parsed from the model's
text by a :class:`ToolCallParser` (Hermes ``<tool_call>`` by default); every failure
becomes a tool message telling the model what went wrong, and the episode continues. A
parameter annotated :class:`~agentenv.Task` or :class:`~agentenv.State` is filled with
the episode's, never the model's. See docs/guide.md ("Tools")."""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import json
import re
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol, get_args, get_type_hints, overload

import anyio
import pydantic

from agentenv._environment import Task
from agentenv._errors import ConfigError, ToolCallError, positive
from agentenv._messages import Message
from agentenv._rewards import State

__all__ = [
    "HermesParser",
    "Tool",
    "ToolCall",
    "ToolCallParser",
    "run_tool_calls",
    "tool",
]

_ARG_LINE = re.compile(r"^\s*(\*{0,2}\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")
# Tool names the chat template and the parser accept.
TOOL_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,63}")
_OTHER_SECTIONS = {"returns", "return", "raises", "yields", "examples", "example", "note", "notes"}


def _parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """Split a docstring into its description and Google-style ``Args:`` entries."""
    if not doc:
        return "", {}
    lines = inspect.cleandoc(doc).splitlines()
    description: list[str] = []
    args: dict[str, str] = {}
    section = "description"
    current: str | None = None
    arg_indent: int | None = None
    for line in lines:
        stripped = line.strip()
        if stripped.lower() in {"args:", "arguments:", "parameters:"}:
            section = "args"
            continue
        if stripped.endswith(":") and stripped[:-1].lower() in _OTHER_SECTIONS:
            section = "other"
            continue
        if section == "description":
            description.append(line)
        elif section == "args":
            indent = len(line) - len(line.lstrip())
            m = _ARG_LINE.match(line)
            if m and (arg_indent is None or indent <= arg_indent):
                arg_indent = indent
                current = m.group(1).lstrip("*")
                args[current] = m.group(2).strip()
            elif current and stripped:
                args[current] = f"{args[current]} {stripped}".strip()
    text = "\n".join(description).strip()
    # A "blank" line may hold indentation that cleandoc keeps; it still ends the paragraph.
    first_paragraph = re.split(r"\n\s*\n", text, maxsplit=1)[0].replace("\n", " ").strip()
    return first_paragraph, args


def _strip_titles(schema: Any) -> Any:
    # Pydantic adds a "title" to every property; the model does not need them.
    if isinstance(schema, dict):
        return {
            k: _strip_titles(v)
            for k, v in schema.items()
            if not (k == "title" and isinstance(v, str))
        }
    if isinstance(schema, list):
        return [_strip_titles(v) for v in schema]
    return schema


# Parameters annotated with one of these types are given the episode's task or state.
_EPISODE_TYPES: tuple[type[Task] | type[State], ...] = (Task, State)


def _episode_type(owner: str, pname: str, hint: Any) -> type[Task] | type[State] | None:
    """The episode type a parameter is annotated with (``None``: the model's argument).

    Raises:
        ConfigError: the type is only part of the hint (``Task | None``): the model would
            be asked for a task, and the episode's would never be given.
    """
    if isinstance(hint, type):
        for kind in _EPISODE_TYPES:
            if issubclass(hint, kind):
                return kind
    stack = list(get_args(hint))
    while stack:
        arg = stack.pop()
        if isinstance(arg, type) and issubclass(arg, _EPISODE_TYPES):
            raise ConfigError(
                f"tool {owner!r}: parameter {pname!r} is annotated {hint!r}; the episode's "
                f"{arg.__name__} is given to a parameter annotated exactly {arg.__name__} "
                f"(write `{pname}: {arg.__name__}`)"
            )
        stack.extend(get_args(arg))
    return None


class _Overrun(Exception):
    """The tool's timeout fired."""


def _on_asyncio() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:  # trio, or no loop
        return False
    return True


class Tool:
    """A function the model may call. Build one with :func:`tool`.

    Calling the tool calls the function (``add(1, 2)``); the original is at :attr:`fn`.
    A model's call goes through :meth:`call`, which returns text: a ``str`` result as it
    is, anything else as JSON (``json.dumps``), or ``str(result)`` when it is not JSON.

    Attributes:
        fn: the decorated function.
        name: the function name the model uses.
        description: from the docstring's first paragraph.
        parameters: the JSON schema of the arguments the model gives.
        episode_parameters: the parameters given the episode's :class:`~agentenv.Task` or
            :class:`~agentenv.State` instead (by the type they are annotated with).
        timeout_s: wall-clock limit per call (``None``: no limit).
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        *,
        name: str | None = None,
        description: str | None = None,
        timeout_s: float | None = 30.0,
    ) -> None:
        if not callable(fn):
            raise ConfigError(f"@tool needs a function, got {type(fn).__name__}")
        if timeout_s is not None:
            positive("tool timeout_s", timeout_s)
        self.fn = fn
        # ``is None``, not ``or``: an explicit empty name is a mistake to report, not ignore.
        self.name = fn.__name__ if name is None else name
        if not TOOL_NAME.fullmatch(self.name):
            raise ConfigError(f"tool name {self.name!r} must be an identifier of at most 64 chars")
        doc_description, arg_docs = _parse_docstring(fn.__doc__)
        self.description = description if description is not None else doc_description
        self.timeout_s = timeout_s
        self.is_async = inspect.iscoroutinefunction(fn)
        try:
            hints = get_type_hints(fn)
        except (NameError, TypeError) as e:
            raise ConfigError(
                f"tool {self.name!r}: its type hints cannot be resolved ({e}); define the "
                "types they name at module level"
            ) from None
        fields: dict[str, Any] = {}
        self.episode_parameters: dict[str, type[Task] | type[State]] = {}
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise ConfigError(f"tool {self.name!r}: *args/**kwargs cannot be described")
            if pname not in hints:
                raise ConfigError(
                    f"tool {self.name!r}: parameter {pname!r} needs a type hint "
                    "(the JSON schema is generated from it)"
                )
            kind = _episode_type(self.name, pname, hints[pname])
            if kind is not None:  # the episode's, never in the schema the model sees
                self.episode_parameters[pname] = kind
                continue
            default = ... if param.default is param.empty else param.default
            # Internal field names with the parameter name as alias: a parameter called
            # ``schema``, ``json``, ``model_config`` or ``_x`` is fine for a function but
            # clashes with pydantic's BaseModel attributes (a warning, or an error) when
            # used as a field name. Schema, validation and error locations use the alias.
            fields[f"p{len(fields)}"] = (
                hints[pname],
                pydantic.Field(default, alias=pname, description=arg_docs.get(pname) or None),
            )
        self._model: type[pydantic.BaseModel] = pydantic.create_model(
            f"{self.name}_arguments",
            __config__=pydantic.ConfigDict(extra="forbid"),
            **fields,
        )
        self.parameters: dict[str, Any] = _strip_titles(self._model.model_json_schema())
        self.parameters.setdefault("properties", {})

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling schema."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }

    def validate(self, arguments: Any) -> dict[str, Any]:
        """Check ``arguments`` against the schema; raise :class:`ToolCallError` naming the field."""
        if not isinstance(arguments, Mapping):
            raise ToolCallError(
                f"arguments for {self.name!r} must be a JSON object, got {type(arguments).__name__}"
            )
        return self._checked(dict(arguments))

    def _checked(self, arguments: dict[str, Any]) -> dict[str, Any]:
        try:
            parsed = self._model.model_validate(arguments)
        except pydantic.ValidationError as e:
            raise self._invalid((err["loc"], err["msg"]) for err in e.errors()) from None
        return {f.alias or k: getattr(parsed, k) for k, f in type(parsed).model_fields.items()}

    def _invalid(self, problems: Iterable[tuple[Iterable[Any], str]]) -> ToolCallError:
        """The error naming each problem's path in the arguments and what is wrong there."""
        text = "; ".join(f"{'.'.join(map(str, at)) or '(arguments)'}: {m}" for at, m in problems)
        return ToolCallError(f"invalid arguments for {self.name!r}: {text}")

    async def call(self, arguments: Any, state: State | None = None) -> str:
        """Validate, run (sync tools in a worker thread) under the timeout, and return text.

        ``state``: the episode's; its task and itself fill the :attr:`episode_parameters`
        (an argument of that name from the model was refused by the validation).
        """
        kwargs = self.validate(arguments)
        kwargs.update(self._episode_arguments(state))
        try:
            result = await self._run(kwargs)
        except _Overrun:
            raise ToolCallError(f"tool {self.name!r} timed out after {self.timeout_s} s") from None
        except ToolCallError:
            raise
        except Exception as e:
            raise ToolCallError(f"tool {self.name!r} raised {type(e).__name__}: {e}") from e
        if isinstance(result, str):
            return result
        try:
            return json.dumps(result, ensure_ascii=False)
        except (TypeError, ValueError):
            return str(result)

    def _episode_arguments(self, state: State | None) -> dict[str, Any]:
        if not self.episode_parameters:
            return {}
        if state is None:
            raise ConfigError(
                f"tool {self.name!r} takes the episode's task or state (parameters "
                f"{sorted(self.episode_parameters)}), but was called without one: call it "
                "through ToolEnv, or pass run_tool_calls(calls, tools, state=state)"
            )
        return {
            pname: state if kind is State else state.task
            for pname, kind in self.episode_parameters.items()
        }

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call the decorated function itself, as if undecorated (for tests and reuse):
        ``add(1, 2) == 3`` for a sync tool, ``await add(1, 2)`` for an async one. What the
        model's calls go through -- validation, the timeout, the result as text -- is
        :meth:`call`."""
        return self.fn(*args, **kwargs)

    async def _run(self, kwargs: dict[str, Any]) -> Any:
        # Raises _Overrun when the timeout fires; a TimeoutError the tool raises itself
        # propagates as an ordinary exception.
        if self.timeout_s is None:
            return await self._invoke(kwargs)
        if self.is_async and _on_asyncio():
            # asyncio's own timeout costs half an anyio cancel scope, and async tools run
            # on most turns of a tool-use episode.
            try:
                async with asyncio.timeout(self.timeout_s) as deadline:
                    return await self.fn(**kwargs)
            except TimeoutError:
                if deadline.expired():
                    raise _Overrun from None
                raise
        with anyio.move_on_after(self.timeout_s):
            return await self._invoke(kwargs)
        raise _Overrun

    async def _invoke(self, kwargs: dict[str, Any]) -> Any:
        if self.is_async:
            return await self.fn(**kwargs)
        # Blocking tools must not stall every other episode on the loop.
        return await anyio.to_thread.run_sync(lambda: self.fn(**kwargs), abandon_on_cancel=True)

    def __repr__(self) -> str:
        return f"Tool({self.name!r})"


@overload
def tool(fn: Callable[..., Any], /) -> Tool: ...
@overload
def tool(
    *, name: str | None = None, description: str | None = None, timeout_s: float | None = 30.0
) -> Callable[[Callable[..., Any]], Tool]: ...


def tool(
    fn: Callable[..., Any] | None = None,
    /,
    *,
    name: str | None = None,
    description: str | None = None,
    timeout_s: float | None = 30.0,
) -> Tool | Callable[[Callable[..., Any]], Tool]:
    """Make ``fn`` a :class:`Tool`: bare (``@tool``) or with options (``@tool(timeout_s=5)``)."""
    if fn is not None:
        return Tool(fn, name=name, description=description, timeout_s=timeout_s)
    return lambda f: Tool(f, name=name, description=description, timeout_s=timeout_s)


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCall:
    """A parsed call: the tool's name and its JSON arguments."""

    name: str
    arguments: Any
    id: str = ""


class ToolCallParser(Protocol):
    """Finds tool calls in an assistant message."""

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        """Every call in ``text``, in order; unparseable calls as :class:`ToolCallError`."""
        ...


class HermesParser:
    """Parses ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Hermes, Qwen)."""

    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall | ToolCallError]:
        out: list[ToolCall | ToolCallError] = []
        if "<tool_call>" not in text:
            return out
        for i, m in enumerate(self._BLOCK.finditer(text)):
            body = m.group(1).strip()
            try:
                data = json.loads(body)
            except json.JSONDecodeError as e:
                out.append(
                    ToolCallError(f"tool call {i} is not valid JSON ({e.msg}): {body[:200]!r}")
                )
                continue
            if not isinstance(data, dict) or not isinstance(data.get("name"), str):
                out.append(
                    ToolCallError(
                        f'tool call {i} must be {{"name": <string>, "arguments": {{...}}}}, '
                        f"got {body[:200]!r}"
                    )
                )
                continue
            arguments = data.get("arguments", data.get("parameters", {}))
            if isinstance(arguments, str):  # some models double-encode the arguments
                try:
                    arguments = json.loads(arguments)
                except json.JSONDecodeError:
                    out.append(ToolCallError(f"tool call {i} arguments are not valid JSON"))
                    continue
            out.append(ToolCall(data["name"], arguments, id=f"call_{i}"))
        return out


async def run_tool_calls(
    calls: Sequence[ToolCall | ToolCallError],
    tools: Mapping[str, Tool] | Sequence[Tool],
    *,
    on_result: (
        Callable[[ToolCall | ToolCallError, str, bool], Awaitable[None] | None] | None
    ) = None,
    state: State | None = None,
) -> list[Message]:
    """Run ``calls`` in order and return one tool message per call; every error is a tool
    message starting with ``Error:``. ``on_result(call, text, ok)`` is told each outcome;
    ``state`` is the episode's, for tools with parameters annotated ``Task`` or ``State``.

    Raises:
        ConfigError: a tool that takes the episode's task or state was called without
            ``state``.
    """
    by_name = tools if isinstance(tools, Mapping) else {t.name: t for t in tools}
    messages: list[Message] = []
    for call in calls:
        name = call.name if isinstance(call, ToolCall) else "error"
        ok = False
        if isinstance(call, ToolCallError):
            text = f"Error: {call}"
        elif call.name not in by_name:
            text = f"Error: unknown tool {call.name!r}; available tools: {sorted(by_name)}"
        else:
            try:
                text = await by_name[call.name].call(call.arguments, state)
                ok = True
            except ToolCallError as e:
                text = f"Error: {e}"
        msg: Message = {"role": "tool", "content": text, "name": name}
        if isinstance(call, ToolCall) and call.id:
            msg["tool_call_id"] = call.id
        messages.append(msg)
        if on_result is not None:
            maybe = on_result(call, text, ok)
            if inspect.isawaitable(maybe):
                await maybe
    return messages
