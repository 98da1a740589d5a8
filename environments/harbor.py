"""``harbor``: tasks in Harbor's format (Terminal-Bench 2.0), played through a ``bash`` tool.

A task is a directory of ``instruction.md``, ``task.toml``, ``environment/Dockerfile``,
``tests/test.sh`` (it writes the reward) and optionally ``solution/solve.sh``::

    from agentenv import run
    from environments.harbor import HarborEnv

    env = HarborEnv("path/to/tasks")        # a directory of task directories (or one task)
    result = run(env, model)                # one episode per task: bash calls, then the tests

Each task's image is built once from ``environment/`` (tagged by a content hash of it);
per episode the agent gets one locked-down container (:class:`sandboxes.Container`), then
the tests run in it as one step the agent cannot reach (:meth:`TaskSession.verify`), so a
tampered test or a faked reward scores what the tests say. What maps to what, the
containers' limits and what is not supported: docs/ecosystem.md, "Harbor tasks". A
black-box agent (a command-line harness) acts through :meth:`HarborEnv.session`:
``async with env.session(name) as s: await s.bash(cmd, timeout_s=30); await s.verify()``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import os
import re
import time
import tomllib
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, ClassVar

from agentenv import (
    AgentEnvError,
    ConfigError,
    Episode,
    EpisodeTruncated,
    Message,
    Rubric,
    Sample,
    State,
    Task,
    Tool,
    ToolEnv,
)
from sandboxes import SANDBOX_IMAGE, Container, Limits, Result, SandboxError, build_image

__all__ = [
    "DEFAULT_TASKS",
    "HarborBuildError",
    "HarborEnv",
    "HarborTask",
    "TaskConfig",
    "TaskSession",
    "Verdict",
    "format_output",
    "load_task",
    "load_tasks",
    "read_config",
]

DEFAULT_TASKS = Path(__file__).with_name("harbor_tasks")
AGENT_USER = "1000:1000"
SYSTEM_PROMPT = (
    "You are working in a Linux machine through the `bash` tool: each call runs one bash "
    "command line and returns its output. Files you change stay changed between calls. "
    "Complete the task, then reply without a tool call."
)


class HarborBuildError(AgentEnvError):
    """A task's image did not build; the message names the task and the builder's error."""


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class TaskConfig:
    """What ``task.toml`` sets (Harbor's defaults where it sets nothing)."""

    agent_timeout_s: float = 600.0
    agent_user: str = AGENT_USER
    verifier_timeout_s: float = 600.0
    verifier_user: str = "root"
    verifier_env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    build_timeout_s: float = 600.0
    cpus: float = 1.0
    memory_mb: int = 2048
    docker_image: str | None = None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class HarborTask:
    """One task directory, read and checked."""

    name: str
    path: Path
    instruction: str
    config: TaskConfig
    tests: Mapping[str, bytes]
    solution: str | None

    @property
    def dockerfile(self) -> Path:
        return self.path / "environment" / "Dockerfile"

    def image_tag(self) -> str:
        """``agentenv-harbor-<name>:<hash of environment/>``: a changed task gets a new tag."""
        digest = hashlib.sha256()
        env_dir = self.path / "environment"
        for f in sorted(p for p in env_dir.rglob("*") if p.is_file()):
            rel = f.relative_to(env_dir).as_posix()
            digest.update(f"{rel}\0{f.stat().st_mode & 0o111:o}\0".encode())
            digest.update(hashlib.sha256(f.read_bytes()).digest())
        slug = re.sub(r"[^a-z0-9_.-]+", "-", self.name.lower()).strip("-.") or "task"
        return f"agentenv-harbor-{slug[:100]}:{digest.hexdigest()[:16]}"

    def host_usr(self) -> bool:
        """True when the image is built on the sandbox image (which takes the host's /usr)."""
        if not self.dockerfile.is_file():
            return False
        froms = re.findall(r"(?im)^\s*FROM\s+(?:--\S+\s+)*(\S+)", self.dockerfile.read_text())
        return SANDBOX_IMAGE in froms


def _number(table: Mapping[str, Any], key: str, where: str, default: float) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ConfigError(f"{where}: {key} must be a positive number, got {value!r}")
    if not math.isfinite(value):
        raise ConfigError(f"{where}: {key} must be finite, got {value!r}")
    return float(value)


def _memory_mb(env: Mapping[str, Any], where: str) -> int:
    if "memory_mb" in env:
        return int(_number(env, "memory_mb", where, 2048))
    text = env.get("memory")
    if text is None:
        return 2048
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConfigError(f"{where}: memory must look like '2G' or '512M', got {text!r}")
    scale = {"": 1 / (1 << 20), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1 << 20}
    return max(16, int(float(m.group(1)) * scale[m.group(2).upper()]))


def _user(table: Mapping[str, Any], where: str, default: str) -> str:
    value = table.get("user", default)
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not re.fullmatch(r"[A-Za-z0-9_.-]+(:[A-Za-z0-9_.-]+)?", value):
        raise ConfigError(f"{where}: user must be a user name or uid[:gid], got {value!r}")
    return value


def read_config(path: Path) -> TaskConfig:
    """``path`` (a ``task.toml``) as a :class:`TaskConfig`; bad values name the file and key."""
    where = str(path)
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{where} is not valid TOML: {e}") from None
    agent, verifier, env = (data.get(k, {}) for k in ("agent", "verifier", "environment"))
    for name, table in (("agent", agent), ("verifier", verifier), ("environment", env)):
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: [{name}] must be a table, got {table!r}")
    venv = verifier.get("env", {})
    if not isinstance(venv, dict) or not all(isinstance(v, str) for v in venv.values()):
        raise ConfigError(f"{where}: [verifier] env must map names to strings, got {venv!r}")
    image = env.get("docker_image")
    if image is not None and not isinstance(image, str):
        raise ConfigError(f"{where}: [environment] docker_image must be a string, got {image!r}")
    return TaskConfig(
        agent_timeout_s=_number(agent, "timeout_sec", f"{where} [agent]", 600.0),
        agent_user=_user(agent, f"{where} [agent]", AGENT_USER),
        verifier_timeout_s=_number(verifier, "timeout_sec", f"{where} [verifier]", 600.0),
        verifier_user=_user(verifier, f"{where} [verifier]", "root"),
        verifier_env=dict(venv),
        build_timeout_s=_number(env, "build_timeout_sec", f"{where} [environment]", 600.0),
        cpus=_number(env, "cpus", f"{where} [environment]", 1.0),
        memory_mb=_memory_mb(env, f"{where} [environment]"),
        docker_image=image,
    )


def load_task(path: str | Path) -> HarborTask:
    """Read one task directory; a missing required file is refused, naming it."""
    path = Path(path)
    for required in ("instruction.md", "tests/test.sh"):
        if not (path / required).is_file():
            raise ConfigError(
                f"Harbor task {path.name!r} ({path}) has no {required}: every task needs "
                "instruction.md, task.toml, environment/Dockerfile and tests/test.sh"
            )
    toml = path / "task.toml"
    config = read_config(toml) if toml.is_file() else TaskConfig()
    if not (path / "environment" / "Dockerfile").is_file() and config.docker_image is None:
        raise ConfigError(
            f"Harbor task {path.name!r} ({path}) has no environment/Dockerfile and no "
            "[environment] docker_image in task.toml: give it one of them"
        )
    tests_dir = path / "tests"
    tests = {
        f.relative_to(tests_dir).as_posix(): f.read_bytes()
        for f in sorted(tests_dir.rglob("*"))
        if f.is_file()
    }
    solve = path / "solution" / "solve.sh"
    return HarborTask(
        name=path.name,
        path=path,
        instruction=(path / "instruction.md").read_text(),
        config=config,
        tests=tests,
        solution=solve.read_text() if solve.is_file() else None,
    )


def load_tasks(directory: str | Path = DEFAULT_TASKS) -> list[HarborTask]:
    """Every task in ``directory`` (a directory of task directories, or one task), by name."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"Harbor task directory {str(directory)!r} does not exist")
    if (directory / "instruction.md").is_file() or (directory / "task.toml").is_file():
        return [load_task(directory)]
    dirs = sorted(d for d in directory.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not dirs:
        raise ConfigError(f"{str(directory)!r} holds no Harbor task directories")
    return [load_task(d) for d in dirs]


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Verdict:
    """What the task's tests said: the reward, and how it was found (or why it is 0)."""

    reward: float
    reason: str
    exit_code: int
    timed_out: bool
    output: str

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def format_output(r: Result, max_chars: int) -> str:
    """A command's outcome as the agent reads it: output, errors, status; long output cut."""
    text = r.stdout + r.stderr
    half, cut = max_chars // 2, len(text) > max_chars
    if cut:
        text = text[:half] + "\n[... output cut ...]\n" + text[-half:]
    if cut or r.stdout_truncated or r.stderr_truncated:
        text += "\n[output truncated]"
    status = ""
    if r.timed_out:
        status = f"[killed: timed out after {r.duration_s:.0f} s]"
    elif r.oom_killed:
        status = "[killed: out of memory]"
    elif r.error:
        status = f"[error: {r.error}]"
    elif r.exit_code != 0:
        status = f"[exit status {r.exit_code}]"
    return "\n".join(p for p in (text.rstrip("\n"), status) if p) or "(no output)"


class TaskSession:
    """One task's container for one episode: the agent's ``bash`` and then the tests.

    Made by :meth:`HarborEnv.session`; usable by any agent (a black-box harness too).
    """

    def __init__(self, task: HarborTask, container: Container, *, deadline: float) -> None:
        self.task = task
        self.container = container
        self.deadline = deadline

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    async def bash(self, command: str, *, timeout_s: float) -> Result:
        """Run ``command`` with ``bash -c`` as the agent (never past the agent's deadline)."""
        limit = max(0.1, min(timeout_s, self.time_left()))
        return await self.container.exec(["bash", "-c", command], timeout_s=limit)

    async def verify(self) -> Verdict:
        """Run the task's tests in a step the agent cannot reach; the reward they wrote.

        A container that no longer runs (the agent broke it) scores 0, with the reason.
        """
        box, cfg = self.container, self.task.config
        try:
            await box.kill_all()
            await box.put({"/tests": self.task.tests, "/logs/verifier": {}})
            if cfg.verifier_user not in ("root", "0", "0:0"):
                chown = ["chown", cfg.verifier_user, "/logs/verifier"]
                await box.exec(chown, user="0", timeout_s=30)
            r = await box.exec(
                ["bash", "/tests/test.sh"],
                user=cfg.verifier_user,
                env=cfg.verifier_env,
                timeout_s=cfg.verifier_timeout_s,
                output_bytes=1 << 16,
            )
            await box.kill_all()
        except SandboxError as e:
            why = f"the tests could not run: the container is broken ({e})"
            return Verdict(reward=0.0, reason=why, exit_code=-1, timed_out=False, output="")
        if r.timed_out:
            reward, reason = 0.0, f"test.sh timed out after {cfg.verifier_timeout_s:g} s"
        else:
            reward, reason = await self._read_reward()
        output = (r.stdout + r.stderr)[-2000:]
        return Verdict(
            reward=reward,
            reason=reason,
            exit_code=r.exit_code,
            timed_out=r.timed_out,
            output=output,
        )

    async def _read_reward(self) -> tuple[float, str]:
        raw = await self.container.read("/logs/verifier/reward.json")
        if raw is not None:
            try:
                data = json.loads(raw)
            except ValueError:
                return 0.0, f"reward.json is not JSON: {raw[:80]!r}"
            value = data.get("reward") if isinstance(data, dict) else data
            return _reward(value, "reward.json")
        raw = await self.container.read("/logs/verifier/reward.txt")
        if raw is not None:
            try:
                return _reward(float(raw.decode(errors="replace").strip()), "reward.txt")
            except ValueError:
                return 0.0, f"reward.txt does not hold a number: {raw[:80]!r}"
        return 0.0, "test.sh wrote no /logs/verifier/reward.txt or reward.json"


def _reward(value: Any, source: str) -> tuple[float, str]:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return 0.0, f"{source} does not hold a finite number: {value!r}"
    return float(value), f"from {source}"


class HarborEnv(ToolEnv):
    """Harbor-format tasks, one container per episode, the agent acting through ``bash``.

    Args:
        path: a directory of task directories, or one task (default: the bundled tasks).
        max_turns: model turns per episode.
        command_timeout_s: wall-clock limit of one ``bash`` call.
        output_chars: characters of a call's output the agent reads (middle cut out).
        pids: processes the container may hold at once.
        tmp_mb: size of the container's ``/tmp``.
        max_containers: task containers alive at once (episodes past it wait to start);
            default: twice the CPU count.
    """

    name = "harbor"
    system_prompt: ClassVar[str] = SYSTEM_PROMPT

    def __init__(
        self,
        path: str | Path = DEFAULT_TASKS,
        *,
        max_turns: int = 30,
        command_timeout_s: float = 60.0,
        output_chars: int = 4000,
        pids: int = 256,
        tmp_mb: int = 256,
        max_containers: int | None = None,
    ) -> None:
        if max_turns < 1:
            raise ConfigError(f"max_turns must be at least 1, got {max_turns}")
        if not command_timeout_s > 0:
            raise ConfigError(f"command_timeout_s must be positive, got {command_timeout_s}")
        if output_chars < 100:
            raise ConfigError(f"output_chars must be at least 100, got {output_chars}")
        self.harbor_tasks = {t.name: t for t in load_tasks(path)}
        self.max_turns = max_turns  # type: ignore[misc]
        self.command_timeout_s = command_timeout_s
        self.output_chars = output_chars
        self.pids = pids
        self.tmp_mb = tmp_mb
        self._images: dict[str, str] = {}
        self._build_errors: dict[str, str] = {}
        self._locks: dict[tuple[int, str], asyncio.Lock] = {}
        self.max_containers = max_containers or 2 * (os.cpu_count() or 1)
        if self.max_containers < 1:
            raise ConfigError(f"max_containers must be at least 1, got {max_containers}")
        self._slots: dict[int, asyncio.Semaphore] = {}
        self._sessions: dict[int, TaskSession] = {}  # by id(episode)
        self.tools = (self._bash_tool(),)  # type: ignore[misc]  # (ToolEnv's are the class's)
        self.rubric = Rubric(self.tests_reward)

    def tasks(self, split: str = "train") -> list[Task]:
        """Every task (the directory is one split: ``train`` and ``test`` are the same)."""
        if split not in ("train", "test"):
            raise ValueError(f"split must be 'train' or 'test', got {split!r}")
        return [
            Task(id=t.name, prompt=t.instruction, info={"harbor_task": t.name})
            for t in self.harbor_tasks.values()
        ]

    async def image(self, task: HarborTask) -> str:
        """The task's image, built on first use (once per content hash); a failed build
        raises :class:`HarborBuildError` naming the task, every time it is asked for."""
        key = (id(asyncio.get_running_loop()), task.name)
        async with self._locks.setdefault(key, asyncio.Lock()):
            if task.name in self._images:
                return self._images[task.name]
            if task.name in self._build_errors:
                raise HarborBuildError(self._build_errors[task.name])
            if not task.dockerfile.is_file():
                assert task.config.docker_image is not None
                tag = task.config.docker_image
            else:
                try:
                    tag = await build_image(
                        task.path / "environment",
                        task.image_tag(),
                        timeout_s=task.config.build_timeout_s,
                    )
                except SandboxError as e:
                    message = f"Harbor task {task.name!r}: its image did not build: {e}"
                    self._build_errors[task.name] = message
                    raise HarborBuildError(message) from None
            self._images[task.name] = tag
            return tag

    async def build_all(self) -> dict[str, str | None]:
        """Build every task's image now: task name -> None, or why it did not build."""
        out: dict[str, str | None] = {}
        for task in self.harbor_tasks.values():
            try:
                await self.image(task)
                out[task.name] = None
            except HarborBuildError as e:
                out[task.name] = str(e)
        return out

    @asynccontextmanager
    async def session(self, name: str) -> AsyncIterator[TaskSession]:
        """A started container of task ``name``, removed on exit."""
        task = self.harbor_tasks.get(name)
        if task is None:
            raise ConfigError(f"no Harbor task {name!r}; tasks: {sorted(self.harbor_tasks)}")
        image = await self.image(task)
        cfg = task.config
        limits = Limits(
            timeout_s=self.command_timeout_s,
            cpus=min(cfg.cpus, float(os.cpu_count() or 1)),  # Docker refuses more than exist
            memory_mb=cfg.memory_mb,
            pids=self.pids,
            tmpfs_mb=self.tmp_mb,
            output_bytes=max(self.output_chars * 4, 1 << 16),
        )
        container = Container(image, limits=limits, user=cfg.agent_user, host_usr=task.host_usr())
        # This event loop's bound on containers alive at once.
        slot = self._slots.setdefault(
            id(asyncio.get_running_loop()), asyncio.Semaphore(self.max_containers)
        )
        async with slot:
            await container.start()
            try:
                yield TaskSession(task, container, deadline=time.monotonic() + cfg.agent_timeout_s)
            finally:
                # Shielded: an episode cancelled (timed out) still removes its container.
                await asyncio.shield(container.aclose())

    def _bash_tool(self) -> Tool:
        async def bash(command: str, state: State) -> str:
            """Run a bash command line in the task's machine and return its output.

            Args:
                command: the command line (run with bash -c in the working directory).
            """
            session = self._sessions[id(state.episode)]
            result = await session.bash(command, timeout_s=self.command_timeout_s)
            return format_output(result, self.output_chars)

        return Tool(bash, name="bash", timeout_s=self.command_timeout_s + 60)

    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        name = str(task.info.get("harbor_task", task.id))
        async with self.session(name) as session:
            self._sessions[id(episode)] = session
            try:
                return await super().rollout(task, episode)
            finally:
                del self._sessions[id(episode)]

    async def respond(self, task: Task, state: State) -> Sequence[Message] | None:
        """The ``bash`` calls' results; past the task's agent time the episode ends
        truncated (a turn that reached ``max_turns`` ends on that limit first)."""
        replies = await super().respond(task, state)
        session = self._sessions[id(state.episode)]
        limit = state.episode.limits.max_turns or self.max_turns
        if replies is not None and state.turns < limit and session.time_left() <= 0:
            raise EpisodeTruncated(f"agent timeout: {session.task.config.agent_timeout_s:g} s")
        return replies

    async def tests_reward(self, task: Task, state: State) -> float:
        """The task's tests' reward; their verdict goes to ``metadata["verifier"]``."""
        verdict = await self._sessions[id(state.episode)].verify()
        state.info.setdefault("tool_calls", 0)
        state.info.setdefault("tool_errors", 0)
        state.info["harbor_task"] = str(task.info.get("harbor_task", task.id))
        state.info["verifier"] = verdict.to_json()
        return verdict.reward
