"""The token-exact transcript of one agent's conversation (token-in, token-out).

The prompt is rendered once through the tokenizer's chat template; model output is
appended exactly as the engine returned it (mask 1, with its log-probs); environment
messages are appended by rendering the whole conversation and tokenizing only the text
*after* what the model has already seen (mask 0). Earlier ids are never re-tokenized. A
character the tokenizer has no token for (SmolLM2 lacks six ASCII control characters) is
dropped from the ids as an engine would drop it. How several stop ids, turns cut at
``max_new_tokens`` and templates that rewrite history are handled: docs/guide.md
("Token-exact transcripts")."""

from __future__ import annotations

import dataclasses
import functools
import json
import zlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal

from agentenv._errors import (
    ContextLengthError,
    EpisodeTruncated,
    GenerationError,
    HistoryRewriteError,
    TemplateError,
)
from agentenv._generator import Completion, FinishReason
from agentenv._messages import Message, validate_messages
from agentenv._sample import JSONValue, Sample, Status
from agentenv._text_bound import TextBound
from agentenv._tokenizer import Tokenizer, check_template_kwargs

__all__ = ["Segment", "Transcript", "tool_system_prompt"]

HistoryPolicy = Literal["new_sample", "error"]


def tool_system_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """Describe ``tools`` in Hermes format, for templates that do not render tools themselves."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You can call functions to help with the request. The available functions are "
        "listed as JSON schemas inside <tools></tools>:\n"
        f"<tools>\n{lines}\n</tools>\n\n"
        "To call a function, answer with a JSON object holding its name and arguments inside "
        '<tool_call></tool_call> tags, for example:\n<tool_call>\n{"name": "function_name", '
        '"arguments": {"arg": "value"}}\n</tool_call>'
    )


@dataclasses.dataclass(slots=True)
class Segment:
    """One contiguous token sequence: a prompt and everything appended after it.

    ``ids`` holds the prompt and the completion in one list (the generator is handed this
    list itself, not a copy); ``loss_mask`` and ``logprobs`` cover the completion part.
    """

    ids: list[int]
    prompt_len: int
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    turns: int = 0
    has_logprobs: bool = True

    @property
    def prompt_ids(self) -> list[int]:
        """A copy of the prompt part."""
        return self.ids[: self.prompt_len]

    @property
    def completion_ids(self) -> list[int]:
        """A copy of the completion part."""
        return self.ids[self.prompt_len :]

    @property
    def num_tokens(self) -> int:
        return len(self.ids)


class Transcript:
    """One agent's conversation, as messages and as the exact ids the model saw.

    Args:
        tokenizer: renders the chat template and tokenizes environment text.
        messages: the initial conversation (a string is one user message).
        tools: OpenAI-format tool schemas. If the template cannot render tools, they are
            described in the system message instead (see :func:`tool_system_prompt`).
        role: the agent this transcript belongs to (multi-agent episodes).
        context_length: the model's context; a prompt longer than it raises
            :class:`ContextLengthError`, and appending past it raises
            :class:`EpisodeTruncated`.
        on_history_rewrite: ``"new_sample"`` (default) starts a new segment when the
            template rewrites history; ``"error"`` raises :class:`HistoryRewriteError`.
        chat_template_kwargs: extra template variables for every render of this
            conversation, e.g. Qwen3's ``{"enable_thinking": False}``.
    """

    # Slots: a run holds thousands of transcripts in flight.
    __slots__ = (
        "_accepted_ends",
        "_end",
        "_render_tools",
        "_seen",
        "chat_template_kwargs",
        "context_length",
        "last_finish",
        "messages",
        "on_history_rewrite",
        "role",
        "segments",
        "tokenizer",
        "tools",
    )

    def __init__(
        self,
        tokenizer: Tokenizer,
        messages: Iterable[Mapping[str, Any]] | str,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        role: str | None = None,
        context_length: int | None = None,
        on_history_rewrite: HistoryPolicy = "new_sample",
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.chat_template_kwargs: dict[str, Any] | None = (
            check_template_kwargs(chat_template_kwargs) if chat_template_kwargs else None
        )
        self.role = role
        self.context_length = context_length
        self.on_history_rewrite: HistoryPolicy = on_history_rewrite
        self.tools: Sequence[Mapping[str, Any]] | None = tools or None
        # Tools the template cannot render are described in the system message instead.
        self._render_tools = self.tools if tokenizer.supports_tools else None
        self.messages: list[Message] = self._conversation(messages)
        self.segments: list[Segment] = []
        self.last_finish: FinishReason | None = None
        self._seen = _SeenText("")
        self._end: str | None = None
        self._accepted_ends: tuple[str, ...] = ()
        self._start_segment(self._render(self.messages, add_generation_prompt=True))

    # -- views -----------------------------------------------------------------------
    @property
    def current(self) -> Segment:
        """The segment being extended."""
        return self.segments[-1]

    @property
    def ids(self) -> list[int]:
        """The ids the next generation is conditioned on.

        This is the transcript's own list, handed out without a copy: read it, never
        modify it (append through :meth:`add_completion` and :meth:`add_messages`).
        """
        return self.segments[-1].ids

    @property
    def num_tokens(self) -> int:
        return self.segments[-1].num_tokens

    @property
    def text(self) -> str:
        """The current segment decoded from :attr:`ids` (computed on each access)."""
        return self.tokenizer.decode(self.segments[-1].ids)

    @property
    def turns(self) -> int:
        """Assistant turns over all segments."""
        return sum(s.turns for s in self.segments)

    @property
    def last_assistant(self) -> str:
        """Content of the last assistant message ('' if none)."""
        for m in reversed(self.messages):
            if m["role"] == "assistant":
                return str(m["content"])
        return ""

    # -- appending -------------------------------------------------------------------
    def add_completion(self, completion: Completion) -> Message:
        """Append model output exactly as returned (mask 1); return it as an assistant message."""
        ids = completion.output_ids
        if not ids:
            raise GenerationError(
                "the generator returned an empty completion "
                f"(finish_reason={completion.finish_reason.type}); nothing to append"
            )
        seg = self.segments[-1]
        seg.ids.extend(ids)
        seg.loss_mask.extend([1] * len(ids))
        if completion.logprobs is None:
            seg.has_logprobs = False
            seg.logprobs.extend([0.0] * len(ids))
        else:
            seg.logprobs.extend(completion.logprobs)
        for version in completion.versions:
            if version not in seg.weight_versions:
                seg.weight_versions.append(version)
        seg.turns += 1
        self.last_finish = completion.finish_reason
        if self._end is not None:  # two model turns in a row: the model saw its own stop
            self._seen.extend(self._end)
            self._end = None
        content = self.tokenizer.decode(ids)
        fr = completion.finish_reason
        # The stop id is template markup, not content: the template closes the turn itself.
        # It is counted as seen once the next render shows where the template ends the turn.
        if fr.type == "stop" and isinstance(fr.matched, int) and ids[-1] == fr.matched:
            tail = self.tokenizer.decode(ids[-1:])
            if tail and content.endswith(tail):
                content = content[: -len(tail)]
                self._end = tail
        self._seen.extend(content)
        message: Message = {"role": "assistant", "content": content}
        self.messages.append(message)
        return message

    def add_messages(
        self,
        messages: Iterable[Mapping[str, Any]] | str,
        *,
        generation_prompt: bool = True,
    ) -> list[int]:
        """Append environment messages (tool results, user turns, other agents) with mask 0.

        Returns the ids appended to the current segment (after a history rewrite with
        ``on_history_rewrite="new_sample"``, the new segment's prompt ids).
        """
        new = validate_messages(messages)
        return self._continue([*self.messages, *new], generation_prompt)

    def rewrite(
        self,
        messages: Iterable[Mapping[str, Any]] | str,
        *,
        generation_prompt: bool = True,
    ) -> list[int]:
        """Continue from ``messages``, which replace the conversation (an agent that
        summarises, drops or edits earlier messages), with the check of
        :meth:`add_messages`: a continuation appends only its suffix, anything else is a
        rewritten history (``on_history_rewrite``). Returns the ids appended."""
        return self._continue(self._conversation(messages), generation_prompt)

    def _conversation(self, messages: Iterable[Mapping[str, Any]] | str) -> list[Message]:
        """``messages`` checked, with the tools described in them when the template
        cannot render tools."""
        conversation = validate_messages(messages)
        if not conversation:
            raise TemplateError("a transcript needs at least one message")
        if self.tools and not self.tokenizer.supports_tools:
            conversation = _with_tool_prompt(conversation, self.tools)
        return conversation

    def _continue(self, conversation: list[Message], generation_prompt: bool) -> list[int]:
        full = self._render(conversation, add_generation_prompt=generation_prompt)
        end = self._turn_end(full) if self._seen.is_prefix_of(full) else None
        if end is None:
            if self.on_history_rewrite == "error":
                raise HistoryRewriteError(_explain_rewrite(self.text, full, self._equivalent()))
            self.messages = conversation
            self._start_segment(full)
            return self.segments[-1].prompt_ids
        start = self._seen.length + len(end)
        suffix = full[start:]
        seg = self.segments[-1]
        if self.context_length is not None:
            room = self.context_length - seg.num_tokens
            fewest = self._fewest_tokens(suffix, room)
            if fewest is not None:
                raise EpisodeTruncated(
                    f"context: appending {len(suffix)} characters of environment text "
                    f"(at least {fewest} tokens) to {seg.num_tokens} would exceed "
                    f"context_length {self.context_length}"
                )
        ids = self.tokenizer.encode(suffix)
        if self.context_length is not None and seg.num_tokens + len(ids) > self.context_length:
            raise EpisodeTruncated(
                f"context: appending {len(ids)} environment tokens to {seg.num_tokens} "
                f"would exceed context_length {self.context_length}"
            )
        seg.ids.extend(ids)
        seg.loss_mask.extend([0] * len(ids))
        seg.logprobs.extend([0.0] * len(ids))
        if self._end is not None and end != self._end and self._end not in self._accepted_ends:
            self._accepted_ends = (*self._accepted_ends, self._end)
        self._seen.extend(end + suffix)
        self._end = None
        self.messages = conversation
        return ids

    # -- samples ---------------------------------------------------------------------
    def to_samples(
        self,
        reward: float,
        *,
        status: Status = Status.COMPLETED,
        reason: str | None = None,
        error_type: str | None = None,
        group_id: str | None = None,
        metadata: Mapping[str, JSONValue] | None = None,
        advantage_scale: float = 1.0,
    ) -> list[Sample]:
        """One sample per segment with at least one model turn, all with ``reward`` and
        ``advantage_scale`` (``error_type``: for ``FAILED`` samples)."""
        out: list[Sample] = []
        segments = [s for s in self.segments if s.turns > 0]
        for i, seg in enumerate(segments):
            meta: dict[str, JSONValue] = {"turns": seg.turns}
            if len(segments) > 1:
                meta["segment"] = i
            if metadata:
                meta.update(metadata)
            out.append(
                Sample(
                    prompt_ids=seg.prompt_ids,
                    completion_ids=seg.completion_ids,
                    reward=reward,
                    loss_mask=list(seg.loss_mask),
                    rollout_logprobs=list(seg.logprobs) if seg.has_logprobs else None,
                    group_id=group_id,
                    role=self.role,
                    weight_versions=list(seg.weight_versions),
                    status=status,
                    reason=reason,
                    error_type=error_type,
                    advantage_scale=advantage_scale,
                    metadata=meta,
                )
            )
        return out

    # -- internals -------------------------------------------------------------------
    def _render(self, messages: Sequence[Message], *, add_generation_prompt: bool) -> str:
        # Passed only when set: tokenizers without template arguments work.
        kwargs = self.chat_template_kwargs
        extra = {} if kwargs is None else {"chat_template_kwargs": kwargs}
        return self.tokenizer.render(
            messages, tools=self._render_tools, add_generation_prompt=add_generation_prompt, **extra
        )

    def _turn_end(self, full: str) -> str | None:
        """The text that ends the last model turn in ``full`` ('' if none is pending).

        ``None`` when the template closes the turn with neither the model's own stop id
        nor the tokenizer's end-of-turn: the history was rewritten.
        """
        if self._end is None:
            return ""
        at = self._seen.length
        if full.startswith(self._end, at):
            return self._end
        eot = self._eot_text()
        if eot and full.startswith(eot, at):
            return eot
        return None

    def _eot_text(self) -> str:
        eot = self.tokenizer.eos_token_id
        return "" if eot is None else self.tokenizer.decode([eot])

    def _equivalent(self) -> tuple[tuple[str, str], ...]:
        """(model's stop text, template's end-of-turn) pairs the current segment holds."""
        eot = self._eot_text()
        return tuple((stop, eot) for stop in self._accepted_ends) if eot else ()

    def _fewest_tokens(self, text: str, room: int) -> int | None:
        """When ``text`` is surely more than ``room`` tokens, a lower bound on its token
        count, known from its length alone (see :class:`~agentenv._tokenizer.TextBound`):
        a text that cannot fit is refused before it is tokenized (tokenizing megabytes
        costs seconds and gigabytes). None when it may fit, or nothing is known."""
        bound: TextBound | None = getattr(self.tokenizer, "text_bound", None)
        if bound is None or bound.may_fit(text, room):
            return None
        return bound.fewest_tokens(text)

    def _start_segment(self, text: str) -> None:
        ids: list[int] | None = None
        tokens: str | None = None
        if self.context_length is not None:
            fewest = self._fewest_tokens(text, self.context_length - 1)
            if fewest is not None:
                tokens = f"at least {fewest} tokens ({len(text)} characters)"
            else:
                ids = self.tokenizer.encode(text)
                if len(ids) >= self.context_length:
                    tokens = f"{len(ids)} tokens"
        if tokens is not None:
            message = (
                f"the prompt has {tokens} but context_length is "
                f"{self.context_length}; shorten the prompt or raise the context length"
            )
            # The first prompt is the caller's mistake; a re-rendered one is a limit reached.
            if self.segments:
                raise EpisodeTruncated(f"context: {message}")
            raise ContextLengthError(message)
        if ids is None:
            ids = self.tokenizer.encode(text)
        self.segments.append(Segment(ids=ids, prompt_len=len(ids)))
        self._seen = _SeenText(text)
        self._end = None
        self._accepted_ends = ()

    def __repr__(self) -> str:
        return (
            f"Transcript(role={self.role!r}, messages={len(self.messages)}, "
            f"tokens={self.num_tokens}, segments={len(self.segments)})"
        )


class _SeenText:
    """What the model has seen, as a length and two running checksums.

    Checking that a re-rendered conversation starts with it needs only these, not the
    text: a run holds thousands of transcripts, and the text is the largest part of each.
    Two independent 32-bit checksums make an accidental match vanishingly unlikely.
    """

    __slots__ = ("adler", "crc", "length")

    def __init__(self, text: str) -> None:
        data = text.encode()
        self.length = len(text)
        self.crc = zlib.crc32(data)
        self.adler = zlib.adler32(data)

    def extend(self, piece: str) -> None:
        data = piece.encode()
        self.length += len(piece)
        self.crc = zlib.crc32(data, self.crc)
        self.adler = zlib.adler32(data, self.adler)

    def is_prefix_of(self, text: str) -> bool:
        if len(text) < self.length:
            return False
        data = text[: self.length].encode()
        return zlib.crc32(data) == self.crc and zlib.adler32(data) == self.adler


# Environments pass the same schema list to every episode; describing it is not free.
_TOOL_PROMPTS: dict[int, tuple[Sequence[Mapping[str, Any]], str]] = {}


def _cached_tool_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    hit = _TOOL_PROMPTS.get(id(tools))
    if hit is not None and hit[0] is tools:
        return hit[1]
    prompt = tool_system_prompt(tools)
    if len(_TOOL_PROMPTS) >= 64:
        _TOOL_PROMPTS.clear()
    _TOOL_PROMPTS[id(tools)] = (tools, prompt)  # holding `tools` keeps its id unique
    return prompt


@functools.lru_cache(maxsize=256)
def _system_with(system: str, prompt: str) -> str:
    # One string per (system prompt, tools), shared by every episode that uses them.
    return f"{system}\n\n{prompt}"


def _with_tool_prompt(msgs: list[Message], tools: Sequence[Mapping[str, Any]]) -> list[Message]:
    prompt = _cached_tool_prompt(tools)
    if msgs[0]["role"] != "system":
        return [{"role": "system", "content": prompt}, *msgs]
    first: Message = {"role": "system", "content": _system_with(msgs[0]["content"], prompt)}
    return [first, *msgs[1:]]


def _explain_rewrite(seen: str, rendered: str, equivalent: Sequence[tuple[str, str]] = ()) -> str:
    """Where ``rendered`` first departs from ``seen`` (a model's stop text where the template
    renders its end-of-turn, a pair in ``equivalent``, is no departure)."""
    i = j = 0
    while i < len(seen) and j < len(rendered):
        pair = next(
            ((a, b) for a, b in equivalent if seen.startswith(a, i) and rendered.startswith(b, j)),
            None,
        )
        if pair is not None:
            i, j = i + len(pair[0]), j + len(pair[1])
        elif seen[i] == rendered[j]:
            i, j = i + 1, j + 1
        else:
            break
    return (
        "the chat template renders the conversation differently from the ids the model "
        f"saw, from character {j}: model saw {seen[i : i + 40]!r}, template now renders "
        f"{rendered[j : j + 40]!r}. This template rewrites history (e.g. strips earlier "
        "reasoning or trims whitespace); use on_history_rewrite='new_sample' to start a "
        "new sample from the re-rendered conversation"
    )
