"""Chat-completion calls turned into an episode's transcripts, token-exact.

Each call's messages are matched against earlier calls' conversations (their messages and
the reply they got, as the agent saw them): a call that extends an idle one appends only
its new messages (:meth:`Transcript.add_messages`); one that holds a reply this episode
returned but does not extend its conversation rewrites history
(:meth:`Transcript.rewrite`); any other starts a transcript of its own. Replies the agent
sends back are replaced by the model's own text before rendering. See docs/agents.md."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import re
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread

from agentenv._environment import Episode
from agentenv._errors import (
    ContextLengthError,
    EpisodeAborted,
    EpisodeTruncated,
    HistoryRewriteError,
    TemplateError,
    ToolCallError,
)
from agentenv._messages import Message
from agentenv._tools import HermesParser, ToolCall, ToolCallParser
from agentenv._transcript import Transcript
from agentenv.endpoint._protocol import ChatCall, ChatError, ChatReply, Key, ReplyToolCall

__all__ = ["EpisodeRecorder"]

T = TypeVar("T")
_SEED_MASK = (1 << 63) - 1
# A call whose messages hold more characters is rendered and tokenized in a worker thread.
_THREAD_CHARS = 32768
_LIMITERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, anyio.CapacityLimiter] = (
    weakref.WeakKeyDictionary()
)


def _tokenizing() -> anyio.CapacityLimiter:
    """The worker threads long calls are tokenized in, per event loop: half the CPUs this
    process may use (at least one, at most four), so long calls never take them all."""
    loop = asyncio.get_running_loop()
    limiter = _LIMITERS.get(loop)
    if limiter is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
        limiter = anyio.CapacityLimiter(max(1, min(4, (cpus or 1) // 2)))
        _LIMITERS[loop] = limiter
    return limiter


async def _off_loop(call: ChatCall, work: Callable[[], T]) -> T:
    """``work()`` (rendering and tokenizing ``call``): a long call's in a worker thread (a
    few at a time), so that it leaves the other episodes' calls running."""
    size = len(call.tools_key) + sum(len(key[1]) for key in call.keys)
    if size < _THREAD_CHARS:
        return work()
    return await anyio.to_thread.run_sync(work, limiter=_tokenizing())


_UNANSWERED: Key = ("", "", "unanswered", ())
# Hermes calls, to cut them out of the content returned to the agent and to salvage the
# name of a call whose JSON the parser refused.
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)
_NAME = re.compile(r'"name"\s*:\s*"([^"\\]+)"')
_ARGUMENTS = re.compile(r'"(?:arguments|parameters)"\s*:\s*(.*?)\s*\}?\s*\Z', re.DOTALL)


@dataclasses.dataclass(slots=True)
class _Thread:
    """One transcript and the conversation its last call left, as the agent sees it."""

    transcript: Transcript
    tools_key: str
    view: list[Key] = dataclasses.field(default_factory=list)
    busy: bool = False


class EpisodeRecorder:
    """Serves one episode's (one role's) calls through ``episode.generate``.

    Args:
        episode: generates (its policy, limits, seed and sampling) and holds the
            transcripts.
        role: the role of every transcript made here (multi-agent episodes).
        parser: finds tool calls in the model's text (Hermes ``<tool_call>`` by default).
        request_sampling: use the call's ``temperature``, ``top_p`` and ``seed``; by
            default the run's sampling parameters win (a training run samples as it is
            configured whatever the agent asks). ``max_tokens`` (capped by the run's
            ``max_new_tokens``) and ``stop`` always apply.
        max_turns: model turns per transcript (``None``: the episode's limit only).

    Counts: ``calls`` (every request, refused ones too), ``refused`` (answered with an
    error), ``tool_calls``, ``tool_call_errors`` (malformed calls from the model).
    ``truncated`` is the reason once a call overflowed the context or the turn limit;
    ``aborted`` once the generator aborted. After :meth:`close` every call is refused
    (410).
    """

    def __init__(
        self,
        episode: Episode,
        *,
        role: str | None = None,
        parser: ToolCallParser | None = None,
        request_sampling: bool = False,
        max_turns: int | None = None,
    ) -> None:
        self.episode = episode
        self.role = role
        self.parser: ToolCallParser = parser or HermesParser()
        self.request_sampling = request_sampling
        self.max_turns = max_turns
        self.calls = 0
        self.refused = 0
        self.tool_calls = 0
        self.tool_call_errors = 0
        self.truncated: str | None = None
        self.aborted: str | None = None
        self.closed = False
        self._threads: list[_Thread] = []
        self._returned: dict[Key, tuple[_Thread, Message]] = {}
        self._scopes: set[anyio.CancelScope] = set()
        self._next_call = 0

    def close(self) -> None:
        """Refuse further calls and cancel those generating."""
        self.closed = True
        for scope in self._scopes:
            scope.cancel()

    def _check_open(self) -> None:
        if self.closed:
            raise ChatError(
                410,
                "this episode has ended; its endpoint takes no more calls",
                code="episode_ended",
            )

    async def complete(self, call: ChatCall) -> ChatReply:
        """Answer one call (:class:`ChatError` for a refused one)."""
        self._check_open()
        messages = self._template_messages(call)
        thread, mode = self._match(call)
        if thread is not None:
            thread.busy = True
        scope = anyio.CancelScope()
        self._scopes.add(scope)
        try:
            with scope:
                prepare = functools.partial(self._prepare, call, messages, thread, mode)
                thread = await _off_loop(call, prepare)
                try:
                    reply = await self._generate(call, thread)
                except BaseException:
                    # The transcript may hold this call's messages: no later call extends
                    # it as if it did not (a retry rewrites it instead).
                    thread.view = [*call.keys, _UNANSWERED]
                    raise
            if scope.cancel_called:
                raise ChatError(410, "the episode ended during this call", code="episode_ended")
        finally:
            self._scopes.discard(scope)
            if thread is not None:
                thread.busy = False
        assert thread is not None  # _prepare returned it
        thread.view = [*call.keys, reply.key]
        self._returned[reply.key] = (thread, thread.transcript.messages[-1])
        return reply

    async def count_tokens(self, call: ChatCall) -> int:
        """The tokens ``call``'s messages (and tools) take as a prompt, rendered as a call
        would be (returned replies as the model's own text); nothing is recorded."""
        self._check_open()
        messages = self._template_messages(call)
        episode = self.episode

        def count() -> int:
            kwargs = episode.chat_template_kwargs or None
            try:
                t = Transcript(
                    episode.tokenizer, messages, tools=call.tools, chat_template_kwargs=kwargs
                )
            except TemplateError as e:
                raise ChatError(400, str(e), param="messages") from None
            return t.num_tokens

        return await _off_loop(call, count)

    # -- matching ------------------------------------------------------------------------
    def _template_messages(self, call: ChatCall) -> list[Message]:
        out = list(call.messages)
        for i, key in enumerate(call.keys):
            if key[0] == "assistant":
                hit = self._returned.get(key)
                if hit is not None:
                    out[i] = hit[1]  # the model's own text, tool-call markup included
        return out

    def _match(self, call: ChatCall) -> tuple[_Thread | None, str]:
        keys = call.keys
        for thread in reversed(self._threads):
            n = len(thread.view)
            if (
                not thread.busy
                and thread.tools_key == call.tools_key
                and n <= len(keys)
                and keys[:n] == thread.view
            ):
                return thread, "extend"
        for key in reversed(keys):
            hit = self._returned.get(key) if key[0] == "assistant" else None
            if hit is not None:
                thread = hit[0]
                if not thread.busy and thread.tools_key == call.tools_key:
                    return thread, "rewrite"
                break
        return None, "new"

    def _prepare(
        self, call: ChatCall, messages: list[Message], thread: _Thread | None, mode: str
    ) -> _Thread:
        try:
            if thread is None:
                transcript = self.episode.transcript(messages, tools=call.tools, role=self.role)
                thread = _Thread(transcript, call.tools_key)
                thread.busy = True
                self._threads.append(thread)
            elif mode == "extend":
                extra = messages[len(thread.view) :]
                if extra:
                    thread.transcript.add_messages(extra)
            else:
                thread.transcript.rewrite(messages)
        except (ContextLengthError, EpisodeTruncated) as e:
            raise self._overflow(str(e)) from None
        except HistoryRewriteError as e:
            raise ChatError(400, str(e), param="messages", code="history_rewritten") from None
        return thread

    # -- generating ----------------------------------------------------------------------
    def _sampling(self, call: ChatCall) -> dict[str, Any]:
        out: dict[str, Any] = {}
        base = self.episode.sampling
        if call.max_tokens is not None and call.max_tokens < base.max_new_tokens:
            out["max_new_tokens"] = call.max_tokens
            out["min_new_tokens"] = min(base.min_new_tokens, call.max_tokens)
        if call.stop:
            out["stop"] = (*base.stop, *call.stop)
        if self.request_sampling:
            if call.temperature is not None:
                out["temperature"] = call.temperature
            if call.top_p is not None:
                out["top_p"] = call.top_p
            if call.seed is not None:
                out["seed"] = call.seed & _SEED_MASK
        return out

    async def _generate(self, call: ChatCall, thread: _Thread) -> ChatReply:
        transcript = thread.transcript
        segment = transcript.current
        start = len(segment.ids)
        try:
            message = await self.episode.generate(
                transcript, max_turns=self.max_turns, **self._sampling(call)
            )
        except EpisodeTruncated as e:
            if e.reason.startswith("context"):
                raise self._overflow(e.reason) from None
            self.truncated = self.truncated or e.reason
            raise ChatError(400, e.reason, param="messages", code="max_turns_exceeded") from None
        except EpisodeAborted as e:
            self.aborted = str(e) or "aborted"
            self.close()
            raise ChatError(
                503, f"generation was aborted: {self.aborted}", type="server_error"
            ) from None
        ids = segment.ids[start:]
        finish = transcript.last_finish
        content, calls = self._split(call, message["content"])
        stop = finish.matched if finish is not None and finish.type == "stop" else None
        if isinstance(stop, str) and content is not None and content.endswith(stop):
            content = content[: -len(stop)]  # OpenAI leaves the stop sequence out
        reason = "length" if finish is not None and finish.type == "length" else "stop"
        if calls and reason == "stop":
            reason = "tool_calls"
        decode = self.episode.tokenizer.decode
        return ChatReply(
            content=content,
            tool_calls=calls,
            finish_reason=reason,
            token_ids=ids,
            logprobs=segment.logprobs[len(segment.logprobs) - len(ids) :],
            tokens=[decode([t]) for t in ids] if call.logprobs else [],
            prompt_tokens=start,
            weight_version=segment.weight_versions[-1] if segment.weight_versions else "",
            stop_sequence=stop if isinstance(stop, str) else None,
        )

    def _split(self, call: ChatCall, text: str) -> tuple[str | None, tuple[ReplyToolCall, ...]]:
        """The content and the tool calls the agent gets for the model's ``text``."""
        if not call.parse_tools:
            return text, ()
        parsed = self.parser.parse(text)
        if not parsed:
            return text, ()
        bodies = [m.group(1).strip() for m in _BLOCK.finditer(text)]
        out: list[ReplyToolCall] = []
        for i, item in enumerate(parsed):
            self._next_call += 1
            call_id = f"call_{self._next_call}"
            if isinstance(item, ToolCall):
                self.tool_calls += 1
                arguments = json.dumps(item.arguments, ensure_ascii=False)
                out.append(ReplyToolCall(call_id, item.name, arguments))
                continue
            assert isinstance(item, ToolCallError)
            self.tool_call_errors += 1
            # As OpenAI returns a call whose arguments are not JSON: the name, and the
            # arguments as the model wrote them; the agent's tool runner reports the error.
            body = bodies[i] if i < len(bodies) else ""
            name = _NAME.search(body)
            if name is not None:
                args = _ARGUMENTS.search(body)
                out.append(ReplyToolCall(call_id, name.group(1), args.group(1) if args else ""))
        if not out:
            return text, ()
        rest = _BLOCK.sub("", text).strip()
        return (rest or None), tuple(out)

    def _overflow(self, reason: str) -> ChatError:
        self.truncated = self.truncated or reason
        limit = self.episode.limits.context_length
        return ChatError(
            400,
            f"This model's maximum context length is {limit} tokens; {reason}. Shorten "
            "the messages",
            param="messages",
            code="context_length_exceeded",
        )
