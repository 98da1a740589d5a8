"""SGLang: the client for its native HTTP API, and the launcher of its server and router.

The same client talks to ``agentenv serve`` (the embedded engine behind SGLang's API).
"""

from agentenv.sglang._client import SGLangClient, SGLangError, StreamChunk, parse_completion
from agentenv.sglang._launcher import Launcher, router_command, server_command, split_passthrough

__all__ = [
    "Launcher",
    "SGLangClient",
    "SGLangError",
    "StreamChunk",
    "parse_completion",
    "router_command",
    "server_command",
    "split_passthrough",
]
