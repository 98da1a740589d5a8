"""The generator protocol: token ids in; token ids, log-probs, finish reason and weight version out.

Every inference backend implements :class:`Generator`: the SGLang client, the embedded
engine and the :class:`~agentenv.ScriptedModel` used to test environments offline.
:class:`SamplingParams` mirrors SGLang's sampling parameters and validates them locally
with SGLang's messages.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, Protocol, runtime_checkable

from agentenv._errors import ConfigError, short_repr

__all__ = ["Completion", "CompletionBuilder", "FinishReason", "Generator", "SamplingParams"]

_GREEDY_EPS = 1e-6
_SEED_LIMIT = 1 << 63  # seeds are non-negative int64


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A real number that is finite as a float (not a bool, NaN, inf or a huge int)."""
    if not (_is_int(value) or isinstance(value, float)):
        return False
    try:
        return math.isfinite(float(value))  # type: ignore[arg-type]
    except OverflowError:
        return False


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SamplingParams:
    """Sampling parameters, with SGLang's names, defaults and range checks.

    ``temperature`` below 1e-6 means greedy. ``top_k=-1`` means all tokens. ``seed``, when
    given, is in ``[0, 2**63)``. However small ``top_p`` is, the likeliest token stays.
    """

    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    min_new_tokens: int = 0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        # Accept lists from JSON/config but store tuples (hashable, immutable).
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self.verify()

    def verify(self) -> None:
        """Raise :class:`ConfigError` naming the first field of the wrong type or out of
        range (an engine loop only ever sees parameters that passed)."""
        for name in ("max_new_tokens", "top_k", "min_new_tokens"):
            value = getattr(self, name)
            if not _is_int(value):
                raise ConfigError(f"{name} must be an integer, got {short_repr(value)}")
        for name in ("temperature", "top_p", "min_p"):
            value = getattr(self, name)
            if not _is_finite(value):
                raise ConfigError(f"{name} must be a finite number, got {short_repr(value)}")
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError(
                f"ignore_eos must be true or false, got {short_repr(self.ignore_eos)}"
            )
        if self.seed is not None and not _is_int(self.seed):
            raise ConfigError(f"seed must be an integer or None, got {short_repr(self.seed)}")
        if self.seed is not None and not 0 <= self.seed < _SEED_LIMIT:
            raise ConfigError(
                f"seed must be in [0, 2**63) (a 63-bit integer), got {short_repr(self.seed)}"
            )
        if self.temperature < 0.0:
            raise ConfigError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ConfigError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.top_k < 1 and self.top_k != -1:
            raise ConfigError(f"top_k must be -1 (disable), or at least 1, got {self.top_k}")
        if self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}")
        if self.min_new_tokens < 0:
            raise ConfigError(f"min_new_tokens must be at least 0, got {self.min_new_tokens}")
        if self.min_new_tokens > self.max_new_tokens:
            raise ConfigError(
                f"min_new_tokens must be in [0, max_new_tokens({self.max_new_tokens})], "
                f"got {self.min_new_tokens}"
            )
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ConfigError(f"stop must be a list of non-empty strings, got {list(self.stop)}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise ConfigError(
                f"stop_token_ids must be non-negative integers, got {list(self.stop_token_ids)}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def replace(self, **changes: Any) -> SamplingParams:
        """A copy with ``changes`` applied (and validated)."""
        unknown = set(changes) - {f.name for f in dataclasses.fields(self)}
        if unknown:
            raise ConfigError(f"unknown sampling parameters {sorted(unknown)}")
        return dataclasses.replace(self, **changes)

    def to_sglang(self) -> dict[str, Any]:
        """The ``sampling_params`` object of an SGLang ``/generate`` request."""
        out: dict[str, Any] = {
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "min_new_tokens": self.min_new_tokens,
            "ignore_eos": self.ignore_eos,
            # Token-in, token-out: keep special tokens and stop strings in the output.
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "no_stop_trim": True,
        }
        if self.stop:
            out["stop"] = list(self.stop)
        if self.stop_token_ids:
            out["stop_token_ids"] = list(self.stop_token_ids)
        if self.seed is not None:
            out["sampling_seed"] = self.seed
        return out

    @classmethod
    def from_sglang(cls, data: Mapping[str, Any] | None) -> SamplingParams:
        """Parse SGLang's ``sampling_params``; ``null`` means default, unknown keys are ignored."""
        data = data or {}
        if not isinstance(data, Mapping):
            raise ConfigError(f"sampling_params must be a JSON object, got {short_repr(data)}")
        names = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names and v is not None}
        if "sampling_seed" in data and data["sampling_seed"] is not None:
            kwargs["seed"] = data["sampling_seed"]
        if isinstance(kwargs.get("stop"), str):
            kwargs["stop"] = (kwargs["stop"],)
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise ConfigError(f"invalid sampling_params: {e}") from None


FinishType = Literal["stop", "length", "abort"]


@dataclasses.dataclass(frozen=True, slots=True)
class FinishReason:
    """Why a generation ended, as SGLang reports it.

    ``stop``: an EOS/stop token id or stop string was produced (``matched``);
    ``length``: ``max_new_tokens`` (``length``) was reached; ``abort``: cancelled (``message``).
    """

    type: FinishType
    matched: int | str | None = None
    length: int | None = None
    message: str | None = None

    def to_sglang(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": self.type}
        if self.type == "stop":
            out["matched"] = self.matched
        elif self.type == "length":
            out["length"] = self.length
        else:
            out["message"] = self.message
        return out

    @classmethod
    def from_sglang(cls, data: Mapping[str, Any] | None) -> FinishReason:
        if data is None:
            return cls("abort", message="no finish reason")
        kind = data.get("type")
        if kind not in ("stop", "length", "abort"):
            raise ConfigError(f"finish_reason.type must be stop, length or abort, got {kind!r}")
        return cls(
            kind,
            matched=data.get("matched"),
            length=data.get("length"),
            message=data.get("message"),
        )


@dataclasses.dataclass(slots=True, kw_only=True)
class Completion:
    """The result of one generate call.

    ``output_ids`` are exactly the ids the engine produced (the matched stop token
    included); ``logprobs`` are aligned with them, or ``None`` when not requested.
    ``weight_version`` is the server's version when the generation ended;
    ``version_spans``, when known, says which version produced which tokens:
    ``(("3", 40), ("4", 12))`` -- the first 40 by version 3, the next 12 by version 4
    (a weight update happened in between). Empty means all by ``weight_version``.
    """

    output_ids: list[int]
    logprobs: list[float] | None
    finish_reason: FinishReason
    weight_version: str = "default"
    prompt_tokens: int = 0
    cached_tokens: int = 0
    version_spans: tuple[tuple[str, int], ...] = ()

    def __post_init__(self) -> None:
        if self.logprobs is not None and len(self.logprobs) != len(self.output_ids):
            raise ConfigError(
                f"a completion has {len(self.output_ids)} output_ids but "
                f"{len(self.logprobs)} logprobs; they must be aligned"
            )
        if self.version_spans and sum(n for _, n in self.version_spans) != len(self.output_ids):
            raise ConfigError(
                f"version_spans cover {sum(n for _, n in self.version_spans)} tokens but "
                f"the completion has {len(self.output_ids)}"
            )

    @property
    def versions(self) -> list[str]:
        """Every weight version that produced a token of this completion, in order."""
        if not self.version_spans:
            return [self.weight_version]
        return list(dict.fromkeys(version for version, _ in self.version_spans))


class CompletionBuilder:
    """A completion that arrives in pieces (stream events, engine steps), assembled with
    the weight version of every piece recorded in ``version_spans``."""

    __slots__ = ("ids", "logprobs", "spans", "version")

    def __init__(self, version: str = "default") -> None:
        self.ids: list[int] = []
        self.logprobs: list[float] = []
        self.spans: list[tuple[str, int]] = []
        self.version = version

    def add(self, ids: Sequence[int], logprobs: Sequence[float] | None, version: str) -> None:
        """Tokens produced under weight ``version``."""
        self.version = version
        if not ids:
            return
        self.ids.extend(ids)
        self.logprobs.extend(logprobs or ())
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1] = (version, self.spans[-1][1] + len(ids))
        else:
            self.spans.append((version, len(ids)))

    def build(
        self,
        finish: FinishReason,
        *,
        prompt_tokens: int = 0,
        cached_tokens: int = 0,
        logprobs: bool = True,
    ) -> Completion:
        """The completion; spans only when more than one version made it."""
        return Completion(
            output_ids=self.ids,
            logprobs=self.logprobs if logprobs else None,
            finish_reason=finish,
            weight_version=self.version,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            version_spans=tuple(self.spans) if len(self.spans) > 1 else (),
        )


@runtime_checkable
class Generator(Protocol):
    """Anything that turns token ids into a :class:`Completion`."""

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        """Generate a continuation of ``input_ids``. ``rid`` names the request (for abort)."""
        ...
