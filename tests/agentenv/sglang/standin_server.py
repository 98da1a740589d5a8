"""A stand-in for ``python -m sglang.launch_server``: records its argv, answers /health.

Usage: standin_server.py --record FILE [--unhealthy-polls N] [--exit-early] [--ignore-term]
[--child] --model-path M --host H --port P [anything else]. ``--child`` starts a sleeping
subprocess (like SGLang's scheduler) whose pid goes into FILE.child.
"""

from __future__ import annotations

import http.server
import json
import signal
import subprocess
import sys
import time


def main() -> None:
    argv = sys.argv[1:]
    record = argv[argv.index("--record") + 1]
    port = int(argv[argv.index("--port") + 1])
    unhealthy = int(argv[argv.index("--unhealthy-polls") + 1]) if "--unhealthy-polls" in argv else 0
    with open(record, "w") as f:
        json.dump(argv, f)
    print("stand-in: loading weights", flush=True)
    if "--exit-early" in argv:
        print("stand-in: CUDA out of memory", flush=True)
        sys.exit(3)
    if "--ignore-term" in argv:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if "--child" in argv:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        with open(record + ".child", "w") as f:
            f.write(str(child.pid))
    polls = 0

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            nonlocal polls
            polls += 1
            self.send_response(200 if polls > unhealthy else 503)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", port), Handler)
    server.timeout = 0.1
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        server.handle_request()


if __name__ == "__main__":
    main()
