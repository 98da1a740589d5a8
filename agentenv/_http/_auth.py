"""API keys: SGLang's ``--api-key`` check, as an :class:`~agentenv.http.HTTPServer` guard.

A request carries the key as ``Authorization: Bearer <key>`` (the scheme in any case), or
as ``X-API-Key: <key>``, exactly as SGLang's server accepts it; keys are compared in
constant time. Paths that ``exempt`` accepts (health probes, for SGLang ``/health*``) and
``OPTIONS`` requests pass without a key; anything else without the key is answered 401
before its body is read.
"""

from __future__ import annotations

import hmac
import ipaddress
import logging
from collections.abc import Callable, Mapping

from agentenv._errors import ConfigError
from agentenv._http._api import Guard, HTTPError

__all__ = ["api_key_guard", "check_api_key", "is_loopback", "warn_if_open"]

log = logging.getLogger("agentenv.http")


def check_api_key(key: str) -> str:
    """``key`` if it can travel in a header; :class:`ConfigError` otherwise."""
    if not key or key != key.strip() or not key.isprintable():
        raise ConfigError(
            "an API key must be a non-empty string of printable characters without "
            "surrounding spaces; pick one such as `openssl rand -hex 32`"
        )
    return key


def api_key_guard(
    key: str, *, exempt: Callable[[str], bool] = lambda path: False, hint: str = "--api-key"
) -> Guard:
    """A guard that refuses (401) every request but ``exempt`` paths without ``key``.
    ``hint`` says in the refusal where the key was set."""
    expected = check_api_key(key).encode()

    def guard(method: str, path: str, headers: Mapping[str, str]) -> None:
        if method == "OPTIONS" or exempt(path):
            return
        scheme, _, token = headers.get("authorization", "").partition(" ")
        keys = [token] if scheme.lower() == "bearer" else []
        keys += [headers["x-api-key"]] if "x-api-key" in headers else []
        # Every presented key is compared (no early exit): the time says nothing of the key.
        # (The head was decoded as latin-1.)
        matches = [hmac.compare_digest(k.encode("latin-1", "replace"), expected) for k in keys]
        if not any(matches):
            raise HTTPError(
                401,
                "missing or wrong API key: send 'Authorization: Bearer <key>' with the key "
                f"the server was started with ({hint})",
                type="Unauthorized",
                headers=[("www-authenticate", "Bearer")],
            )

    return guard


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` serves this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to any interface


def warn_if_open(host: str, port: int, *, what: str, flag: str = "--api-key") -> None:
    """Log a prominent warning when ``host`` is not loopback and there is no key."""
    if is_loopback(host):
        return
    log.warning(
        "\n%s\n%s listens on %s:%s WITHOUT an API key: anyone who can reach this address can "
        "use and control it.\nSet %s (or bind 127.0.0.1).\n%s",
        "!" * 78,
        what,
        host or "*",
        port,
        flag,
        "!" * 78,
    )
