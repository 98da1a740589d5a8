"""``--rm-type remote_rm``: the reward from an HTTP service, slime's request and response.

Each response is POSTed as JSON ``{"prompt", "response", "label"}``; the service answers
a number, or an object whose ``reward_key`` field is one. Connection errors and 5xx are
retried with exponential backoff; one reward is bounded by ``timeout_s`` (every attempt
and backoff included) and ``max_response_bytes``. What still fails is a
:class:`~agentenv.RewardError`: the sample fails with that reason (docs/rewards.md)."""

from __future__ import annotations

import json
import random
from typing import TYPE_CHECKING, Any

import anyio
import httpx

from agentenv._errors import ConfigError, RewardError, at_least, positive
from agentenv._rewards import check_reward

if TYPE_CHECKING:
    from agentenv._environment import Task
    from agentenv._rewards import State

__all__ = ["MAX_RESPONSE_BYTES", "TIMEOUT_S", "RemoteReward"]

TIMEOUT_S = 120.0  # one reward, retries included (--rm-timeout)
MAX_RESPONSE_BYTES = 1 << 20  # an answer is a number or a small object (--rm-max-response-bytes)


class RemoteReward:
    """A reward function ``(task, state) -> float`` that asks ``url`` (see the module
    docstring). ``prompt`` is the task's prompt (a string or chat messages), ``response``
    the last assistant message, ``label`` the task's answer. ``timeout_s``: the deadline
    of one reward, retries included; ``max_response_bytes``: the largest answer read."""

    __name__ = "remote_rm"

    def __init__(
        self,
        url: str,
        *,
        reward_key: str | None = None,
        timeout_s: float = TIMEOUT_S,
        max_response_bytes: int = MAX_RESPONSE_BYTES,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_connections: int = 64,
    ) -> None:
        if not url.startswith(("http://", "https://")):
            raise ConfigError(f"--rm-url must start with http:// or https://, got {url!r}")
        self.url = url
        self.reward_key = reward_key
        self.timeout_s = positive("--rm-timeout", timeout_s)
        self.max_response_bytes = at_least("--rm-max-response-bytes", max_response_bytes, 1)
        self.max_retries = at_least("max_retries", max_retries, 0)
        self.backoff_s = backoff_s
        self._limits = httpx.Limits(max_connections=max_connections)
        self._client: httpx.AsyncClient | None = None

    async def __call__(self, task: Task, state: State) -> float:
        payload = {"prompt": task.prompt, "response": state.completion, "label": task.answer}
        return self.read(await self.post(payload))

    async def post(self, payload: dict[str, Any]) -> Any:
        """The service's JSON answer to ``payload``, retried and bounded as the module
        says."""
        if self._client is None:
            self._client = httpx.AsyncClient(timeout=self.timeout_s, limits=self._limits)
        deadline: anyio.CancelScope | None = None
        try:
            with anyio.fail_after(self.timeout_s) as deadline:
                return await self._attempts(self._client, payload)
        except TimeoutError:
            if deadline is None or not deadline.cancelled_caught:
                raise
            raise RewardError(
                f"remote_rm {self.url}: no answer within {self.timeout_s:g} s (the deadline "
                "of one reward, retries included; raise it with --rm-timeout)"
            ) from None

    async def _attempts(self, client: httpx.AsyncClient, payload: dict[str, Any]) -> Any:
        error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                await anyio.sleep(self.backoff_s * 2 ** (attempt - 1) * (1 + random.random()))
            try:
                # identity: what is counted against the bound is what the service sent
                async with client.stream(
                    "POST", self.url, json=payload, headers={"accept-encoding": "identity"}
                ) as response:
                    body = await self._body(response)
            except httpx.HTTPError as e:
                error = e
                continue
            text = body[:200].decode("utf-8", "replace")
            if response.status_code >= 500:
                error = RewardError(f"HTTP {response.status_code}: {text}")
                continue
            if response.status_code >= 400:  # the request is wrong: retrying will not help
                raise RewardError(f"remote_rm {self.url}: HTTP {response.status_code}: {text}")
            try:
                return json.loads(body)
            except ValueError:
                raise RewardError(
                    f"remote_rm {self.url}: the answer is not JSON: {text!r}"
                ) from None
        raise RewardError(
            f"remote_rm {self.url}: failed after {self.max_retries + 1} attempts: "
            f"{type(error).__name__}: {error}"
        )

    async def _body(self, response: httpx.Response) -> bytes:
        """At most ``max_response_bytes`` of the answer; a longer one is refused."""
        cap = self.max_response_bytes
        length = response.headers.get("content-length", "")
        body = bytearray()
        if not (length.isdigit() and int(length) > cap):
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > cap:
                    break
            else:
                return bytes(body)
        raise RewardError(
            f"remote_rm {self.url}: the answer is longer than {cap} bytes; raise the bound "
            "with --rm-max-response-bytes (RemoteReward(max_response_bytes=...))"
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
