"""An MCP server with one tool, written with the ``mcp`` package (``MCPServer``, FastMCP's
successor); it speaks MCP over stdio when run: ``python mcp_calculator_server.py``."""

from mcp.server.mcpserver import MCPServer

server = MCPServer("calculator")


@server.tool()
def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


if __name__ == "__main__":
    server.run()
