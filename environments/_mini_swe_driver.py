"""Runs mini-swe-agent, unchanged, for one episode of :mod:`environments.mini_swe`.

This file is executed by the Python of mini-swe-agent's own virtual environment (its pins
clash with agentenv's), never imported by agentenv. It speaks JSON lines with the adapter:

* stdin, first line: the run (``base_url``, ``api_key``, ``model_name``, ``task``,
  ``config``: config specs as the ``mini`` command's ``-c`` takes them -- a file name
  such as ``mini.yaml`` or ``key.path=value`` -- merged in order, ``command_timeout_s``);
* stdout: ``{"exec": command, "timeout_s": n}`` for each shell command the agent issues,
  answered on stdin with ``{"output": ..., "returncode": ..., "exception_info": ...}``
  (the command runs in the task's container, on the adapter's side); finally
  ``{"done": {...}}`` with the agent's exit status and submission.

Anything else the harness or litellm prints goes to stderr, so it cannot corrupt the
protocol. Only configuration and an environment class (the harness's documented
extension point) are supplied: the agent, model and templates are mini-swe-agent's own.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
from typing import Any

# The protocol's own stream; fd 1 then points at stderr for everything else.
_PROTOCOL = os.fdopen(os.dup(1), "w", encoding="utf-8", buffering=1)
os.dup2(2, 1)
sys.stdout = sys.stderr

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.config import get_config_from_spec  # noqa: E402
from minisweagent.environments.local import LocalEnvironment  # noqa: E402
from minisweagent.models import get_model  # noqa: E402
from minisweagent.utils.serialize import recursive_merge  # noqa: E402


def _send(message: dict[str, Any]) -> None:
    _PROTOCOL.write(json.dumps(message) + "\n")
    _PROTOCOL.flush()


class ContainerEnvironment(LocalEnvironment):  # type: ignore[misc]
    """mini-swe-agent's local environment, its commands run in the task's container.

    Submission detection, template variables and serialization are the local
    environment's; only where a command runs changes.
    """

    def execute(
        self, action: dict[str, Any], cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        command = str(action.get("command", ""))
        prefix = "".join(f"export {k}={shlex.quote(v)}; " for k, v in self.config.env.items())
        where = cwd or self.config.cwd
        if where:
            prefix += f"cd {shlex.quote(where)} && "
        _send({"exec": prefix + command, "timeout_s": timeout or self.config.timeout})
        line = sys.stdin.readline()
        if not line:
            raise SystemExit("the adapter closed the command channel")
        output: dict[str, Any] = json.loads(line)
        self._check_finished(output)
        return output


def main() -> None:
    run = json.loads(sys.stdin.readline())
    config: dict[str, Any] = recursive_merge(*(get_config_from_spec(c) for c in run["config"]))
    model_config = dict(config.get("model", {}))
    model_config["model_kwargs"] = {
        **model_config.get("model_kwargs", {}),
        "api_base": run["base_url"],
        "api_key": run["api_key"],
    }
    # The endpoint is not a priced provider: its calls cost nothing to track.
    model_config.setdefault("cost_tracking", "ignore_errors")
    model = get_model(run["model_name"], model_config)
    env_config = {**config.get("environment", {}), "timeout": int(run["command_timeout_s"])}
    env_config.pop("environment_class", None)
    env = ContainerEnvironment(**env_config)
    agent_config = {
        k: v for k, v in config.get("agent", {}).items() if k not in ("mode", "agent_class")
    }
    agent = DefaultAgent(model, env, **agent_config)
    try:
        info = agent.run(run["task"])
        error = ""
    except Exception as e:  # the harness ended on an error: its exit status says which
        info = agent.messages[-1].get("extra", {}) if agent.messages else {}
        error = f"{type(e).__name__}: {e}"
    _send(
        {
            "done": {
                "exit_status": str(info.get("exit_status", "")),
                "submission": str(info.get("submission", "")),
                "n_calls": agent.n_calls,
                "error": error[-2000:],
            }
        }
    )


if __name__ == "__main__":
    main()
