"""Commands that need no model stay light: building the ``agentenv`` parser, rendering any
command's ``--help`` and serving a Buffer import neither torch nor transformers (nor numpy,
for the parser), each checked in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
HEAVY = ("torch", "transformers", "numpy")

# Builds the whole parser (plug-ins included), then renders the help of each command.
PARSER_PROBE = """
import contextlib, io, json, sys
from agentenv.cli import build_parser, main
build_parser()
loaded = {"build": sorted(m for m in HEAVY if m in sys.modules)}
for argv in COMMANDS:
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        main(argv)
    loaded[" ".join(argv)] = sorted(m for m in HEAVY if m in sys.modules)
print(json.dumps(loaded))
"""

# Runs `agentenv buffer serve` as the command does (main() on the main thread); once the
# server says where it listens, a thread queries it, notes the loaded modules and stops the
# server with SIGTERM, as a user would.
SERVE_PROBE = """
import io, json, os, re, signal, sys, threading, urllib.request
from agentenv.cli import main

ready = threading.Event()
url = []
result = {}

class Watch(io.TextIOBase):
    def write(self, text):
        found = re.search(r"http://\\S+", text)
        if found:
            url.append(found.group(0))
            ready.set()
        return len(text)

def probe():
    try:
        if not ready.wait(60):
            result["error"] = "the server did not start"
            return
        request = urllib.request.Request(
            url[0] + "/v1/statistics", headers={"Authorization": "Bearer s3cret"}
        )
        with urllib.request.urlopen(request, timeout=10) as response:
            result["status"] = response.status
        result["loaded"] = sorted(m for m in HEAVY if m in sys.modules)
    finally:
        os.kill(os.getpid(), signal.SIGTERM)

threading.Thread(target=probe, daemon=True).start()
sys.stdout = Watch()
code = main(["buffer", "serve", "--path", PATH, "--token-file", TOKEN])
sys.stdout = sys.__stdout__
result["code"] = code
print(json.dumps(result))
"""


def run_probe(code: str, **names: object) -> dict[str, object]:
    prelude = "".join(f"{k} = {v!r}\n" for k, v in names.items())
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    out = subprocess.run(
        [sys.executable, "-c", prelude + code],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_the_parser_and_every_help_import_no_torch() -> None:
    commands = [
        ["--help"],
        ["eval", "--help"],
        ["serve", "--help"],
        ["train", "--help"],
        ["bench", "--help"],
        ["bench", "train", "--help"],
        ["buffer", "serve", "--help"],
        ["sandbox", "--help"],
    ]
    loaded = run_probe(PARSER_PROBE, HEAVY=HEAVY, COMMANDS=commands)
    assert set(loaded) == {"build", *(" ".join(c) for c in commands)}
    assert {k: v for k, v in loaded.items() if v} == {}


@pytest.mark.timeout(120)
def test_buffer_serve_imports_no_torch(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    token.chmod(0o600)
    # The Buffer's codec checks floats with numpy: that one is expected here.
    result = run_probe(
        SERVE_PROBE, HEAVY=("torch", "transformers"), PATH=str(tmp_path / "buf"), TOKEN=str(token)
    )
    assert result == {"status": 200, "loaded": [], "code": 0}
