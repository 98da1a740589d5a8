"""A small MCP server for tests/agentenv/test_mcp.py, written with the ``mcp`` package's
low-level server API (it can list a tool whose schema agentenv cannot use).

Run over stdio: ``python mcp_server.py``; over streamable HTTP, :func:`app` is its ASGI app.
``MCP_TEST_LOG`` names a file the server appends ``start <pid>`` to when it starts (the
tests count restarts with it).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import anyio
import mcp.types as types
from mcp.server import Server, ServerRequestContext
from mcp.server.stdio import stdio_server

TOOLS = [
    types.Tool(
        name="add",
        description="Add two integers.",
        input_schema={
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    ),
    types.Tool(
        name="crash",
        description="Exit the server process in the middle of the call.",
        input_schema={"type": "object", "properties": {}},
    ),
    types.Tool(
        name="hang",
        description="Never answer.",
        input_schema={"type": "object", "properties": {}},
    ),
    types.Tool(
        name="picture",
        description="Return an image and a caption.",
        input_schema={"type": "object", "properties": {}},
    ),
    types.Tool(
        name="fail",
        description="Report an error.",
        input_schema={"type": "object", "properties": {}},
    ),
    # Not valid JSON Schema: "banana" is no JSON type.
    types.Tool(
        name="fruity",
        description="Takes a banana.",
        input_schema={"type": "object", "properties": {"x": {"type": "banana"}}},
    ),
]


async def list_tools(
    ctx: ServerRequestContext[Any], params: types.PaginatedRequestParams | None
) -> types.ListToolsResult:
    return types.ListToolsResult(tools=TOOLS)


async def call_tool(
    ctx: ServerRequestContext[Any], params: types.CallToolRequestParams
) -> types.CallToolResult:
    args = params.arguments or {}
    text: list[types.ContentBlock]
    if params.name == "add":
        text = [types.TextContent(type="text", text=str(args["a"] + args["b"]))]
    elif params.name == "crash":
        os._exit(3)
    elif params.name == "hang":
        await asyncio.Event().wait()
        raise AssertionError("unreachable")
    elif params.name == "picture":
        text = [
            types.ImageContent(type="image", data="aGVsbG8=", mime_type="image/png"),
            types.TextContent(type="text", text="a cat"),
        ]
    elif params.name == "fail":
        return types.CallToolResult(
            content=[types.TextContent(type="text", text="disk on fire")], is_error=True
        )
    else:
        raise ValueError(f"unknown tool {params.name!r}")
    return types.CallToolResult(content=text)


server = Server("agentenv-test", on_list_tools=list_tools, on_call_tool=call_tool)


def app() -> Any:
    """The server as a streamable-HTTP ASGI app at /mcp."""
    return server.streamable_http_app()


async def main() -> None:
    async with stdio_server() as (read, write):
        await server.run(read, write, server.create_initialization_options())


if __name__ == "__main__":
    log = os.environ.get("MCP_TEST_LOG")
    if log:
        with open(log, "a") as f:
            f.write(f"start {os.getpid()}\n")
    anyio.run(main)
