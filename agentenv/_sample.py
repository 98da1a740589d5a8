"""The Sample: one trainable sequence, the unit of the data contract (docs/guide.md).

``prompt_ids`` then ``completion_ids``; within the completion ``loss_mask`` marks model
tokens (1) apart from environment tokens (0, e.g. tool output), and ``rollout_logprobs``
holds the policy's log-prob of each (0.0 where the mask is 0). Samples are validated on
construction and serialise to JSON losslessly (floats round-trip exactly). The per-token
fields are stored as typed arrays (:class:`array.array`: ``"I"`` ids, ``"B"`` mask,
``"d"`` log-probs) whatever sequence was passed -- a ninth of the memory of lists, checked
at C speed, sent as raw bytes; compare them with ``list(...)``, and hand them to numpy or
torch without a copy (``np.frombuffer(s.completion_ids, np.uint32)``)."""

from __future__ import annotations

import array
import dataclasses
import enum
import json
import math
import numbers
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from agentenv._errors import SampleError, short_repr

__all__ = ["Sample", "Status"]

JSONValue = Any  # a value json.dumps accepts; kept loose on purpose (metadata is user data)


class Status(enum.StrEnum):
    """How the episode that produced a sample ended."""

    COMPLETED = "completed"
    """The episode ran to its natural end."""
    TRUNCATED = "truncated"
    """A limit ended it: turns, context budget or ``max_new_tokens``; ``reason`` says which."""
    ABORTED = "aborted"
    """It was cancelled (e.g. a weight update aborted in-flight requests)."""
    FAILED = "failed"
    """An error ended it; ``error_type`` and ``reason`` say which. Not trainable."""


_MASK_BITS = b"\x00\x01"


def _culprit(values: Iterable[Any], ok: Any) -> Any:
    return next((v for v in values if not ok(v)), None)


def _is_id(v: Any) -> bool:
    return isinstance(v, numbers.Integral) and 0 <= int(v) < 2**32


def token_ids(name: str, values: Any) -> array.array[int]:
    """``values`` as an ``array("I")`` (the same object if it is one already);
    :class:`SampleError` naming ``name`` for anything but non-negative 32-bit ints."""
    if type(values) is array.array and values.typecode == "I":
        return values
    if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise SampleError(f"{name} must be a sequence of token ids, got {type(values).__name__}")
    try:
        # C-speed conversion and check: floats and other non-integers raise TypeError,
        # negative or too large values OverflowError.
        out = array.array("I", values)
    except (TypeError, OverflowError, ValueError):
        bad = _culprit(values, _is_id)
        raise SampleError(
            f"{name} must contain non-negative ints below 2**32, got {bad!r}"
        ) from None
    return out


def mask_array(values: Any, n: int) -> array.array[int]:
    """``values`` as an ``array("B")`` of 0s and 1s aligned with ``n`` completion tokens."""
    if type(values) is array.array and values.typecode == "B":
        out = values
    else:
        if isinstance(values, (str, Mapping)) or not isinstance(values, Iterable):
            raise SampleError(f"loss_mask must be a sequence of 0/1, got {type(values).__name__}")
        try:
            out = array.array("B", bytes(values) if isinstance(values, list) else values)
        except (TypeError, OverflowError, ValueError):
            bad = _culprit(values, lambda v: type(v) is int and v in (0, 1))
            raise SampleError(
                f"loss_mask must contain only the ints 0 and 1, got {bad!r}"
            ) from None
    if len(out) != n:
        raise SampleError(
            f"loss_mask has {len(out)} entries but completion_ids has {n}; "
            "they must be aligned one per completion token"
        )
    if out.tobytes().translate(None, _MASK_BITS):  # anything left is neither 0 nor 1
        bad = next(v for v in out if v > 1)
        raise SampleError(f"loss_mask must contain only the ints 0 and 1, got {bad}")
    return out


def logprob_array(values: Any, n: int, *, check: bool = True) -> array.array[float]:
    """``values`` as an ``array("d")`` of finite floats aligned with ``n`` tokens
    (``check=False``: the caller checks finiteness itself)."""
    if type(values) is array.array and values.typecode == "d":
        out = values
    else:
        if isinstance(values, (str, bytes, Mapping)) or not isinstance(values, Iterable):
            raise SampleError(
                f"rollout_logprobs must be a sequence of numbers, got {type(values).__name__}"
            )
        try:
            # struct.pack converts a list of floats 2x faster than array("d", list).
            seq = values if isinstance(values, (list, tuple)) else list(values)
            out = array.array("d", struct.pack(f"={len(seq)}d", *seq))
        except (TypeError, struct.error):
            v = _culprit(values, lambda x: isinstance(x, numbers.Real))
            raise SampleError(
                f"rollout_logprobs must be numbers, got {type(v).__name__} {v!r}"
            ) from None
    if len(out) != n:
        raise SampleError(
            f"rollout_logprobs has {len(out)} entries but completion_ids has {n}; "
            "they must be aligned one per completion token"
        )
    # A NaN or infinity anywhere makes the sum non-finite (so may an overflow of huge
    # finite values: then the scan finds no culprit and the array is fine).
    if check and not math.isfinite(sum(out)):
        bad = _culprit(out, math.isfinite)
        if bad is not None:
            raise SampleError(f"rollout_logprobs must all be finite, got {bad}")
    return out


_JSON_HINT = (
    "metadata must be plain JSON (a dict with str keys, list, str, bool, int, finite float or None)"
)


def check_metadata(metadata: Any) -> None:
    """:class:`SampleError` unless ``metadata`` is plain JSON (docs/guide.md, "Samples"),
    naming the key path and the type of the first bad value. Anything else could not be
    stored or sent as it is, or would come back changed (a tuple as a list). The walk is
    iterative: deeply nested metadata cannot exhaust the stack."""
    if not isinstance(metadata, dict):
        raise SampleError(f"metadata must be a dict, got {type(metadata).__name__}")
    stack: list[tuple[str, Any]] = [("metadata", metadata)]
    while stack:
        where, value = stack.pop()
        if value is None or isinstance(value, (str, int)):  # bool is an int
            continue
        if isinstance(value, float):
            if not math.isfinite(value):
                raise SampleError(
                    f"{where} is {value}, but metadata must be JSON and JSON has no NaN or "
                    "infinity: store a finite number, null or a string instead"
                )
        elif isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str):
                    raise SampleError(
                        f"{where} has the key {k!r} ({type(k).__name__}), but {_JSON_HINT}: "
                        f"JSON object keys are strings, use str({k!r}) as the key"
                    )
                stack.append((f"{where}[{k!r}]", v))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", v) for i, v in enumerate(value))
        else:
            raise SampleError(
                f"{where} is a {type(value).__module__}.{type(value).__qualname__} "
                f"({short_repr(value)}), but {_JSON_HINT}: {_conversion(value)}"
            )


def _conversion(value: Any) -> str:
    if isinstance(value, (tuple, set, frozenset)):
        return "convert it with list(x)"
    if isinstance(value, (bytes, bytearray, memoryview)):
        return "decode it to a str (x.decode(), or base64 for binary data)"
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return "convert it with float(x) or int(x) (an array with x.tolist())"
    return "convert it to one of those"


@dataclasses.dataclass(slots=True, kw_only=True, eq=True)
class Sample:
    """One trainable sequence.

    Args:
        prompt_ids: token ids the first generation was conditioned on.
        completion_ids: everything after the prompt: model tokens and environment tokens.
        reward: a finite float.
        loss_mask: per completion token, 1 if the model generated it, 0 if the
            environment inserted it. Defaults to all ones.
        rollout_logprobs: per completion token, the sampling policy's log-probability;
            0.0 where ``loss_mask`` is 0. ``None`` when the generator gave none.
        group_id: the GRPO group key (samples of one prompt share it).
        role: the agent that produced the sample, in multi-agent episodes.
        id: unique id; the Data Buffer stores a given id once (retried puts are no-ops).
        task_id: the task the episode played (stale groups are re-run by it).
        episode: index of the episode within its group (one episode may yield several
            samples: several agents, or a context reset).
        weight_versions: every policy version that produced a token of this sample, in order.
        status: how the episode ended; ``reason`` is required unless ``COMPLETED``.
        reason: a short human-readable explanation of ``status``.
        error_type: for ``FAILED`` samples, the error class name (``"TimeoutError"``).
        advantage_scale: a finite factor ``>= 0`` on the sample's advantage, applied by
            the trainer after the group normalisation (a game's discount of an early turn):
            it weighs the sample without moving its sign. Default 1.
        metadata: small JSON-serialisable data (turn counts, reward components, ...);
            every number in it must be finite.
    """

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    reward: float
    loss_mask: Sequence[int] | None = None
    rollout_logprobs: Sequence[float] | None = None
    group_id: str | None = None
    role: str | None = None
    id: str | None = None
    task_id: str | None = None
    episode: int | None = None
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    status: Status = Status.COMPLETED
    reason: str | None = None
    error_type: str | None = None
    advantage_scale: float = 1.0
    metadata: dict[str, JSONValue] = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        # Every per-token field becomes a typed array here (see the module docstring).
        self.prompt_ids = token_ids("prompt_ids", self.prompt_ids)
        self.completion_ids = token_ids("completion_ids", self.completion_ids)
        n = len(self.completion_ids)
        if self.loss_mask is None:
            self.loss_mask = array.array("B", bytes([1]) * n)
        else:
            self.loss_mask = mask_array(self.loss_mask, n)
        if self.rollout_logprobs is not None:
            self.rollout_logprobs = logprob_array(self.rollout_logprobs, n)
        if isinstance(self.reward, bool) or not isinstance(self.reward, numbers.Real):
            raise SampleError(f"reward must be a float, got {type(self.reward).__name__}")
        try:
            reward = float(self.reward)
        except OverflowError:  # an int beyond float range; math.isfinite would raise too
            bits = int(self.reward).bit_length()
            raise SampleError(f"reward must be finite, got an int of {bits} bits") from None
        if not math.isfinite(reward):
            raise SampleError(f"reward must be finite, got {self.reward}")
        self.reward = reward
        scale = self.advantage_scale
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise SampleError(f"advantage_scale must be a float, got {type(scale).__name__}")
        if not (math.isfinite(scale) and scale >= 0):
            raise SampleError(f"advantage_scale must be finite and >= 0, got {scale}")
        self.advantage_scale = float(scale)
        try:
            self.status = Status(self.status)
        except ValueError:
            raise SampleError(
                f"status must be one of {[s.value for s in Status]}, got {self.status!r}"
            ) from None
        if self.episode is not None and (type(self.episode) is not int or self.episode < 0):
            raise SampleError(f"episode must be a non-negative int, got {self.episode!r}")
        if self.status is not Status.COMPLETED and not self.reason:
            raise SampleError(f"a {self.status.value} sample needs a reason")
        if self.status is Status.FAILED:
            if not self.error_type:
                raise SampleError("a failed sample needs an error_type (e.g. 'TimeoutError')")
        else:
            if self.error_type is not None:
                raise SampleError(f"error_type is only for failed samples, got {self.error_type!r}")
            if not self.prompt_ids:
                raise SampleError(f"a {self.status.value} sample needs prompt_ids")
        if self.metadata:
            check_metadata(self.metadata)
        elif not isinstance(self.metadata, dict):
            raise SampleError(f"metadata must be a dict, got {type(self.metadata).__name__}")

    # -- views -----------------------------------------------------------------------
    @property
    def ids(self) -> array.array[int]:
        """``prompt_ids + completion_ids``."""
        return token_ids("prompt_ids", self.prompt_ids) + token_ids(
            "completion_ids", self.completion_ids
        )

    @property
    def num_generated(self) -> int:
        """Number of model-generated tokens (loss-mask ones)."""
        assert self.loss_mask is not None
        return mask_array(self.loss_mask, len(self.completion_ids)).tobytes().count(1)

    @property
    def trainable(self) -> bool:
        """False for failed samples and samples with no generated token."""
        return self.status is not Status.FAILED and self.num_generated > 0

    # -- serialisation ---------------------------------------------------------------
    def to_dict(self) -> dict[str, JSONValue]:
        """A plain dict of JSON types, a key per field in field order."""
        out: dict[str, JSONValue] = {f.name: getattr(self, f.name) for f in _FIELDS}
        for key in ("prompt_ids", "completion_ids", "loss_mask", "weight_versions"):
            out[key] = list(out[key] or ())
        if self.rollout_logprobs is not None:
            out["rollout_logprobs"] = list(self.rollout_logprobs)
        out["status"] = self.status.value
        return out

    def to_json(self) -> str:
        """One line of JSON; ``Sample.from_json(s.to_json()) == s`` exactly."""
        return json.dumps(self.to_dict(), separators=(",", ":"), allow_nan=False)

    @classmethod
    def from_dict(cls, data: Mapping[str, JSONValue]) -> Sample:
        """Build and validate a Sample from :meth:`to_dict` output (unknown keys are errors)."""
        if not isinstance(data, Mapping):
            raise SampleError(f"a sample must be a JSON object, got {type(data).__name__}")
        known = {f.name for f in _FIELDS}
        unknown = set(data) - known
        if unknown:
            raise SampleError(f"unknown sample fields {sorted(unknown)}; expected {sorted(known)}")
        for key in ("prompt_ids", "completion_ids", "reward"):
            if key not in data:
                raise SampleError(f"sample is missing required field {key!r}")
        kwargs = dict(data)
        for key in ("prompt_ids", "completion_ids", "loss_mask"):
            value = kwargs.get(key)
            if value is not None and (
                not isinstance(value, list) or not all(type(v) is int for v in value)
            ):
                raise SampleError(f"{key} must be a list of integers")
        lp = kwargs.get("rollout_logprobs")
        if lp is not None and (
            not isinstance(lp, list) or not all(type(v) is float or type(v) is int for v in lp)
        ):
            raise SampleError("rollout_logprobs must be a list of numbers")
        if lp is not None:
            kwargs["rollout_logprobs"] = [float(v) for v in lp]
        # The remaining fields are not checked by the constructor; a wrong JSON type here
        # (e.g. "weight_versions": "v1") would otherwise slip into a "valid" sample.
        for key in ("group_id", "role", "id", "task_id", "reason", "error_type"):
            value = kwargs.get(key)
            if value is not None and not isinstance(value, str):
                raise SampleError(f"{key} must be a string or null, got {type(value).__name__}")
        wv = kwargs.get("weight_versions", [])
        if not isinstance(wv, list) or not all(isinstance(v, str) for v in wv):
            raise SampleError("weight_versions must be a list of strings")
        if not isinstance(kwargs.get("metadata", {}), dict):
            raise SampleError(
                f"metadata must be a JSON object, got {type(kwargs['metadata']).__name__}"
            )
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str | bytes) -> Sample:
        """Inverse of :meth:`to_json`."""
        try:
            data = json.loads(text)
        except ValueError as e:  # JSONDecodeError, and UnicodeDecodeError for bad bytes
            raise SampleError(f"sample is not valid JSON: {e}") from None
        except RecursionError:
            raise SampleError("sample is not valid JSON: it is nested too deeply") from None
        return cls.from_dict(data)


_FIELDS = dataclasses.fields(Sample)
