"""Text-level models: an OpenAI-compatible chat completions API (vLLM, a hosted API).

Every other generator is token-in, token-out. A chat completions API takes messages and
answers text, so :class:`OpenAIChatModel` plays in any environment by sending the
transcript's messages and appending the reply *re-tokenized* with the local tokenizer:
enough to evaluate a model, not to train on it (the ids are not the ones it sampled, and
there are no log-probs). Its samples carry ``metadata["token_exact"] = False`` and the
trainer refuses such a policy (docs/guide.md, "Evaluating").

    async with OpenAIChatModel("http://127.0.0.1:8000/v1", tokenizer=tok) as model:
        stats = await run_rollouts(env, tasks, model, sink=sink)"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import anyio

from agentenv._errors import ConfigError, GenerationError
from agentenv._generator import Completion, FinishReason, SamplingParams
from agentenv._messages import Message
from agentenv._tokenizer import Tokenizer

if TYPE_CHECKING:
    import httpx

__all__ = ["OpenAIChatModel", "TextGenerator"]

MAX_RESPONSE_BYTES = 16 << 20  # one answer's body; a reply is text of max_tokens tokens
REQUEST_TIMEOUT_S = 300.0  # one request, the whole generation included
RETRIES = 3  # after a connection error, a 429 or a 5xx answer (1, 2, 4 s apart)
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


@runtime_checkable
class TextGenerator(Protocol):
    """A model that takes chat messages and answers text (not token ids): its
    :class:`~agentenv.Completion` holds the reply tokenized locally and no log-probs, so
    the samples it plays are marked ``metadata["token_exact"] = False``."""

    async def generate_chat(
        self,
        messages: Sequence[Message],
        params: SamplingParams,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        rid: str | None = None,
    ) -> Completion:
        """The model's reply to ``messages``, as a completion of local token ids."""
        ...


class OpenAIChatModel:
    """A model behind an OpenAI-compatible ``/chat/completions`` API, for evaluation.

    Args:
        base_url: the API's base, e.g. ``http://127.0.0.1:8000/v1`` (vLLM) or
            ``https://api.openai.com/v1``; requests go to ``{base_url}/chat/completions``.
        tokenizer: renders the transcripts (context budgets count its tokens) and
            re-tokenizes each reply: the samples' ids are this tokenizer's, not the
            served model's.
        model: the served model's name; default: the only one ``{base_url}/models`` lists.
        api_key: sent as ``Authorization: Bearer <key>``.
        timeout: seconds one request may take, the whole generation included.
        max_connections: requests in flight at once.

    Sampling: ``max_new_tokens``, ``temperature``, ``top_p``, ``seed`` and ``stop`` are
    sent (as ``max_tokens``, ...); ``top_k``, ``min_p``, ``min_new_tokens`` and
    ``ignore_eos`` are sent as vLLM's extra parameters only when they differ from the
    defaults (a hosted API may refuse them). Use as an async context manager.
    """

    def __init__(
        self,
        base_url: str,
        *,
        tokenizer: Tokenizer,
        model: str | None = None,
        api_key: str | None = None,
        timeout: float = REQUEST_TIMEOUT_S,
        max_connections: int = 256,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ConfigError(
                f"an OpenAI-compatible API's base URL starts with http:// or https://, got "
                f"{base_url!r} (e.g. http://127.0.0.1:8000/v1)"
            )
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.model = model
        self.api_key = api_key
        self.timeout = timeout
        self.max_connections = max_connections
        self._client: httpx.AsyncClient | None = None

    async def __aenter__(self) -> OpenAIChatModel:
        import httpx

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        self._client = httpx.AsyncClient(
            headers=headers,
            timeout=httpx.Timeout(self.timeout, connect=min(self.timeout, 30.0)),
            limits=httpx.Limits(max_connections=self.max_connections),
        )
        try:
            if self.model is None:
                self.model = await self._only_model()
        except BaseException:
            await self.aclose()
            raise
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None

    async def _only_model(self) -> str:
        data = await self._request("GET", "/models", None)
        entries = data.get("data") if isinstance(data, dict) else None
        ids = [e.get("id") for e in entries or () if isinstance(e, dict)]
        names = [n for n in ids if isinstance(n, str)]
        if len(names) != 1:
            raise ConfigError(
                f"{self.base_url}/models lists {len(names)} models {names[:10]}; name one: "
                f"--model openai:{self.base_url}#<model>"
            )
        return names[0]

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        """Not available: a chat API takes messages, not token ids."""
        raise ConfigError(
            f"{type(self).__name__} is text-level: it takes chat messages, not token ids, "
            "so it plays only through Episode.generate (every bundled environment) and "
            "game opponents, not where token ids are sent to the model directly"
        )

    async def generate_chat(
        self,
        messages: Sequence[Message],
        params: SamplingParams,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        rid: str | None = None,
    ) -> Completion:
        """One chat completion; the reply re-tokenized (see the module docstring)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [dict(m) for m in messages],
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "n": 1,
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        if tools:
            body["tools"] = [dict(t) for t in tools]
        for name, default in (("top_k", -1), ("min_p", 0.0), ("ignore_eos", False)):
            if getattr(params, name) != default:
                body[name] = getattr(params, name)
        if params.min_new_tokens:
            body["min_tokens"] = params.min_new_tokens
        data = await self._request("POST", "/chat/completions", body)
        text, finish = self._reply(data)
        ids = self.tokenizer.encode(text) if text else []
        eos = self.tokenizer.eos_token_id
        if finish == "length":
            reason = FinishReason("length", length=params.max_new_tokens)
        elif eos is not None:
            # The reply ended: close it with the end-of-turn token, as a model's own
            # stop would, so the next render continues the conversation after it.
            ids.append(eos)
            reason = FinishReason("stop", matched=eos)
        else:
            reason = FinishReason("stop")
        if not ids:
            raise GenerationError(
                f"{self.base_url} answered an empty reply (finish_reason {finish!r}) and the "
                "tokenizer has no end-of-turn token to stand for it"
            )
        return Completion(output_ids=ids, logprobs=None, finish_reason=reason)

    def _reply(self, data: Any) -> tuple[str, str]:
        """The reply's text (tool calls written as ``<tool_call>`` blocks, the form the
        environments parse) and its finish reason."""
        try:
            choice = data["choices"][0]
            message = choice["message"]
            content = message.get("content") or ""
            calls = message.get("tool_calls") or []
            finish = str(choice.get("finish_reason") or "stop")
            if not isinstance(content, str):
                raise TypeError("content is not a string")
            for call in calls:
                fn = call["function"]
                args = fn.get("arguments") or "{}"
                parsed = json.loads(args) if isinstance(args, str) else args
                block = json.dumps({"name": fn["name"], "arguments": parsed})
                content += f"\n<tool_call>\n{block}\n</tool_call>"
        except (KeyError, IndexError, TypeError, AttributeError, ValueError) as e:
            raise GenerationError(
                f"{self.base_url}/chat/completions answered no chat completion "
                f"({type(e).__name__}: {e}): {json.dumps(data)[:300]}"
            ) from None
        return content, finish

    async def _request(self, method: str, path: str, body: dict[str, Any] | None) -> Any:
        import httpx

        if self._client is None:
            raise ConfigError(f"use {type(self).__name__} as `async with` (it is not open)")
        url = self.base_url + path
        for attempt in range(RETRIES + 1):
            try:
                async with self._client.stream(method, url, json=body) as response:
                    raw = bytearray()
                    async for chunk in response.aiter_bytes():
                        raw += chunk
                        if len(raw) > MAX_RESPONSE_BYTES:
                            raise GenerationError(
                                f"{url} answered more than {MAX_RESPONSE_BYTES} bytes; a chat "
                                "completion is far smaller: is this an OpenAI-compatible API?"
                            )
                    status = response.status_code
            except httpx.HTTPError as e:
                if attempt == RETRIES:
                    raise GenerationError(
                        f"{url}: {type(e).__name__}: {e or 'no answer'} (after {RETRIES + 1} "
                        "attempts)"
                    ) from None
                await anyio.sleep(2.0**attempt)
                continue
            if status in _RETRY_STATUS and attempt < RETRIES:
                await anyio.sleep(2.0**attempt)
                continue
            try:
                data = json.loads(raw)
            except ValueError:
                data = None
            if status != 200:
                error = data.get("error") if isinstance(data, dict) else None
                text = error.get("message") if isinstance(error, dict) else error
                raise GenerationError(
                    f"{url} answered {status}: {text or bytes(raw[:300]).decode(errors='replace')}"
                )
            if data is None:
                raise GenerationError(f"{url} answered 200 with a body that is not JSON")
            return data
        raise AssertionError("unreachable")  # the loop returns or raises
