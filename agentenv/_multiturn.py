"""Conveniences on top of :class:`Environment`: single-turn, multi-turn and tool-use.

:class:`MultiTurnEnv` runs the loop every chat environment needs -- generate, let the
environment answer, repeat until it says done or a limit is hit -- and scores the episode
with a :class:`Rubric`. :class:`SingleTurnEnv` stops after the first answer.
:class:`ToolEnv` answers tool calls with the results of its ``@tool`` functions.
"""

from __future__ import annotations

import abc
import contextlib
import contextvars
import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar

from agentenv._environment import Environment, Episode, Task
from agentenv._errors import ConfigError, EpisodeAborted, EpisodeTruncated, ToolCallError
from agentenv._mcp import MCPServer
from agentenv._messages import Message
from agentenv._rewards import NO_RUBRIC, Rubric, State, check_rubric
from agentenv._sample import JSONValue, Sample, Status
from agentenv._tools import (
    HermesParser,
    Tool,
    ToolCall,
    ToolCallParser,
    run_tool_calls,
)

__all__ = ["MultiTurnEnv", "SingleTurnEnv", "ToolEnv"]


class MultiTurnEnv(Environment):
    """The environment answers each assistant turn until :meth:`respond` returns ``None``.

    Class attributes (override them):
        system_prompt: prepended as a system message when set.
        max_turns: model turns per episode; more ends the episode as truncated.
        rubric: scores the episode (required: a run refuses an environment without one;
            ``Rubric()`` set on purpose scores every sample 0).
        sampling: this environment's defaults of the run's sampling parameters (what the
            run is given explicitly wins: :func:`~agentenv.resolve_sampling`).

    ``respond`` (and ``rollout``, ``score_group``) must be ``async def``: a class that
    defines one without ``async`` is refused where it is defined.
    """

    system_prompt: ClassVar[str | None] = None
    max_turns: ClassVar[int] = 10
    rubric: Rubric = NO_RUBRIC
    _async_methods: ClassVar[tuple[str, ...]] = (*Environment._async_methods, "respond")

    def check(self) -> None:
        super().check()
        # ToolEnv's rollout opens its MCP servers around this one: it scores the same way.
        if type(self).rollout in (MultiTurnEnv.rollout, ToolEnv.rollout):
            check_rubric(self)

    def prompt(self, task: Task) -> list[Message]:
        """The opening messages of ``task`` (default: system prompt + ``task.prompt``)."""
        msgs: list[Message] = []
        if self.system_prompt:
            msgs.append({"role": "system", "content": self.system_prompt})
        if isinstance(task.prompt, str):
            msgs.append({"role": "user", "content": task.prompt})
        else:
            msgs.extend(dict(m) for m in task.prompt)  # type: ignore[misc]
        return msgs

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        """Tool schemas offered through the chat template (default: none)."""
        return None

    @abc.abstractmethod
    async def respond(self, task: Task, state: State) -> Sequence[Message] | str | None:
        """The environment's answer to the last assistant turn; ``None`` ends the episode."""

    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        transcript = episode.transcript(self.prompt(task), tools=self.tool_schemas())
        state = State(task, transcript, episode)
        status, reason = Status.COMPLETED, None
        try:
            while True:
                await episode.generate(transcript, max_turns=self.max_turns)
                if transcript.last_finish is not None and transcript.last_finish.type == "length":
                    status, reason = Status.TRUNCATED, "length: hit max_new_tokens"
                    break
                reply = await self.respond(task, state)
                if reply is None:
                    break
                limit = episode.limits.max_turns or self.max_turns
                if transcript.turns >= limit:
                    status, reason = Status.TRUNCATED, f"max_turns: reached {limit} turns"
                    break
                transcript.add_messages(reply)
        except EpisodeTruncated as e:
            status, reason = Status.TRUNCATED, e.reason
        except EpisodeAborted as e:
            status, reason = Status.ABORTED, str(e)
        total, parts = await self.rubric.score(task, state)
        metadata: dict[str, JSONValue] = {"rewards": parts}
        metadata.update(state.info)
        return episode.samples(transcript, total, status=status, reason=reason, metadata=metadata)

    async def score_group(self, task: Task, samples: Sequence[Sample]) -> Sequence[Sample]:
        if not self.rubric.group:
            return samples
        bonus = await self.rubric.score_group(task, samples)
        return [
            dataclasses.replace(s, reward=s.reward + b) if b else s
            for s, b in zip(samples, bonus, strict=True)
        ]


class SingleTurnEnv(MultiTurnEnv):
    """Prompt, one completion, reward."""

    max_turns: ClassVar[int] = 1

    async def respond(self, task: Task, state: State) -> None:
        return None


class ToolEnv(MultiTurnEnv):
    """The model calls ``tools``; the episode ends at the first turn without a tool call.

    Class attributes:
        tools: the :class:`Tool` objects offered.
        mcp_servers: :class:`~agentenv.MCPServer` objects whose tools are offered too
            (their tool lists are read from the servers when an episode starts; a name
            offered twice is refused: give a server a ``prefix``).
        parser: finds calls in the model's text (default Hermes ``<tool_call>``).
    Counts of calls and errors go to ``metadata["tool_calls"]`` / ``["tool_errors"]``. A
    tool parameter annotated :class:`Task` or :class:`State` gets the episode's (see
    :mod:`agentenv._tools`), so one class-level tool serves every concurrent episode.
    """

    tools: ClassVar[Sequence[Tool]] = ()
    mcp_servers: ClassVar[Sequence[MCPServer]] = ()
    parser: ClassVar[ToolCallParser] = HermesParser()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "tools" in cls.__dict__:
            _check_tools(cls.__name__, cls.__dict__["tools"])
        if "mcp_servers" in cls.__dict__:
            _check_mcp_servers(cls.__name__, cls.__dict__["mcp_servers"])

    def check(self) -> None:
        super().check()
        _check_tools(type(self).__name__, self.tools)
        _check_mcp_servers(type(self).__name__, self.mcp_servers)

    def episode_tools(self) -> Sequence[Tool]:
        """The tools of the episode running now: :attr:`tools` and its MCP servers' tools."""
        tools = _EPISODE_TOOLS.get()
        return self.tools if tools is None else tools

    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        if not self.mcp_servers:
            return await super().rollout(task, episode)
        async with contextlib.AsyncExitStack() as stack:
            tools: list[Tool] = list(self.tools)
            for server in self.mcp_servers:
                tools.extend(await stack.enter_async_context(server.open()))
            _check_unique(type(self).__name__, tools)
            token = _EPISODE_TOOLS.set(tuple(tools))
            try:
                return await super().rollout(task, episode)
            finally:
                _EPISODE_TOOLS.reset(token)

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        episode_tools = _EPISODE_TOOLS.get()
        if episode_tools is not None:  # read from the MCP servers for this episode
            return [t.schema for t in episode_tools] or None
        # Built once per environment: every episode offers the same tools.
        cached: list[dict[str, Any]] | None = self.__dict__.get("_tool_schemas")
        if cached is None:
            cached = [t.schema for t in self.tools]
            self.__dict__["_tool_schemas"] = cached
        return cached or None

    async def respond(self, task: Task, state: State) -> Sequence[Message] | None:
        calls = self.parser.parse(state.completion)
        if not calls:
            return None
        info = state.info
        info["tool_calls"] = int(info.get("tool_calls", 0)) + len(calls)

        def count(call: ToolCall | ToolCallError, text: str, ok: bool) -> None:
            if not ok:
                info["tool_errors"] = int(info.get("tool_errors", 0)) + 1

        return await run_tool_calls(calls, self.episode_tools(), on_result=count, state=state)


# The tools of the ToolEnv episode running in this task, when its class has MCP servers:
# their tools are known only once the servers are open, and differ per episode for
# per-episode servers. ``respond`` runs in the task of its ``rollout``, so it sees them.
_EPISODE_TOOLS: contextvars.ContextVar[tuple[Tool, ...] | None] = contextvars.ContextVar(
    "agentenv_episode_tools", default=None
)


def _check_mcp_servers(owner: str, servers: Any) -> None:
    """Refuse ``servers`` unless it is a sequence of :class:`MCPServer`."""
    if isinstance(servers, MCPServer | str) or not isinstance(servers, Sequence):
        raise ConfigError(
            f"{owner}.mcp_servers must be a tuple of MCPServer, got {type(servers).__name__}; "
            "write mcp_servers = (MCPServer(['python', 'server.py']),)"
        )
    for item in servers:
        if not isinstance(item, MCPServer):
            raise ConfigError(
                f"{owner}.mcp_servers holds {type(item).__name__} {item!r}, which is not an "
                "MCPServer; write MCPServer(command=[...]) or MCPServer(url=...)"
            )


def _check_unique(owner: str, tools: Sequence[Tool]) -> None:
    """Refuse two tools of one name: the model could not say which it calls."""
    by_name: dict[str, Tool] = {}
    for t in tools:
        other = by_name.setdefault(t.name, t)
        if other is not t:
            raise ConfigError(
                f"{owner} offers two tools named {t.name!r} ({other!r} and {t!r}); rename "
                "the local one (@tool(name=...)) or give the MCP server a prefix "
                "(MCPServer(..., prefix='srv_'))"
            )


def _check_tools(owner: str, tools: Any) -> None:
    """Refuse ``tools`` unless it is a sequence of :class:`Tool` (``@tool`` functions)."""
    if isinstance(tools, Tool) or callable(tools) or not isinstance(tools, Sequence):
        raise ConfigError(
            f"{owner}.tools must be a tuple of @tool functions, got {type(tools).__name__}; "
            "write tools = (my_tool,)"
        )
    for item in tools:
        if not isinstance(item, Tool):
            name = getattr(item, "__name__", None) or type(item).__name__
            fix = (
                f"decorate it with @tool (from agentenv import tool; @tool above `def {name}`)"
                if callable(item)
                else "pass @tool functions"
            )
            raise ConfigError(f"{owner}.tools holds {name!r}, which is not a Tool: {fix}")
