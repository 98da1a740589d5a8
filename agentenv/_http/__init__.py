"""The implementation of :mod:`agentenv.http`, where its public names and the rules its
server keeps are documented; agentenv's own services import it from here, with the pieces
they share beside the public names (SGLang's API-key check, the body and descriptor limits,
httpx's API over aiohttp's pool)."""

from typing import TYPE_CHECKING, Any

from agentenv._http._api import (
    MAX_JSON_DEPTH,
    ErrorShape,
    Guard,
    Handler,
    HTTPError,
    Request,
    Response,
    Router,
    StreamingResponse,
    decode_json,
    sse,
)
from agentenv._http._auth import api_key_guard, check_api_key, warn_if_open
from agentenv._http._limits import MAX_BODY_BYTES, ClientLimit, raise_open_file_limit
from agentenv._http._transport import AiohttpTransport

if TYPE_CHECKING:
    from agentenv._http._server import HTTPServer

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "AiohttpTransport",
    "ClientLimit",
    "ErrorShape",
    "Guard",
    "HTTPError",
    "HTTPServer",
    "Handler",
    "Request",
    "Response",
    "Router",
    "StreamingResponse",
    "api_key_guard",
    "check_api_key",
    "decode_json",
    "raise_open_file_limit",
    "sse",
    "warn_if_open",
]


def __getattr__(name: str) -> Any:
    # The server loads aiohttp (~0.1 s) on first use: clients never pay for it.
    if name == "HTTPServer":
        from agentenv._http._server import HTTPServer

        return HTTPServer
    raise AttributeError(f"module 'agentenv._http' has no attribute {name!r}")
