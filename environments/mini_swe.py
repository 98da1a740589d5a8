"""``mini_swe``: the mini-swe-agent harness, unchanged, acting in Harbor tasks' containers.

::

    from agentenv import run
    from environments.mini_swe import MiniSweEnv

    result = run(MiniSweEnv(), model)   # the bundled Harbor tasks, scored by their tests

Per episode a container of the task is started (:meth:`HarborEnv.session`) and the harness
runs as a subprocess of its own Python (its pins clash with agentenv's: ``.venv-miniswe``),
its model the episode's endpoint (every call recorded token-exact), each of its shell
commands sent here over the driver's pipe (``_mini_swe_driver.py``) and run in the
container; then the task's tests give the reward. What maps to what, the context, the
failures and the limits: docs/ecosystem.md, "Command-line agents: mini-swe-agent".
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agentenv import AgentEnv, ConfigError, Episode, Rubric, Sample, State, Task
from agentenv.endpoint import Endpoint
from environments._process import LineProcess
from environments.harbor import DEFAULT_TASKS, HarborEnv, TaskSession, Verdict
from sandboxes import Result

__all__ = ["DEFAULT_PYTHON", "MINI_SWE_AGENT_VERSION", "HarnessResult", "MiniSweEnv"]

MINI_SWE_AGENT_VERSION = "2.4.6"
DRIVER = Path(__file__).with_name("_mini_swe_driver.py")
DEFAULT_PYTHON = Path(__file__).resolve().parents[1] / ".venv-miniswe" / "bin" / "python"
# One protocol line holds one shell command (a heredoc writing a file, say) or one reply.
MAX_LINE_BYTES = 16 << 20


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HarnessResult:
    """How mini-swe-agent ended: its exit status (``Submitted``, ``LimitsExceeded``,
    ``RepeatedFormatError``, or an exception's name), its submission, its model calls and,
    when it stopped on an error, that error."""

    exit_status: str
    submission: str
    n_calls: int
    error: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(slots=True)
class _Outcome:
    verdict: Verdict | None = None
    harness: HarnessResult | None = None


def _observation(r: Result) -> dict[str, Any]:
    """A command's result as mini-swe-agent's local environment reports one (stderr
    merged into the output; a timeout as returncode -1 with ``exception_info``)."""
    output = r.stdout + r.stderr
    if r.stdout_truncated or r.stderr_truncated:
        output += "\n[output truncated]"
    if r.timed_out:
        why = f"timed out after {r.duration_s:.0f} s"
    else:
        why = "killed, out of memory" if r.oom_killed else r.error or ""
    info = f"An error occurred while executing the command: {why}" if why else ""
    code = -1 if info else r.exit_code
    return {"output": output, "returncode": code, "exception_info": info}


class MiniSweEnv(AgentEnv):
    """Harbor tasks solved by mini-swe-agent, its calls trained through the endpoint.

    Args:
        path: a directory of Harbor task directories, or one task (default: the bundled
            tasks of :mod:`environments.harbor`).
        config: mini-swe-agent config specs, merged in order as its ``mini -c`` merges
            them: a config file name or path (``mini.yaml``, the ``mini`` command's
            default) or ``key.path=value``; ``agent.step_limit`` is set from ``step_limit``
            after them.
        step_limit: model calls per episode (mini-swe-agent's ``agent.step_limit``).
        command_timeout_s: wall-clock limit of one shell command.
        python: the Python of mini-swe-agent's environment (default ``.venv-miniswe``,
            made by ``make .venv-miniswe/.installed``).
        max_harnesses: harness processes alive at once (each is a Python with litellm
            loaded, ~200 MB resident); more episodes wait. Default: the CPU count.
        max_containers: task containers alive at once (:class:`HarborEnv`).
    """

    name = "mini_swe"
    client_kind = "endpoint"

    def __init__(
        self,
        path: str | Path = DEFAULT_TASKS,
        *,
        config: Sequence[str] = ("mini.yaml",),
        step_limit: int = 30,
        command_timeout_s: float = 60.0,
        python: str | Path | None = None,
        max_harnesses: int | None = None,
        max_containers: int | None = None,
    ) -> None:
        if step_limit < 1:
            raise ConfigError(f"step_limit must be at least 1, got {step_limit}")
        if isinstance(config, str):
            raise ConfigError(f"config must be a list of config specs, got the string {config!r}")
        self.harbor = HarborEnv(
            path, command_timeout_s=command_timeout_s, max_containers=max_containers
        )
        self.config = [*config, f"agent.step_limit={step_limit}"]
        self.command_timeout_s = command_timeout_s
        self.python = Path(python) if python is not None else DEFAULT_PYTHON
        self.max_harnesses = max_harnesses or (os.cpu_count() or 1)
        if self.max_harnesses < 1:
            raise ConfigError(f"max_harnesses must be at least 1, got {max_harnesses}")
        self.rubric = Rubric(self.tests_reward)
        self._outcomes: dict[int, _Outcome] = {}
        self._slots: dict[int, asyncio.Semaphore] = {}
        # The harness's own config directory: a user's ~/.config/mini-swe-agent/.env
        # (API keys, a default model) must not steer the episodes.
        self._config_dir = tempfile.mkdtemp(prefix="agentenv-mini-swe-")

    def check(self) -> None:
        super().check()
        if not self.python.is_file():
            raise ConfigError(
                f"mini-swe-agent's Python {str(self.python)!r} does not exist: create its "
                "environment with `make .venv-miniswe/.installed` (mini-swe-agent=="
                f"{MINI_SWE_AGENT_VERSION} in a venv of its own), or pass python=..."
            )

    def tasks(self, split: str = "train") -> list[Task]:
        return self.harbor.tasks(split)

    def tests_reward(self, task: Task, state: State) -> float:
        """The task's tests' reward (0 when they could not run); the verdict and the
        harness's exit go to the sample's metadata."""
        outcome = self._outcomes.get(id(state.episode), _Outcome())
        if outcome.harness is not None:
            state.info["harness"] = outcome.harness.to_json()
        if outcome.verdict is None:
            state.info["verifier"] = None
            return 0.0
        state.info["verifier"] = outcome.verdict.to_json()
        return outcome.verdict.reward

    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        self._outcomes[id(episode)] = _Outcome()
        try:
            return await super().rollout(task, episode)
        finally:
            self._outcomes.pop(id(episode), None)

    async def run_agent(self, task: Task, client: Endpoint) -> str:
        outcome = self._outcomes[id(client.recorder.episode)]
        name = str(task.info.get("harbor_task", task.id))
        loop = id(asyncio.get_running_loop())
        slot = self._slots.setdefault(loop, asyncio.Semaphore(self.max_harnesses))
        async with slot, self.harbor.session(name) as session:
            limit = session.task.config.agent_timeout_s
            try:
                async with asyncio.timeout(session.time_left()):
                    harness = await self._drive(session, client.base_url, str(task.prompt))
            except TimeoutError:
                outcome.verdict = await session.verify()
                raise TimeoutError(
                    f"mini-swe-agent ran past task {name!r}'s agent timeout ({limit:g} s; "
                    "[agent] timeout_sec in its task.toml)"
                ) from None
            except Exception:
                outcome.verdict = await session.verify()
                raise
            outcome.harness = harness
            outcome.verdict = await session.verify()
        if harness.error:
            # Ended by a refused call (the context, the turn limit): AgentEnv makes the
            # samples truncated; anything else fails the episode with this reason.
            raise RuntimeError(
                f"mini-swe-agent stopped on an error ({harness.exit_status}): {harness.error}"
            )
        return harness.submission

    def _environ(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            MSWEA_SILENT_STARTUP="1",
            MSWEA_GLOBAL_CONFIG_DIR=self._config_dir,
            # A refused call is final (the endpoint's answer will not change): no retries.
            MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT="1",
            MSWEA_COST_TRACKING="ignore_errors",
            # litellm fetches its model price list from the internet unless told not to.
            LITELLM_LOCAL_MODEL_COST_MAP="True",
            NO_PROXY="127.0.0.1,localhost",
            no_proxy="127.0.0.1,localhost",
        )
        return env

    async def _drive(self, session: TaskSession, base_url: str, instruction: str) -> HarnessResult:
        """Run the harness on ``instruction``; execute its commands in ``session``."""
        harness = await LineProcess.start(
            [str(self.python), str(DRIVER)],
            env=self._environ(),
            line_limit=MAX_LINE_BYTES,
            tail_lines=40,  # litellm may log a lot: the last lines only
        )
        try:
            await harness.send(
                {
                    "base_url": base_url,
                    "api_key": "agentenv",
                    "model_name": f"openai/{self.model}",
                    "task": instruction,
                    "config": self.config,
                    "command_timeout_s": self.command_timeout_s,
                }
            )
            while (message := await harness.read()) is not None:
                if "done" in message:
                    done = message["done"]
                    return HarnessResult(
                        exit_status=str(done["exit_status"]),
                        submission=str(done["submission"]),
                        n_calls=int(done["n_calls"]),
                        error=str(done["error"]),
                    )
                timeout = min(float(message.get("timeout_s") or 0) or 1e9, self.command_timeout_s)
                result = await session.bash(str(message["exec"]), timeout_s=timeout)
                await harness.send(_observation(result))
            raise RuntimeError(
                f"mini-swe-agent exited with status {await harness.exit_code()} before it "
                "finished; its last output:\n" + "\n".join(harness.stderr)
            )
        finally:
            await harness.aclose()
