"""Tools: schemas from hints and docstrings, validation, running (threads, timeouts), parsing."""

from __future__ import annotations

import threading
from typing import Any, Literal, Optional, cast

import anyio
import anyio.lowlevel
import pydantic
import pytest

from agentenv import (
    ConfigError,
    HermesParser,
    State,
    Task,
    Tool,
    ToolCall,
    ToolCallError,
    run_tool_calls,
    tool,
)


class Point(pydantic.BaseModel):
    """A point on the plane."""

    x: int
    y: int = 0


# -- schema ------------------------------------------------------------------------------


@tool
def plot(
    points: list[Point],
    ids: list[int],
    color: Literal["red", "blue"] = "red",
    label: Optional[str] = None,  # noqa: UP045 - Optional is what this test is about
    width: float | None = None,
) -> str:
    """Plot points on a chart.

    This second paragraph is for humans reading the code,
    not for the model.

    Args:
        points: the points
            to draw, in order.
        ids (list[int]): one id per point.
        color: line colour.
        label: a legend entry.

    Returns:
        A confirmation.
    """
    return f"plotted {len(points)} {color} points"


def test_openai_function_format() -> None:
    schema = plot.schema
    assert set(schema) == {"type", "function"}
    assert schema["type"] == "function"
    assert set(schema["function"]) == {"name", "description", "parameters"}
    assert schema["function"]["name"] == "plot"
    assert schema["function"]["parameters"] is plot.parameters


def test_description_is_the_first_paragraph() -> None:
    assert plot.description == "Plot points on a chart."
    assert plot.schema["function"]["description"] == "Plot points on a chart."


def test_multi_line_first_paragraph_is_joined() -> None:
    @tool
    def f(x: int) -> int:
        """Add one to a number
        and return it.

        Details.
        """
        return x + 1

    assert f.description == "Add one to a number and return it."


def test_paragraph_break_with_indented_blank_line() -> None:
    def f(x: int) -> int:
        return x

    # The blank line keeps more indentation than the margin, so cleandoc leaves spaces on it.
    f.__doc__ = "Summary.\n        \n    Details that are not part of the description.\n"
    assert tool(f).description == "Summary."


def test_argument_descriptions_from_google_docstring() -> None:
    props = plot.parameters["properties"]
    assert props["points"]["description"] == "the points to draw, in order."  # continuation
    assert props["ids"]["description"] == "one id per point."  # "(type)" stripped
    assert props["color"]["description"] == "line colour."
    assert props["label"]["description"] == "a legend entry."
    assert "description" not in props["width"]  # not documented


def test_returns_section_is_not_an_argument() -> None:
    assert set(plot.parameters["properties"]) == {"points", "ids", "color", "label", "width"}
    assert "A confirmation" not in str(plot.parameters)


def test_required_vs_defaults() -> None:
    params = plot.parameters
    assert params["type"] == "object"
    assert params["required"] == ["points", "ids"]
    assert params["additionalProperties"] is False
    assert params["properties"]["color"]["default"] == "red"
    assert params["properties"]["label"]["default"] is None


def test_type_schemas() -> None:
    props = plot.parameters["properties"]
    assert props["ids"]["type"] == "array"
    assert props["ids"]["items"] == {"type": "integer"}
    assert props["color"]["enum"] == ["red", "blue"]
    assert props["color"]["type"] == "string"
    assert props["label"]["anyOf"] == [{"type": "string"}, {"type": "null"}]
    assert props["width"]["anyOf"] == [{"type": "number"}, {"type": "null"}]


def test_nested_pydantic_model_schema() -> None:
    params = plot.parameters
    assert params["properties"]["points"]["items"] == {"$ref": "#/$defs/Point"}
    point = params["$defs"]["Point"]
    assert point["type"] == "object"
    assert point["properties"] == {"x": {"type": "integer"}, "y": {"type": "integer", "default": 0}}
    assert point["required"] == ["x"]
    assert point["description"] == "A point on the plane."


def test_titles_are_stripped_but_a_parameter_named_title_is_kept() -> None:
    @tool
    def create_issue(title: str, body: str = "") -> str:
        """Open an issue."""
        return title

    params = create_issue.parameters
    assert "title" not in params
    assert params["properties"] == {
        "title": {"type": "string"},
        "body": {"type": "string", "default": ""},
    }
    assert params["required"] == ["title"]


def test_tool_without_parameters() -> None:
    @tool
    def now() -> str:
        return "noon"

    assert now.parameters == {"additionalProperties": False, "properties": {}, "type": "object"}
    assert now.description == ""


@pytest.mark.anyio
@pytest.mark.parametrize(
    "pname", ["schema", "json", "copy", "validate", "model_config", "_private"]
)
async def test_parameter_names_that_clash_with_pydantic(pname: str) -> None:
    # These are ordinary Python parameter names but BaseModel attributes (or, for a
    # leading underscore, private attributes) in pydantic.
    ns: dict[str, Any] = {}
    exec(f"def lookup({pname}: int) -> int:\n    return {pname} * 2\n", ns)
    t = tool(ns["lookup"])
    assert t.parameters["properties"] == {pname: {"type": "integer"}}
    assert t.parameters["required"] == [pname]
    assert await t.call({pname: 21}) == "42"
    with pytest.raises(ToolCallError, match=f"{pname}: Input should be a valid integer"):
        t.validate({pname: "x"})


# -- options and bad definitions ------------------------------------------------------------


def test_tool_with_options() -> None:
    @tool(timeout_s=1, name="web.search", description="Search the web.")
    def search(query: str) -> str:
        """Ignored docstring."""
        return query

    assert isinstance(search, Tool)
    assert search.name == "web.search"
    assert search.timeout_s == 1
    assert search.description == "Search the web."
    assert search.schema["function"]["name"] == "web.search"
    assert repr(search) == "Tool('web.search')"


def test_default_timeout_and_no_timeout() -> None:
    assert plot.timeout_s == 30.0

    @tool(timeout_s=None)
    def slow(x: int) -> int:
        return x

    assert slow.timeout_s is None


def test_missing_type_hint_is_a_config_error() -> None:
    def f(x: int, y) -> int:  # type: ignore[no-untyped-def]
        return x

    with pytest.raises(ConfigError, match="parameter 'y' needs a type hint"):
        tool(f)


def test_var_args_are_a_config_error() -> None:
    def f(*args: int) -> int:
        return sum(args)

    def g(**kwargs: int) -> int:
        return len(kwargs)

    with pytest.raises(ConfigError, match=r"\*args/\*\*kwargs"):
        tool(f)
    with pytest.raises(ConfigError, match=r"\*args/\*\*kwargs"):
        tool(g)


def test_unresolvable_type_hint_is_a_config_error() -> None:
    class Local(pydantic.BaseModel):
        a: int

    def f(x: Local) -> int:  # a string annotation (future import) naming a local class
        return x.a

    with pytest.raises(ConfigError, match="type hints cannot be resolved"):
        tool(f)


@pytest.mark.parametrize("name", ["has space", "1starts_with_digit", "", "x" * 65, "semi;colon"])
def test_bad_name_is_a_config_error(name: str) -> None:
    def f(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match="tool name"):
        tool(name=name)(f)


@pytest.mark.parametrize("timeout", [0, -1, float("inf"), float("nan")])
def test_bad_timeout_is_a_config_error(timeout: float) -> None:
    def f(x: int) -> int:
        return x

    with pytest.raises(ConfigError, match="timeout_s must be a positive number"):
        tool(timeout_s=timeout)(f)


def test_non_callable_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="needs a function, got int"):
        Tool(3)  # type: ignore[arg-type]


# -- validation ---------------------------------------------------------------------------------


def test_validate_returns_kwargs_with_defaults_and_models() -> None:
    kwargs = plot.validate({"points": [{"x": 1}], "ids": [7]})
    assert kwargs == {
        "points": [Point(x=1, y=0)],
        "ids": [7],
        "color": "red",
        "label": None,
        "width": None,
    }


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"ids": [1]}, "points: Field required"),
        ({"points": [], "ids": ["a"]}, "ids.0: Input should be a valid integer"),
        ({"points": [{"x": "a"}], "ids": []}, "points.0.x: Input should be a valid integer"),
        ({"points": [], "ids": [], "color": "green"}, "color: Input should be 'red' or 'blue'"),
        ({"points": [], "ids": [], "extra": 1}, "extra: Extra inputs are not permitted"),
    ],
)
def test_validation_errors_name_the_field(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(ToolCallError, match=r"invalid arguments for 'plot': .*" + message):
        plot.validate(arguments)


@pytest.mark.parametrize("arguments", [[1, 2], "points", None, 3])
def test_arguments_must_be_an_object(arguments: Any) -> None:
    with pytest.raises(ToolCallError, match="must be a JSON object"):
        plot.validate(arguments)


# -- running ---------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_async_tool_runs() -> None:
    @tool
    async def add(a: int, b: int = 2) -> int:
        await anyio.lowlevel.checkpoint()
        return a + b

    assert await add.call({"a": 1}) == "3"
    assert add.is_async


@pytest.mark.anyio
async def test_calling_a_tool_calls_the_function() -> None:
    @tool
    def mul(a: int, b: int) -> int:
        return a * b

    @tool
    async def add(a: int, b: int = 2) -> int:
        return a + b

    assert mul(2, 3) == 6 and mul(a=2, b=4) == 8
    assert await add(1, b=5) == 6
    assert mul.fn(2, 5) == 10


@pytest.mark.anyio
async def test_sync_tool_runs_in_a_worker_thread() -> None:
    seen: list[int] = []

    @tool
    def where() -> str:
        seen.append(threading.get_ident())
        return "here"

    assert not where.is_async
    assert await where.call({}) == "here"
    assert seen
    assert seen[0] != threading.get_ident()


@pytest.mark.anyio
async def test_sync_tool_does_not_block_the_loop() -> None:
    started, released = threading.Event(), threading.Event()

    @tool
    def nap() -> str:
        started.set()
        # Only a task on the event loop releases it: a tool that blocked the loop waits out
        # the bound and says so.
        return "rested" if released.wait(60) else "the loop was blocked"

    async def release() -> None:
        await anyio.to_thread.run_sync(started.wait, abandon_on_cancel=True)
        released.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(release)
        assert await nap.call({}) == "rested"


@pytest.mark.anyio
async def test_results_are_json_encoded_unless_strings() -> None:
    @tool
    def info(kind: str) -> Any:
        return {"str": "plain", "dict": {"a": [1, None], "é": True}, "none": None, "set": {1}}[kind]

    assert await info.call({"kind": "str"}) == "plain"
    assert await info.call({"kind": "dict"}) == '{"a": [1, null], "é": true}'
    assert await info.call({"kind": "none"}) == "null"
    assert await info.call({"kind": "set"}) == "{1}"  # not JSON: str() of it


@pytest.mark.anyio
async def test_async_tool_timeout() -> None:
    @tool(timeout_s=0.1)
    async def hang() -> str:
        await anyio.sleep(10)
        return "never"

    [msg] = await run_tool_calls([ToolCall("hang", {})], [hang])  # not after its 10 s
    assert msg["content"] == "Error: tool 'hang' timed out after 0.1 s"


@pytest.mark.anyio
async def test_sync_tool_timeout_does_not_wait_for_the_thread() -> None:
    release, finished = threading.Event(), threading.Event()

    @tool(timeout_s=0.1)
    def stuck() -> str:
        release.wait(60)
        finished.set()
        return "late"

    try:
        [msg] = await run_tool_calls([ToolCall("stuck", {})], [stuck])
        assert not finished.is_set()  # the answer came while the thread was still stuck
    finally:
        release.set()  # let the abandoned worker thread finish
    assert msg["content"].startswith("Error: ")
    assert "timed out" in msg["content"]


@pytest.mark.anyio
async def test_tool_raising_timeout_error_itself_is_not_reported_as_our_timeout() -> None:
    @tool(timeout_s=5)
    def connect(host: str) -> str:
        raise TimeoutError(f"connect to {host} timed out")

    [msg] = await run_tool_calls([ToolCall("connect", {"host": "db"})], [connect])
    assert msg["content"] == "Error: tool 'connect' raised TimeoutError: connect to db timed out"


@pytest.mark.anyio
@pytest.mark.parametrize("is_async", [False, True])
async def test_tool_that_raises(is_async: bool) -> None:
    def boom(x: int) -> int:
        raise ValueError(f"x={x} is too big")

    async def aboom(x: int) -> int:
        raise ValueError(f"x={x} is too big")

    t = tool(name="x")(aboom if is_async else boom)
    with pytest.raises(ToolCallError, match="tool 'x' raised ValueError: x=3 is too big") as info:
        await t.call({"x": 3})
    assert isinstance(info.value.__cause__, ValueError)
    [msg] = await run_tool_calls([ToolCall("x", {"x": 3})], [t])
    assert msg["content"] == "Error: tool 'x' raised ValueError: x=3 is too big"


@pytest.mark.anyio
async def test_invalid_arguments_are_not_run() -> None:
    calls: list[int] = []

    @tool
    def record(x: int) -> str:
        calls.append(x)
        return "ok"

    [msg] = await run_tool_calls([ToolCall("record", {"x": "nope"})], [record])
    assert msg["content"].startswith("Error: invalid arguments for 'record': x: ")
    assert calls == []


# -- HermesParser ----------------------------------------------------------------------


def parse(text: str) -> list[ToolCall | ToolCallError]:
    return HermesParser().parse(text)


def test_parse_one_call() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    assert parse(text) == [ToolCall("add", {"a": 1}, id="call_0")]


def test_parse_several_calls_in_order() -> None:
    text = (
        '<tool_call>{"name": "a", "arguments": {}}</tool_call> and '
        '<tool_call>{"name": "b", "arguments": {"x": [1]}}</tool_call>\n'
        '<tool_call>{"name": "c", "arguments": {"s": "</tool"}}</tool_call>'
    )
    assert parse(text) == [
        ToolCall("a", {}, id="call_0"),
        ToolCall("b", {"x": [1]}, id="call_1"),
        ToolCall("c", {"s": "</tool"}, id="call_2"),
    ]


@pytest.mark.parametrize("text", ["", "The answer is 4.", "tool_call: add(1, 2)", "</tool_call>"])
def test_parse_text_without_calls(text: str) -> None:
    assert parse(text) == []


def test_parse_garbage_json() -> None:
    [err] = parse("<tool_call>{name: add, arguments: {}}</tool_call>")
    assert isinstance(err, ToolCallError)
    assert "tool call 0 is not valid JSON" in str(err)
    assert "{name: add" in str(err)  # the model sees what it wrote


def test_parse_error_does_not_hide_the_other_calls() -> None:
    text = '<tool_call>oops</tool_call><tool_call>{"name": "ok", "arguments": {}}</tool_call>'
    err, call = parse(text)
    assert isinstance(err, ToolCallError)
    assert call == ToolCall("ok", {}, id="call_1")


@pytest.mark.parametrize(
    "body", ['{"arguments": {"a": 1}}', '{"name": 3, "arguments": {}}', "[1, 2]", '"add"']
)
def test_parse_missing_or_bad_name(body: str) -> None:
    [err] = parse(f"<tool_call>{body}</tool_call>")
    assert isinstance(err, ToolCallError)
    assert 'must be {"name": <string>, "arguments": {...}}' in str(err)


def test_parse_arguments_as_json_encoded_string() -> None:
    text = '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>'
    assert parse(text) == [ToolCall("add", {"a": 1, "b": 2}, id="call_0")]


def test_parse_arguments_as_bad_json_string() -> None:
    [err] = parse('<tool_call>{"name": "add", "arguments": "{a: 1"}</tool_call>')
    assert isinstance(err, ToolCallError)
    assert "arguments are not valid JSON" in str(err)


def test_parse_parameters_key_and_missing_arguments() -> None:
    text = (
        '<tool_call>{"name": "a", "parameters": {"x": 1}}</tool_call>'
        '<tool_call>{"name": "b"}</tool_call>'
    )
    assert parse(text) == [ToolCall("a", {"x": 1}, id="call_0"), ToolCall("b", {}, id="call_1")]


def test_parse_unclosed_call_at_the_end() -> None:
    # Engines often stop on "</tool_call>" and leave it out of the output.
    text = 'Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n'
    assert parse(text) == [ToolCall("add", {"a": 1}, id="call_0")]


def test_parse_unclosed_truncated_call_is_an_error() -> None:
    [err] = parse('<tool_call>{"name": "add", "argum')
    assert isinstance(err, ToolCallError)
    assert "not valid JSON" in str(err)


# -- run_tool_calls --------------------------------------------------------------------


@tool
async def echo(text: str) -> str:
    """Repeat the text."""
    return text


@tool
def double(x: int) -> int:
    """Double a number."""
    return 2 * x


@pytest.mark.anyio
async def test_run_tool_calls_keeps_order_and_sets_name_and_id() -> None:
    calls: list[ToolCall | ToolCallError] = [
        ToolCall("double", {"x": 2}, id="c1"),
        ToolCall("echo", {"text": "hi"}, id="c2"),
        ToolCall("double", {"x": 5}),
    ]
    msgs = await run_tool_calls(calls, [echo, double])
    assert msgs == [
        {"role": "tool", "content": "4", "name": "double", "tool_call_id": "c1"},
        {"role": "tool", "content": "hi", "name": "echo", "tool_call_id": "c2"},
        {"role": "tool", "content": "10", "name": "double"},  # no id: none given
    ]


@pytest.mark.anyio
async def test_run_tool_calls_accepts_a_mapping() -> None:
    msgs = await run_tool_calls([ToolCall("twice", {"x": 4})], {"twice": double})
    assert msgs[0]["content"] == "8"
    assert msgs[0]["name"] == "twice"


@pytest.mark.anyio
async def test_unknown_tool_names_the_available_ones() -> None:
    [msg] = await run_tool_calls([ToolCall("search", {}, id="c")], [echo, double])
    assert msg == {
        "role": "tool",
        "content": "Error: unknown tool 'search'; available tools: ['double', 'echo']",
        "name": "search",
        "tool_call_id": "c",
    }


@pytest.mark.anyio
async def test_parse_errors_become_tool_messages() -> None:
    [msg] = await run_tool_calls([ToolCallError("tool call 0 is not valid JSON")], [echo])
    assert msg == {
        "role": "tool",
        "content": "Error: tool call 0 is not valid JSON",
        "name": "error",
    }


@pytest.mark.anyio
@pytest.mark.parametrize("is_async", [False, True])
async def test_on_result_reports_each_outcome(is_async: bool) -> None:
    seen: list[tuple[Any, str, bool]] = []

    def sync_cb(call: ToolCall | ToolCallError, text: str, ok: bool) -> None:
        seen.append((call, text, ok))

    async def async_cb(call: ToolCall | ToolCallError, text: str, ok: bool) -> None:
        await anyio.lowlevel.checkpoint()
        seen.append((call, text, ok))

    bad_json = ToolCallError("tool call 1 is not valid JSON")
    calls: list[ToolCall | ToolCallError] = [
        ToolCall("echo", {"text": "a"}),
        bad_json,
        ToolCall("nope", {}),
        ToolCall("double", {"x": "b"}),
        ToolCall("double", {"x": 1}),
    ]
    msgs = await run_tool_calls(calls, [echo, double], on_result=async_cb if is_async else sync_cb)
    assert [ok for _, _, ok in seen] == [True, False, False, False, True]
    assert [call for call, _, _ in seen] == calls
    assert [text for _, text, _ in seen] == [m["content"] for m in msgs]


@pytest.mark.anyio
async def test_parser_to_messages_end_to_end() -> None:
    text = (
        'I will double it.<tool_call>{"name": "double", "arguments": "{\\"x\\": 21}"}</tool_call>'
        "<tool_call>{broken</tool_call>"
        '<tool_call>{"name": "echo", "arguments": {"txt": "hi"}}'
    )
    msgs = await run_tool_calls(HermesParser().parse(text), [echo, double])
    assert msgs[0]["content"] == "42"
    assert msgs[0]["tool_call_id"] == "call_0"
    assert msgs[1]["content"].startswith("Error: tool call 1 is not valid JSON")
    assert msgs[2]["content"].startswith("Error: invalid arguments for 'echo': ")
    assert "text: Field required" in msgs[2]["content"]
    assert "txt: Extra inputs are not permitted" in msgs[2]["content"]


# -- the episode's task and state --------------------------------------------------------


@tool
def grade(code: str, task: Task, state: State) -> str:
    """Run the task's tests against code and count the runs in this episode.

    Args:
        code: the candidate solution.
    """
    runs = int(state.info.get("runs", 0)) + 1
    state.info["runs"] = runs
    return f"{code} vs {task.info['tests']} (run {runs} of {task.id})"


def episode_state(task: Task) -> State:
    # A tool reads only the task and the info of the state; the rest is not needed here.
    return State(task, transcript=cast(Any, None), episode=cast(Any, None))


def test_episode_parameters_are_not_in_the_schema() -> None:
    assert grade.episode_parameters == {"task": Task, "state": State}
    assert grade.parameters == {
        "type": "object",
        "properties": {"code": {"type": "string", "description": "the candidate solution."}},
        "required": ["code"],
        "additionalProperties": False,
    }


@pytest.mark.anyio
async def test_tools_get_the_episode_task_and_state() -> None:
    state = episode_state(Task(id="t1", info={"tests": "assert f() == 1"}))
    calls = [ToolCall("grade", {"code": "f"}), ToolCall("grade", {"code": "g"})]
    msgs = await run_tool_calls(calls, [grade], state=state)
    assert [m["content"] for m in msgs] == [
        "f vs assert f() == 1 (run 1 of t1)",
        "g vs assert f() == 1 (run 2 of t1)",
    ]
    assert state.info == {"runs": 2}


@pytest.mark.anyio
@pytest.mark.parametrize("name", ["task", "state"])
async def test_the_model_cannot_give_the_episode_arguments(name: str) -> None:
    state = episode_state(Task(id="t1", info={"tests": "real"}))
    forged = {"code": "f", name: {"id": "forged", "info": {"tests": "none"}}}
    [msg] = await run_tool_calls([ToolCall("grade", forged)], [grade], state=state)
    assert msg["content"].startswith("Error: invalid arguments for 'grade': ")
    assert f"{name}: Extra inputs are not permitted" in msg["content"]
    assert state.info == {}  # refused before the tool ran


@pytest.mark.anyio
async def test_an_episode_tool_called_without_the_state_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"run_tool_calls\(calls, tools, state=state\)"):
        await run_tool_calls([ToolCall("grade", {"code": "f"})], [grade])


def test_an_episode_type_inside_a_union_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="write `task: Task`"):

        @tool
        def peek(task: Task | None = None) -> str:
            """Look at the task."""
            return ""
