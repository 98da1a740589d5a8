"""agentenv.http, the public face of the services' HTTP layer: ``__all__`` sorted and
complete, every name the one the services use, aiohttp loaded only with the server, and a
router lists its handlers."""

from __future__ import annotations

import subprocess
import sys

import agentenv._http as layer
import agentenv.http as http


def test_all_is_sorted_and_every_name_is_the_layers_own() -> None:
    assert http.__all__ == sorted(http.__all__)
    for name in http.__all__:
        assert getattr(http, name) is getattr(layer, name), name


def test_import_loads_no_aiohttp_until_the_server_is_asked_for() -> None:
    code = (
        "import sys, agentenv.http as h; a = 'aiohttp' in sys.modules; h.HTTPServer; "
        "print(a, 'aiohttp' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False True"


def test_a_router_lists_its_handlers() -> None:
    router = http.Router()

    async def health(request: http.Request) -> http.Response:
        return http.Response(b"{}", 200, "application/json")

    router.add("get", "/health", health, probe=True)
    assert router.handlers() == {("GET", "/health"): health}
