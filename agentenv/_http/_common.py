"""What the server and the client side of agentenv's HTTP share."""

from __future__ import annotations

import anyio

RECV_BYTES = 65536  # bytes asked of the socket per read
CONNECTION_ERRORS = (
    anyio.EndOfStream,
    anyio.BrokenResourceError,
    anyio.ClosedResourceError,
    OSError,
)
