"""Turning a ``--model`` string into a generator and its tokenizer: ``http://host:port``
(SGLang, its router or ``agentenv serve``; key ``$AGENTENV_API_KEY``), a model name or
Hugging Face directory (the embedded engine), ``scripted:<file>.json`` or
``scripted:<file>.py`` (a :class:`~agentenv.ScriptedModel`), or ``openai:<base
url>[#<model>]`` (a text-level chat API, for evaluation only; key ``$OPENAI_API_KEY``).
See docs/guide.md ("Evaluating"). The tokenizer is ``--tokenizer``; by default the
engine's model, the server's model when its directory is readable here, else
``smollm2-135m``."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from pathlib import Path

from agentenv._errors import ConfigError
from agentenv._generator import Generator
from agentenv._names import import_file
from agentenv._scripted import ScriptedModel
from agentenv._tokenizer import ChatTokenizer, Tokenizer

__all__ = ["DEFAULT_TOKENIZER", "load_policy", "open_policy"]

DEFAULT_TOKENIZER = "smollm2-135m"


def _load_script_module(path: Path, tokenizer: Tokenizer) -> ScriptedModel:
    module = import_file(path, f"agentenv_script_{path.stem}", "script")
    fn = getattr(module, "reply", None)
    if not callable(fn):
        raise ConfigError(f"script {str(path)!r} must define reply(ctx) -> str")
    return ScriptedModel(tokenizer, fn)


def load_policy(spec: str, *, tokenizer: str | None = None) -> tuple[Generator, Tokenizer]:
    """The generator named by ``spec`` and the tokenizer its transcripts use."""
    kind, sep, rest = spec.partition(":")
    if sep and kind == "scripted":
        path = Path(rest)
        if not path.is_file():
            raise ConfigError(f"script file {rest!r} does not exist (from --model {spec!r})")
        tok = ChatTokenizer.load(tokenizer or DEFAULT_TOKENIZER)
        if path.suffix == ".py":
            return _load_script_module(path, tok), tok
        return ScriptedModel.from_file(path, tok), tok
    raise ConfigError(
        f"load_policy handles scripted:<file> only, got {spec!r}; use open_policy for "
        "servers and models"
    )


@contextlib.asynccontextmanager
async def open_policy(
    spec: str, *, tokenizer: str | None = None
) -> AsyncIterator[tuple[Generator, Tokenizer]]:
    """The generator named by ``spec`` and its tokenizer, open for the ``async with``."""
    if spec.startswith("scripted:"):
        yield load_policy(spec, tokenizer=tokenizer)
        return
    if spec.startswith("openai:"):
        from agentenv._text_model import OpenAIChatModel

        base, _, model = spec.removeprefix("openai:").partition("#")
        tok = ChatTokenizer.load(tokenizer or DEFAULT_TOKENIZER)
        api_key = os.environ.get("OPENAI_API_KEY") or None
        async with OpenAIChatModel(base, tokenizer=tok, model=model or None, api_key=api_key) as m:
            yield m, tok
        return
    if spec.startswith(("http://", "https://")):
        from agentenv.sglang import SGLangClient

        api_key = os.environ.get("AGENTENV_API_KEY") or None
        async with SGLangClient(spec, api_key=api_key) as client:
            name = tokenizer
            if name is None:
                info = await client.model_info()
                path = Path(str(info.get("tokenizer_path") or info.get("model_path") or ""))
                name = str(path) if (path / "tokenizer.json").is_file() else DEFAULT_TOKENIZER
            yield client, ChatTokenizer.load(name)
        return
    from agentenv.engine import Engine, resolve_model

    # One tokenizer for the transcripts and the engine's stop strings: --tokenizer when
    # given (a model directory without tokenizer files needs it), else the model's own.
    tok = ChatTokenizer.load(tokenizer or resolve_model(spec))
    async with Engine(spec, tokenizer=tok) as engine:
        yield engine, tok
