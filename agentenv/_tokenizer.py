"""Tokenizers with chat templates, light enough for the rollout hot path.

:class:`ChatTokenizer` pairs a Rust ``tokenizers.Tokenizer`` with the model's Jinja chat
template, rendered the way ``transformers`` renders it (sandboxed Jinja, ``trim_blocks``,
``lstrip_blocks``, ``tojson``, ``raise_exception``), without importing transformers or torch.
Anything that satisfies the :class:`Tokenizer` protocol can be used instead.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from agentenv._errors import ConfigError, TemplateError
from agentenv._messages import Message
from agentenv._text_bound import TextBound, text_bound

if TYPE_CHECKING:
    import jinja2
    import tokenizers

__all__ = ["ChatTokenizer", "Tokenizer"]

# What render passes itself; a template argument of the same name would be ambiguous.
_RENDER_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt"})


@runtime_checkable
class Tokenizer(Protocol):
    """What the SDK needs from a tokenizer."""

    @property
    def eos_token_id(self) -> int | None:
        """The id that ends an assistant turn by default."""
        ...

    @property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a ``tools`` argument itself."""
        ...

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; special-token text maps to special ids; no BOS/EOS added."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of ``ids``, special tokens included."""
        ...

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The chat template applied to ``messages``, as text.

        ``chat_template_kwargs`` are extra template variables (SGLang's and vLLM's name),
        e.g. Qwen3's ``{"enable_thinking": False}``; callers pass it only when non-empty.
        """
        ...


def check_template_kwargs(value: object) -> dict[str, Any]:
    """``value`` as template arguments (a copy), or :class:`ConfigError` naming the problem."""
    if not isinstance(value, Mapping):
        raise ConfigError(
            "chat_template_kwargs must be a mapping of names to values, got "
            f"{type(value).__name__}: pass e.g. {{'enable_thinking': False}}"
        )
    for name in value:
        if not isinstance(name, str):
            raise ConfigError(f"chat_template_kwargs names must be strings, got {name!r}")
        if name in _RENDER_ARGUMENTS:
            raise ConfigError(
                f"chat_template_kwargs may not set {name!r}: it is render's own argument "
                "(the transcript passes it); remove it from chat_template_kwargs"
            )
    return dict(value)


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json stores special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        content = value.get("content")
        return content if isinstance(content, str) else None
    return value if isinstance(value, str) else None


def _raise_exception(message: str) -> None:
    raise TemplateError(f"chat template raised: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # Same defaults as transformers' chat-template tojson (not Jinja's HTML-safe one).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


_CACHE_MAX_ENTRIES = 8192
_CACHE_MAX_PIECE = 16384
_GIL_FREE_CHARS = 65536  # texts at least this long are tokenized with the GIL released


def _special_token_splitter(tok: tokenizers.Tokenizer) -> re.Pattern[str] | None:
    """A regex splitting text around special tokens, where that preserves encode's ids.

    It does when every added token is special and matched literally (no lstrip, rstrip
    or single-word rules) and no pre-tokenizer or normalizer depends on the position in
    the whole text (Metaspace / Prepend). Otherwise ``None``: encode the text whole.
    """
    added = list(tok.get_added_tokens_decoder().values())
    if not added:
        return None
    if any(not a.special or a.lstrip or a.rstrip or a.single_word for a in added):
        return None
    config = json.loads(tok.to_str())
    layout = json.dumps([config.get("normalizer"), config.get("pre_tokenizer")])
    if "Metaspace" in layout or "Prepend" in layout:
        return None
    alternatives = sorted((a.content for a in added), key=len, reverse=True)
    return re.compile("(" + "|".join(re.escape(a) for a in alternatives) + ")")


def _compile_template(source: str) -> jinja2.Template:
    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as e:
        raise TemplateError(f"chat template does not compile: {e} (line {e.lineno})") from None


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` plus a Jinja chat template.

    Build one with :meth:`load` (a model name such as ``"smollm2-135m"`` or an HF
    directory), :meth:`from_dir`, or the constructor. :meth:`with_template` returns a copy
    rendering another template, optionally registering extra special tokens.
    """

    def __init__(
        self,
        tokenizer: tokenizers.Tokenizer,
        chat_template: str | None,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        name: str = "",
    ) -> None:
        self._tok = tokenizer
        self.name = name
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._eos_id = tokenizer.token_to_id(eos_token) if eos_token else None
        self._template: jinja2.Template | None = (
            _compile_template(chat_template) if chat_template else None
        )
        self._supports_tools = bool(chat_template) and "tools" in (chat_template or "")
        self._globals: dict[str, Any] = dict(self._template.globals) if self._template else {}
        self._split = _special_token_splitter(tokenizer)
        self._cache: dict[str, list[int]] = {}
        self._token_text: dict[int, str] = {}

    # -- construction ----------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> ChatTokenizer:
        """Load ``tokenizer.json`` and the chat template from a Hugging Face model directory."""
        import tokenizers

        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise ConfigError(
                f"{root} has no tokenizer.json; expected a Hugging Face model directory "
                "(save one with tokenizer.save_pretrained(dir))"
            )
        config: dict[str, Any] = {}
        cfg_file = root / "tokenizer_config.json"
        if cfg_file.is_file():
            config = json.loads(cfg_file.read_text(encoding="utf-8"))
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: use "default"
            by_name = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = by_name.get("default") or next(iter(by_name.values()), None)
        jinja_file = root / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text(encoding="utf-8")
        json_file = root / "chat_template.json"
        if template is None and json_file.is_file():
            template = json.loads(json_file.read_text(encoding="utf-8")).get("chat_template")
        return cls(
            tokenizers.Tokenizer.from_file(str(tok_file)),
            template if isinstance(template, str) else None,
            bos_token=_token_text(config.get("bos_token")),
            eos_token=_token_text(config.get("eos_token")),
            name=root.name,
        )

    @classmethod
    def load(cls, name_or_path: str | os.PathLike[str]) -> ChatTokenizer:
        """Load by model name (``"smollm2-135m"``) or from a local HF directory."""
        from agentenv.engine import resolve_model

        return cls.from_dir(resolve_model(str(name_or_path)))

    def with_template(
        self,
        chat_template: str,
        *,
        special_tokens: Sequence[str] = (),
        bos_token: str | None = None,
        eos_token: str | None = None,
    ) -> ChatTokenizer:
        """A copy that renders ``chat_template``; ``special_tokens`` are added as single ids."""
        import tokenizers

        tok = tokenizers.Tokenizer.from_str(self._tok.to_str())
        if special_tokens:
            tok.add_special_tokens(list(special_tokens))
        return ChatTokenizer(
            tok,
            chat_template,
            bos_token=bos_token if bos_token is not None else self.bos_token,
            eos_token=eos_token if eos_token is not None else self.eos_token,
            name=self.name,
        )

    # -- the protocol ----------------------------------------------------------------
    @property
    def eos_token_id(self) -> int | None:
        return self._eos_id

    @property
    def supports_tools(self) -> bool:
        return self._supports_tools

    @property
    def vocab_size(self) -> int:
        return int(self._tok.get_vocab_size(with_added_tokens=True))

    @functools.cached_property
    def text_bound(self) -> TextBound | None:
        """What a text's length proves about its token count (see :class:`TextBound`;
        None when this tokenizer's configuration proves nothing): transcripts refuse a
        text too long for the context before tokenizing it."""
        return text_bound(self._tok)

    def token_to_id(self, token: str) -> int | None:
        """The id of one token's text, or ``None``."""
        result = self._tok.token_to_id(token)
        return None if result is None else int(result)

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self._encode(text)
        # Special tokens split the text before BPE runs, so encoding the pieces between
        # them separately gives the same ids; the pieces repeat across episodes (system
        # prompts, tool schemas, role headers), so they are cached.
        ids: list[int] = []
        cache = self._cache
        for piece in self._split.split(text):
            if not piece:
                continue
            hit = cache.get(piece)
            if hit is None:
                hit = self._encode(piece)
                if len(piece) <= _CACHE_MAX_PIECE:
                    if len(cache) >= _CACHE_MAX_ENTRIES:
                        # Oldest first; another thread may be evicting at the same moment.
                        with contextlib.suppress(RuntimeError, KeyError, StopIteration):
                            del cache[next(iter(cache))]
                    cache[piece] = hit
            ids.extend(hit)
        return ids

    def _encode(self, text: str) -> list[int]:
        if len(text) < _GIL_FREE_CHARS:
            ids: list[int] = self._tok.encode(text, add_special_tokens=False).ids
            return ids
        # tokenizers' encode holds the GIL throughout, encode_batch releases it: a long
        # text tokenized in a worker thread then leaves the event loop running.
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=False)
        batch_ids: list[int] = encoding.ids
        return batch_ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        """The text of ``ids`` (special tokens included unless skipped, as in
        ``tokenizers.Tokenizer.decode``)."""
        if skip_special_tokens:
            skipped: str = self._tok.decode(list(ids), skip_special_tokens=True)
            return skipped
        if len(ids) == 1:  # end-of-turn tokens are decoded on every turn
            token = ids[0]
            cached = self._token_text.get(token)
            if cached is None:
                cached = self._tok.decode([token], skip_special_tokens=False)
                if len(self._token_text) < _CACHE_MAX_ENTRIES:
                    self._token_text[token] = cached
            return cached
        text: str = self._tok.decode(list(ids), skip_special_tokens=False)
        return text

    def render(
        self,
        messages: Sequence[Message],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = False,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        if self._template is None:
            raise TemplateError(
                f"tokenizer {self.name or ''!s} has no chat template; pass one with "
                "ChatTokenizer.with_template(...) or use a model whose tokenizer_config.json "
                "has 'chat_template'"
            )
        try:
            # What Template.render does, minus a copy of the globals per call: the
            # variables are laid over a prepared copy and used as the shared context.
            variables = dict(self._globals)
            variables["bos_token"] = self.bos_token or ""
            variables["eos_token"] = self.eos_token or ""
            if chat_template_kwargs:  # laid over the special tokens, as transformers does
                variables.update(check_template_kwargs(chat_template_kwargs))
            variables["messages"] = messages
            variables["tools"] = list(tools) if tools else None
            variables["add_generation_prompt"] = add_generation_prompt
            template = self._template
            return "".join(template.root_render_func(template.new_context(variables, shared=True)))
        except (TemplateError, ConfigError):
            raise
        except Exception as e:  # a template bug must name itself, not surface as a KeyError
            raise TemplateError(f"chat template failed to render: {type(e).__name__}: {e}") from e

    def __repr__(self) -> str:
        return f"ChatTokenizer({self.name!r}, vocab={self.vocab_size})"
