""":class:`AgentEnv`: train an agent written against the OpenAI API (or Anthropic's
Messages API), unchanged.

The agent gets an ``openai.AsyncOpenAI`` (an ``anthropic.AsyncAnthropic``, or the base
URL) pointed at its episode's
endpoint; every call it makes becomes transcript turns, token-exact; its final answer and
the recorded state are scored by the rubric, and every segment becomes a sample.
"""

from __future__ import annotations

import abc
from typing import Any, ClassVar, Literal

import anyio

from agentenv._environment import Environment, Episode, Task
from agentenv._errors import ConfigError, short_repr
from agentenv._rewards import NO_RUBRIC, Rubric, State, check_rubric
from agentenv._sample import JSONValue, Sample, Status
from agentenv._tools import HermesParser, ToolCallParser
from agentenv.endpoint._server import (
    BODY_TIMEOUT_S,
    MAX_BODY_BYTES,
    MAX_REQUESTS_PER_ENDPOINT,
    AgentServer,
    Endpoint,
)

__all__ = ["AgentEnv"]


class AgentEnv(Environment):
    """An environment whose episodes are an OpenAI-API agent's runs.

    Write :meth:`run_agent`: it gets a client of the episode's endpoint (``client_kind``)
    and returns the agent's final answer, which reward functions see as
    ``state.info["answer"]`` (``None`` when a limit ended the run; the last transcript is
    ``state.transcript``). An agent that raises, runs past ``timeout_s`` or never calls the
    endpoint is a failed sample naming the reason (docs/agents.md).

    Class attributes:
        rubric: scores the episode (required; ``Rubric()`` on purpose scores 0).
        model: the model name the endpoint reports.
        max_turns: model calls per transcript (``None``: the run's limit only).
        timeout_s: wall-clock limit of one agent run.
        request_sampling: honour the calls' ``temperature``/``top_p``/``seed``.
        parser: finds tool calls in the model's text (Hermes ``<tool_call>``).
        client_kind: ``"openai"`` (an ``AsyncOpenAI``), ``"anthropic"`` (an
            ``AsyncAnthropic``), ``"base_url"`` or ``"endpoint"``.
        max_body_bytes, body_timeout_s, max_requests_per_endpoint: the endpoints' bounds
            (:class:`~agentenv.endpoint.AgentServer`).
    """

    rubric: Rubric = NO_RUBRIC
    model: ClassVar[str] = "policy"
    max_turns: ClassVar[int | None] = None
    timeout_s: ClassVar[float | None] = None
    request_sampling: ClassVar[bool] = False
    parser: ClassVar[ToolCallParser] = HermesParser()
    client_kind: ClassVar[Literal["openai", "anthropic", "base_url", "endpoint"]] = "openai"
    max_body_bytes: ClassVar[int] = MAX_BODY_BYTES
    body_timeout_s: ClassVar[float] = BODY_TIMEOUT_S
    max_requests_per_endpoint: ClassVar[int] = MAX_REQUESTS_PER_ENDPOINT
    _async_methods: ClassVar[tuple[str, ...]] = (*Environment._async_methods, "run_agent")

    def check(self) -> None:
        super().check()
        check_rubric(self)
        if self.client_kind not in ("openai", "anthropic", "base_url", "endpoint"):
            raise ConfigError(
                "client_kind must be 'openai', 'anthropic', 'base_url' or 'endpoint', got "
                f"{self.client_kind!r}"
            )

    @abc.abstractmethod
    async def run_agent(self, task: Task, client: Any) -> str:
        """Run the agent on ``task`` through ``client``; return its final answer."""

    def agent_server(self) -> AgentServer:
        """The loopback server of this environment's endpoints (made on first use)."""
        server: AgentServer | None = self.__dict__.get("_agent_server")
        if server is None:
            server = AgentServer(
                model=self.model,
                parser=self.parser,
                request_sampling=self.request_sampling,
                max_turns=self.max_turns,
                max_body_bytes=self.max_body_bytes,
                body_timeout_s=self.body_timeout_s,
                max_requests_per_endpoint=self.max_requests_per_endpoint,
            )
            self.__dict__["_agent_server"] = server
        return server

    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        async with self.agent_server().open(episode) as endpoint:
            client: Any = endpoint
            if self.client_kind == "openai":
                client = endpoint.client()
            elif self.client_kind == "anthropic":
                client = endpoint.anthropic_client()
            elif self.client_kind == "base_url":
                client = endpoint.base_url
            answer = await self._run(task, client, endpoint)
            recorders = endpoint.recorders()
            status, reason = endpoint.outcome()
        if sum(r.calls for r in recorders) == 0:
            raise ConfigError(
                f"the agent never called its endpoint ({endpoint.base_url}); point its OpenAI "
                "client at the client or base URL run_agent was given"
            )
        if not episode.transcripts:
            raise ConfigError(f"no call of the agent was answered: {reason or 'no reason'}")
        info: dict[str, JSONValue] = {
            "answer": answer,
            "calls": sum(r.calls for r in recorders),
            "refused_calls": sum(r.refused for r in recorders),
            "tool_calls": sum(r.tool_calls for r in recorders),
            "tool_call_errors": sum(r.tool_call_errors for r in recorders),
        }
        state = State(task, episode.transcripts[-1], episode, info)
        total, parts = await self.rubric.score(task, state)
        metadata: dict[str, JSONValue] = {"rewards": parts}
        metadata.update(state.info)
        metadata.pop("answer", None)  # the samples' ids hold it
        out: list[Sample] = []
        for t in episode.transcripts:
            out.extend(episode.samples(t, total, status=status, reason=reason, metadata=metadata))
        return out

    async def _run(self, task: Task, client: Any, endpoint: Endpoint) -> str | None:
        deadline: anyio.CancelScope | None = None
        try:
            if self.timeout_s is None:
                answer = await self.run_agent(task, client)
            else:
                with anyio.fail_after(self.timeout_s) as deadline:
                    answer = await self.run_agent(task, client)
        except TimeoutError:
            if deadline is not None and deadline.cancelled_caught:
                raise TimeoutError(f"the agent ran past its timeout_s={self.timeout_s} s") from None
            raise
        except Exception:
            # A refused call the agent did not survive: the limit, not the agent, ended it.
            if endpoint.outcome()[0] is not Status.COMPLETED:
                return None
            raise
        if answer is not None and not isinstance(answer, str):
            raise ConfigError(
                f"{type(self).__name__}.run_agent must return the final answer as a str, "
                f"got {type(answer).__name__} {short_repr(answer)}"
            )
        return answer
