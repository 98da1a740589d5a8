"""``openenv``: play an OpenEnv environment server (Hugging Face's OpenEnv, PyPI ``openenv``).

Each episode is one OpenEnv episode, driven through OpenEnv's own client
(``GenericEnvClient``): ``reset`` gives the first observation, rendered to a user message;
each model reply becomes an action for ``step``, whose rewards are summed into
``Sample.reward`` until ``done`` (or ``max_turns`` replies: truncated). OpenEnv's pins clash
with agentenv's, so its client runs in the Python of its own environment
(``.venv-openenv``) as a bridge process per slot (``_openenv_bridge.py``), spoken to over
pipes from threads. A server or bridge that dies, hangs or answers garbage fails that
episode only, with the reason, and its slot is restarted for the next. What maps to what
and the bounds: docs/ecosystem.md, "OpenEnv environments".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv import (
    AgentEnvError,
    ConfigError,
    Environment,
    Episode,
    EpisodeAborted,
    EpisodeTruncated,
    Message,
    Sample,
    Status,
    Task,
)

BRIDGE = Path(__file__).with_name("_openenv_bridge.py")
# Made by ``make test`` beside the project's own venv.
DEFAULT_PYTHON = str(Path(__file__).resolve().parents[1] / ".venv-openenv" / "bin" / "python")
_STDERR_TAIL = 400

ActionParser = Callable[[str], Mapping[str, Any]]
ObservationRenderer = Callable[[Mapping[str, Any]], str]


class OpenEnvError(AgentEnvError):
    """The OpenEnv server or its client failed; fails the episode, naming the reason."""


@dataclass(frozen=True)
class OpenEnvStep:
    """What ``reset`` or ``step`` answered."""

    observation: Mapping[str, Any]
    reward: float | None
    done: bool


def text_action(field: str = "message") -> ActionParser:
    """The default action parser: the whole reply as the action's ``field``."""

    def parse(reply: str) -> Mapping[str, Any]:
        return {field: reply}

    return parse


def render_observation(observation: Mapping[str, Any]) -> str:
    """The default renderer: an observation's one text field as is, else its fields as
    JSON (``done``, ``reward`` and ``metadata`` left out: the adapter reads those)."""
    fields = {k: v for k, v in observation.items() if k not in ("done", "reward", "metadata")}
    texts = [v for v in fields.values() if isinstance(v, str)]
    if len(texts) == 1:
        return texts[0]
    return json.dumps(fields, sort_keys=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _tail(path: Path | None) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace")[-_STDERR_TAIL:].strip()
    return f"; its stderr ends: {text}" if text else ""


def _kill(proc: subprocess.Popen[str] | None) -> None:
    if proc is None:
        return
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for pipe in (proc.stdin, proc.stdout):
        if pipe is not None:
            with contextlib.suppress(OSError):
                pipe.close()  # a broken pipe to a dead process: nothing left to flush


class _Slot:
    """One OpenEnv session: an optional local server process and one bridge process.

    Blocking pipe I/O runs in threads, so a slot works under any event loop (each
    ``agentenv.run`` has its own).
    """

    def __init__(self, env: OpenEnvEnv) -> None:
        self.env = env
        self.server: subprocess.Popen[str] | None = None
        self.bridge: subprocess.Popen[str] | None = None
        self.server_log: Path | None = None
        self.bridge_log: Path | None = None
        self.url = env.url
        self.broken = True  # started on first use

    def close(self) -> None:
        _kill(self.bridge)
        _kill(self.server)
        for log in (self.server_log, self.bridge_log):
            if log is not None:
                log.unlink(missing_ok=True)
        self.bridge = self.server = None
        self.server_log = self.bridge_log = None
        self.broken = True

    def _spawn(self, argv: list[str], cwd: str | None, what: str, *, pipes: bool) -> Any:
        """The process and the file its stderr goes to."""
        fd, name = tempfile.mkstemp(prefix=f"openenv-{what}-", suffix=".log")
        os.close(fd)  # reopened below, by name
        log = Path(name)
        with log.open("w") as err:
            return log, subprocess.Popen(
                argv,
                cwd=cwd,
                stdin=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stdout=subprocess.PIPE if pipes else subprocess.DEVNULL,
                stderr=err,
                text=True,
                start_new_session=True,  # a Ctrl-C of the run is ours to handle
            )

    def start(self) -> None:
        """Start the server (if local) and wait until it is ready, then the bridge."""
        self.close()
        env = self.env
        if env.server is not None:
            port = _free_port()
            argv = [a.replace("{port}", str(port)) for a in env.server]
            self.server_log, self.server = self._spawn(argv, env.cwd, "server", pipes=False)
            self.url = f"http://127.0.0.1:{port}"
        assert self.url is not None
        self._wait_ready(self.url)
        bridge = [env.openenv_python, str(BRIDGE), self.url, str(env.client_timeout_s)]
        self.bridge_log, self.bridge = self._spawn(bridge, None, "bridge", pipes=True)
        self.broken = False

    def _wait_ready(self, url: str) -> None:
        deadline = time.monotonic() + self.env.ready_timeout_s
        last = "no answer"
        while True:
            if self.server is not None and self.server.poll() is not None:
                raise OpenEnvError(
                    f"the OpenEnv server {self.env.server!r} exited with code "
                    f"{self.server.returncode} before it was ready{_tail(self.server_log)}"
                )
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=1) as r:
                    if r.status == 200:
                        return
                    last = f"HTTP {r.status}"
            except (OSError, urllib.error.URLError) as e:
                last = str(e)
            if time.monotonic() >= deadline:
                raise OpenEnvError(
                    f"the OpenEnv server at {url} was not ready within "
                    f"ready_timeout_s={self.env.ready_timeout_s:g} s (GET /health: {last}); "
                    "check its command line, or raise ready_timeout_s for a slow start"
                    f"{_tail(self.server_log)}"
                )
            time.sleep(0.05)

    def call(self, request: Mapping[str, Any]) -> OpenEnvStep:
        """Send one request to the bridge and parse its answer (blocking)."""
        bridge = self.bridge
        assert bridge is not None and bridge.stdin is not None and bridge.stdout is not None
        try:
            bridge.stdin.write(json.dumps(request) + "\n")
            bridge.stdin.flush()
        except OSError:
            pass  # a dead bridge shows as the empty answer below
        line = bridge.stdout.readline()
        if not line:
            with contextlib.suppress(subprocess.TimeoutExpired):
                bridge.wait(timeout=5)  # reap it, so its exit and stderr can be named
            raise OpenEnvError(self._death(f"{request['op']}: the OpenEnv client exited"))
        try:
            answer = json.loads(line)
        except json.JSONDecodeError:
            raise OpenEnvError(
                f"{request['op']}: the OpenEnv client answered non-JSON {line[:200]!r}"
            ) from None
        if not answer.get("ok"):
            error = str(answer.get("error"))
            if error.startswith("TimeoutError"):  # the client's own bound
                raise OpenEnvError(_no_answer(request["op"], self.env.client_timeout_s))
            raise OpenEnvError(self._death(f"{request['op']}: {error}"))
        return self._parse(request["op"], answer)

    def _death(self, what: str) -> str:
        if self.server is not None:
            # A server that just died may not be reaped yet: give it a moment to be named.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.server.wait(timeout=2)
        if self.server is not None and self.server.poll() is not None:
            return (
                f"{what}; the OpenEnv server exited with code {self.server.returncode}"
                f"{_tail(self.server_log)}"
            )
        dead = self.bridge is not None and self.bridge.poll() is not None
        return f"{what}{_tail(self.bridge_log) if dead else ''}"

    @staticmethod
    def _parse(op: str, answer: Mapping[str, Any]) -> OpenEnvStep:
        observation, reward, done = (
            answer.get("observation"),
            answer.get("reward"),
            answer.get("done"),
        )
        if not isinstance(observation, dict):
            raise OpenEnvError(
                f"{op}: the server's observation is not an object: {observation!r:.200}"
            )
        if reward is not None and (
            isinstance(reward, bool)
            or not isinstance(reward, int | float)
            or not math.isfinite(reward)
        ):
            raise OpenEnvError(f"{op}: the server's reward is not a finite number: {reward!r:.200}")
        if not isinstance(done, bool):
            raise OpenEnvError(f"{op}: the server's done is not a boolean: {done!r:.200}")
        return OpenEnvStep(observation, None if reward is None else float(reward), done)


class OpenEnvEnv(Environment):
    """An OpenEnv environment server, played through OpenEnv's own client.

    Args:
        server: the server's command line, ``{port}`` standing for the port it must serve
            on (e.g. ``[python, "-m", "uvicorn", "server.app:app", "--port", "{port}"]``);
            started once per slot and restarted after a failure. Or give ``url``.
        url: an OpenEnv server already running (``http://host:port``).
        cwd: the server's working directory.
        openenv_python: the Python that has ``openenv`` installed (default
            ``$AGENTENV_OPENENV_PYTHON``, else the project's ``.venv-openenv/bin/python``).
        action: the model's reply -> the action's JSON (default ``{"message": reply}``).
        render: an observation's JSON -> the user message (default
            :func:`render_observation`).
        system_prompt: an optional system message before the first observation.
        max_turns: model replies per episode before it ends as truncated.
        n_tasks: tasks per split; task ``i`` resets with ``seed=i`` (``reset_kwargs``
            are passed too).
        concurrency: sessions at once (each slot one server process when local: most
            OpenEnv servers allow one session each).
        ready_timeout_s: how long a started server may take to answer ``GET /health``.
        reset_timeout_s: how long one ``reset`` (with the session's connection) may take.
        step_timeout_s: how long one ``step`` may take.
    """

    name = "openenv"

    def __init__(
        self,
        *,
        server: Sequence[str] | None = None,
        url: str | None = None,
        cwd: str | os.PathLike[str] | None = None,
        openenv_python: str | None = None,
        action: ActionParser | None = None,
        render: ObservationRenderer | None = None,
        system_prompt: str | None = None,
        max_turns: int = 8,
        n_tasks: int = 100,
        reset_kwargs: Mapping[str, Any] | None = None,
        concurrency: int = 1,
        ready_timeout_s: float = 60.0,
        reset_timeout_s: float = 60.0,
        step_timeout_s: float = 60.0,
    ) -> None:
        if (server is None) == (url is None):
            raise ConfigError(
                "OpenEnvEnv needs exactly one of server= (a command line with {port}) or "
                f"url= (a running server); got server={server!r}, url={url!r}"
            )
        if server is not None and (isinstance(server, str) or not server):
            raise ConfigError(
                f"server must be a non-empty list of arguments, got {server!r}; "
                "e.g. ['python', '-m', 'uvicorn', 'server.app:app', '--port', '{port}']"
            )
        for label, value in (
            ("max_turns", max_turns),
            ("n_tasks", n_tasks),
            ("concurrency", concurrency),
        ):
            if value < 1:
                raise ConfigError(f"{label} must be at least 1, got {value}")
        for label, t in (
            ("ready_timeout_s", ready_timeout_s),
            ("reset_timeout_s", reset_timeout_s),
            ("step_timeout_s", step_timeout_s),
        ):
            if not t > 0:
                raise ConfigError(f"{label} must be positive, got {t}")
        self.server = list(server) if server is not None else None
        self.url = url.rstrip("/") if url is not None else None
        self.cwd = str(cwd) if cwd is not None else None
        self.openenv_python = (
            openenv_python or os.environ.get("AGENTENV_OPENENV_PYTHON") or DEFAULT_PYTHON
        )
        self.action = action or text_action()
        self.render = render or render_observation
        self.system_prompt = system_prompt
        self.max_turns = max_turns
        self.n_tasks = n_tasks
        self.reset_kwargs = dict(reset_kwargs or {})
        self.concurrency = concurrency
        self.ready_timeout_s = ready_timeout_s
        self.reset_timeout_s = reset_timeout_s
        self.step_timeout_s = step_timeout_s
        # OpenEnv's client gets the larger bound; the adapter enforces each op's own.
        self.client_timeout_s = max(reset_timeout_s, step_timeout_s) + 5
        self._slots = [_Slot(self) for _ in range(concurrency)]
        self._free: asyncio.Queue[_Slot] = asyncio.Queue()  # the slots no episode holds
        self._loop: asyncio.AbstractEventLoop | None = None
        # The processes never outlive the interpreter (close() stops them sooner).
        weakref.finalize(self, _close_all, self._slots)

    def check(self) -> None:
        if not Path(self.openenv_python).exists() and shutil.which(self.openenv_python) is None:
            raise ConfigError(
                f"openenv_python {self.openenv_python!r} does not exist; create it with "
                "`make .venv-openenv/.installed` (or `python -m venv .venv-openenv && "
                ".venv-openenv/bin/pip install openenv==0.10.0`), or pass openenv_python="
            )

    def tasks(self, split: str = "train") -> list[Task]:
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        base = 0 if split == "train" else 1_000_000
        return [Task(id=f"{split}-{i}", info={"seed": base + i}) for i in range(self.n_tasks)]

    def close(self) -> None:
        """Stop every server and bridge process of this environment."""
        _close_all(self._slots)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

    async def _call(self, slot: _Slot, request: Mapping[str, Any]) -> OpenEnvStep:
        timeout = self.reset_timeout_s if request["op"] == "reset" else self.step_timeout_s
        try:
            return await asyncio.wait_for(asyncio.to_thread(slot.call, request), timeout)
        except TimeoutError:
            slot.broken = True
            # Killing the bridge ends the thread blocked on its pipe.
            await asyncio.to_thread(slot.close)
            raise OpenEnvError(_no_answer(request["op"], timeout)) from None
        except OpenEnvError:
            slot.broken = True
            raise
        except asyncio.CancelledError:
            # An episode timeout: the answer may still come, so the session is unusable.
            slot.close()
            raise

    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        if self._loop is not asyncio.get_running_loop():  # a new run: a queue serves one loop
            self._loop, self._free = asyncio.get_running_loop(), asyncio.Queue()
            for slot in self._slots:
                self._free.put_nowait(slot)
        slot = await self._free.get()
        try:
            return await self._play(slot, task, episode)
        finally:
            self._free.put_nowait(slot)

    async def _play(self, slot: _Slot, task: Task, episode: Episode) -> list[Sample]:
        if slot.broken:
            try:
                await asyncio.to_thread(slot.start)
            except BaseException:
                await asyncio.to_thread(slot.close)
                raise
        kwargs = {**self.reset_kwargs}
        if "seed" in task.info:
            kwargs.setdefault("seed", task.info["seed"])
        step = await self._call(slot, {"op": "reset", "kwargs": kwargs})
        messages: list[Message] = []
        if self.system_prompt:
            messages.append({"role": "system", "content": self.system_prompt})
        messages.append({"role": "user", "content": self.render(step.observation)})
        transcript = episode.transcript(messages)
        total = step.reward or 0.0
        steps = 0
        status, reason = Status.COMPLETED, None
        try:
            while not step.done:
                limit = episode.limits.max_turns or self.max_turns
                if transcript.turns >= limit:
                    status, reason = Status.TRUNCATED, f"max_turns: reached {limit} turns"
                    break
                reply = await episode.generate(transcript, max_turns=self.max_turns)
                try:
                    action = dict(self.action(str(reply.get("content") or "")))
                except Exception as e:
                    raise OpenEnvError(f"the action parser failed on the reply: {e}") from e
                step = await self._call(slot, {"op": "step", "action": action})
                steps += 1
                total += step.reward or 0.0
                if not step.done and transcript.turns < limit:
                    transcript.add_messages(
                        [{"role": "user", "content": self.render(step.observation)}]
                    )
        except EpisodeTruncated as e:
            status, reason = Status.TRUNCATED, e.reason
        except EpisodeAborted as e:
            status, reason = Status.ABORTED, str(e)
        return episode.samples(
            transcript,
            total,
            status=status,
            reason=reason,
            metadata={"openenv_steps": steps, "openenv_done": step.done},
        )


def _no_answer(op: str, timeout_s: float) -> str:
    return (
        f"{op}: the OpenEnv server did not answer within {op}_timeout_s={timeout_s:g} s; "
        f"raise {op}_timeout_s for a slow environment"
    )


def _close_all(slots: Sequence[_Slot]) -> None:
    for slot in slots:
        slot.close()


__all__ = [
    "OpenEnvEnv",
    "OpenEnvError",
    "OpenEnvStep",
    "render_observation",
    "text_action",
]
