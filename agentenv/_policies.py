"""Turning a ``--model`` string into a generator and its tokenizer.

Accepted today:

* ``scripted:<file>.json`` -- rules ``{"rules": [{"pattern", "reply"}], "default"}``;
* ``scripted:<file>.py`` -- a module defining ``reply(ctx: ScriptContext) -> str``.

The tokenizer is ``--tokenizer`` or, by default, ``smollm2-135m``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from agentenv._errors import ConfigError
from agentenv._generator import Generator
from agentenv._scripted import ScriptedModel
from agentenv._tokenizer import ChatTokenizer, Tokenizer

__all__ = ["DEFAULT_TOKENIZER", "load_policy"]

DEFAULT_TOKENIZER = "smollm2-135m"


def _load_script_module(path: Path, tokenizer: Tokenizer) -> ScriptedModel:
    spec = importlib.util.spec_from_file_location(f"agentenv_script_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"cannot import script {str(path)!r}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
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
        f"--model {spec!r} is not supported yet: use scripted:<file.json|file.py>; "
        "SGLang servers (http://...) and local models come with the inference engine"
    )
