"""``--rm-type remote_rm``: the reward from an HTTP service, slime's request and response.

Each response is POSTed as JSON ``{"prompt": ..., "response": ..., "label": ...}`` to the
URL; the service answers with a number, or a JSON object whose ``reward_key`` field is
the number. Failed requests (connection errors, 5xx, timeouts) are retried with
exponential backoff; what still fails is a :class:`~agentenv.RewardError` (the episode's
sample fails with that reason).
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from agentenv._errors import ConfigError, RewardError
from agentenv._rewards import check_reward

if TYPE_CHECKING:
    from agentenv._environment import Task
    from agentenv._rewards import State

__all__ = ["RemoteReward"]


class RemoteReward:
    """A reward function ``(task, state) -> float`` that asks ``url`` (see the module
    docstring). ``prompt`` is the task's prompt (a string or chat messages), ``response``
    the last assistant message, ``label`` the task's answer."""

    __name__ = "remote_rm"

    def __init__(
        self,
        url: str,
        *,
        reward_key: str | None = None,
        timeout_s: float = 120.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_connections: int = 64,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--rm-url must start with http:// or https://, got {url!r}")
        if max_retries < 0:
            raise ConfigError(f"max_retries must be at least 0, got {max_retries}")
        self.url = url
        self.reward_key = reward_key
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self._limits = httpx.Limits(max_connections=max_connections)
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, task: Task, state: State) -> float:
        payload = {"prompt": task.prompt, "response": state.completion, "label": task.answer}
        return self.read(await self.post(payload))

    async def post(self, payload: dict[str, Any]) -> Any:
        """The service's JSON answer to ``payload``, retried as the module says."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, limits=self._limits)
        error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await anyio.sleep(self.backoff_s * 2 ** (attempt - 1) * (1 + random.random()))
            try:
                response = await self._client.post(self.url, json=payload)
            except httpx.HTTPError as e:
                error = e
                continue
            if response.status_code >= 500:
                error = RewardError(f"HTTP {response.status_code}: {response.text[:200]}")
                continue
            if response.status_code >= 400:  # the request is wrong: retrying will not help
                raise RewardError(
                    f"remote_rm {self.url}: HTTP {response.status_code}: {response.text[:200]}"
                )
            try:
                return response.json()
            except ValueError:
                raise RewardError(
                    f"remote_rm {self.url}: the answer is not JSON: {response.text[:200]!r}"
                ) from None
        raise RewardError(
            f"remote_rm {self.url}: failed after {self.max_retries + 1} attempts: "
            f"{type(error).__name__}: {error}"
        )

    def read(self, answer: Any) -> float:
        """The reward in the service's answer (a number, or ``answer[reward_key]``)."""
        if isinstance(answer, dict):
            if self.reward_key is None:
                raise RewardError(
                    f"remote_rm {self.url} answered an object (keys: {sorted(answer)}); pass "
                    "--reward-key naming its reward field"
                )
            if self.reward_key not in answer:
                raise RewardError(
                    f"remote_rm {self.url}: the answer has no {self.reward_key!r} "
                    f"(--reward-key); keys: {sorted(answer)}"
                )
            answer = answer[self.reward_key]
        return check_reward(answer, f"remote_rm {self.url}")

    async def aclose(self) -> None:
        """Close the HTTP connections."""
        if self._client is not None:
            await self._client.aclose()
            self._client = None
