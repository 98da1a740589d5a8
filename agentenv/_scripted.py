"""A scripted generator for testing environments offline, with real token ids.

:class:`ScriptedModel` answers from a script: a function of the prompt, or a list of
``(regex, reply)`` rules matched against the decoded prompt. Replies are tokenized with
the real tokenizer and end with the end-of-turn token, so transcripts, masks and samples
are exactly what a real engine would produce. Log-probs are deterministic functions of
(token, position), so tests can assert them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
from collections.abc import Callable, Sequence
from pathlib import Path

import pydantic

from agentenv._errors import ConfigError
from agentenv._generator import Completion, FinishReason, SamplingParams
from agentenv._tokenizer import Tokenizer

__all__ = ["Rule", "ScriptedModel", "scripted_logprob"]


def scripted_logprob(token_id: int, position: int) -> float:
    """The log-prob a :class:`ScriptedModel` reports for ``token_id`` at ``position``."""
    return -((token_id * 2654435761 + position * 40503) % 1000 + 1) / 1000.0


@dataclasses.dataclass(frozen=True, slots=True)
class Rule:
    """Reply with ``reply`` when ``pattern`` matches the prompt text.

    ``reply`` may refer to the match's groups as ``\\1`` or ``\\g<name>``.
    """

    pattern: str
    reply: str

    def compiled(self) -> re.Pattern[str]:
        return _compile(self.pattern)


@functools.lru_cache(maxsize=1024)
def _compile(pattern: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"script rule pattern {pattern!r} is not a valid regex: {e}") from None


class ScriptContext:
    """What a script function sees: the prompt ids and, decoded on first use, the text."""

    __slots__ = ("_text", "_tokenizer", "prompt_ids", "rid")

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int], rid: str | None) -> None:
        self._tokenizer = tokenizer
        self._text: str | None = None
        self.prompt_ids = prompt_ids
        self.rid = rid

    @property
    def text(self) -> str:
        if self._text is None:
            self._text = self._tokenizer.decode(self.prompt_ids)
        return self._text


ScriptFn = Callable[[ScriptContext], str]


class _ScriptFile(pydantic.BaseModel):
    """A JSON script file (``scripted:<file>.json``)."""

    rules: list[Rule] = []
    default: str | None = ""


class ScriptedModel:
    """A :class:`~agentenv.Generator` that answers from a script.

    Args:
        tokenizer: encodes the replies.
        script: a function ``(ScriptContext) -> str``, or ``(regex, reply)`` rules matched
            against the whole decoded prompt; the rule whose match ends latest wins, so a
            rule about the newest message beats one about the system prompt.
        default: the reply when no rule matches (``None``: raise ``ConfigError``).
        end_of_turn: token id appended to every reply (default: the tokenizer's EOS).
        weight_version: reported with every completion.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        script: ScriptFn | Sequence[Rule | tuple[str, str]],
        *,
        default: str | None = "",
        end_of_turn: int | None = None,
        weight_version: str = "scripted",
    ) -> None:
        self.tokenizer = tokenizer
        self.weight_version = weight_version
        eot = tokenizer.eos_token_id if end_of_turn is None else end_of_turn
        if eot is None:
            raise ConfigError(
                "ScriptedModel needs an end-of-turn token id: the tokenizer has no EOS, "
                "so pass end_of_turn=<id>"
            )
        self.end_of_turn: int = eot
        self.calls = 0
        self._cache: dict[str, list[int]] = {}
        if callable(script):
            self._fn: ScriptFn = script
        else:
            rules = [r if isinstance(r, Rule) else Rule(*r) for r in script]
            for r in rules:
                r.compiled()  # fail on a bad regex now, not mid-episode
            self._fn = functools.partial(_match_rules, rules, default)

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], tokenizer: Tokenizer) -> ScriptedModel:
        """Load a JSON script: ``{"rules": [{"pattern": ..., "reply": ...}], "default": ...}``."""
        p = Path(path)
        try:
            script = _ScriptFile.model_validate_json(p.read_bytes())
        except FileNotFoundError:
            raise ConfigError(f"script file {str(p)!r} does not exist") from None
        except pydantic.ValidationError as e:
            problem = e.errors()[0]
            where = ".".join(map(str, problem["loc"])) or "the file"
            raise ConfigError(
                f'script file {str(p)!r} must be {{"rules": [{{"pattern": <regex>, '
                f'"reply": <text>}}], "default": <text or null>}}: {where}: {problem["msg"]}'
            ) from None
        return cls(tokenizer, script.rules, default=script.default)

    def _encode(self, reply: str) -> list[int]:
        ids = self._cache.get(reply)
        if ids is None:
            ids = self.tokenizer.encode(reply)
            if len(self._cache) < 4096:
                self._cache[reply] = ids
        return ids

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        self.calls += 1
        reply = self._fn(ScriptContext(self.tokenizer, input_ids, rid))
        if not isinstance(reply, str):
            raise ConfigError(f"a script must return a string reply, got {type(reply).__name__}")
        ids = self._encode(reply)
        finish: FinishReason | None = None
        for stop in params.stop:
            pos = reply.find(stop)
            if pos >= 0:
                # Keep the tokens up to and including the stop string, as SGLang does.
                ids = self._encode(reply[: pos + len(stop)])
                finish = FinishReason("stop", matched=stop)
                break
        if finish is None:
            stop_ids = set(params.stop_token_ids)
            for i, t in enumerate(ids):
                if t in stop_ids:
                    ids = ids[: i + 1]
                    finish = FinishReason("stop", matched=t)
                    break
        if finish is None:
            ids = [*ids, self.end_of_turn]
            finish = FinishReason("stop", matched=self.end_of_turn)
        if len(ids) > params.max_new_tokens:
            ids = ids[: params.max_new_tokens]
            finish = FinishReason("length", length=params.max_new_tokens)
        start = len(input_ids)
        return Completion(
            output_ids=list(ids),
            logprobs=[scripted_logprob(t, start + i) for i, t in enumerate(ids)],
            finish_reason=finish,
            weight_version=self.weight_version,
            prompt_tokens=len(input_ids),
        )


def _match_rules(rules: Sequence[Rule], default: str | None, ctx: ScriptContext) -> str:
    text = ctx.text
    best: tuple[int, re.Match[str], Rule] | None = None
    for rule in rules:
        # Latest match wins: the newest message decides, not the system prompt.
        for m in rule.compiled().finditer(text):
            if best is None or m.end() > best[0]:
                best = (m.end(), m, rule)
    if best is not None:
        return best[1].expand(best[2].reply)
    if default is None:
        raise ConfigError(f"no script rule matches the prompt ending {text[-120:]!r}")
    return default
