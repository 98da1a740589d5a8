"""The request bodies ``agentenv serve`` accepts: one pydantic schema per route.

Types are strict, token ids must be in the model's vocabulary, the sampling ranges are
:meth:`SamplingParams.verify`'s (SGLang's) and sizes are bounded (the rules, field by
field: docs/inference.md, "Requests are checked before the engine sees them"). A body that
fails raises :class:`ConfigError` (the server answers 400) naming the field, the value and
what is expected: ``sampling_params.top_k must be an integer, got 1e+30``. Top-level keys
a schema does not name are ignored, as SGLang ignores them; ``sampling_params`` keys are
not (see :class:`SamplingBody`). :func:`parse` is the one entry point:
``parse(GenerateBody, request, vocab=...)``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import pydantic
from pydantic_core import PydanticCustomError

from agentenv._errors import ConfigError, short_repr
from agentenv._generator import SamplingParams
from agentenv._http import Request, decode_json
from agentenv.engine._group import DEFAULT_GROUP_NAME

__all__ = [
    "AbortBody",
    "DestroyGroupBody",
    "GenerateBody",
    "InitGroupBody",
    "MemoryBody",
    "PauseBody",
    "UpdateFromDiskBody",
    "UpdateFromDistributedBody",
    "UpdateFromTensorBody",
    "UpdateVersionBody",
    "parse",
]

B = TypeVar("B", bound="Body")

RENDEZVOUS_TIMEOUT = 60.0  # s: the default wait for every rank of a weight update group
MAX_PROMPTS = 4096  # prompts in one /generate request, by default
MAX_WORLD_SIZE = 65536  # ranks in a weight update group
MAX_VERSION_CHARS = 256  # characters in a weight version
SEED_LIMIT = 1 << 63  # sampling_seed is in [0, 2**63): the engine's seeds are int64

# What pydantic's error types mean, said the way this server says it.
_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "dict_type": "a JSON object",
    "model_type": "a JSON object",
    "model_attributes_type": "a JSON object",
    "literal_error": "one of the listed values",
    "string_too_short": "a non-empty string",  # the only length rule here: min_length=1
    "missing": "given",
}


class Body(pydantic.BaseModel):
    """A request body: strict types, finite numbers, unknown keys ignored."""

    model_config = pydantic.ConfigDict(
        strict=True, extra="ignore", allow_inf_nan=False, frozen=True
    )


def _where(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "the body"


def _message(error: pydantic.ValidationError) -> str:
    first = error.errors(include_url=False)[0]
    if first["type"] == "invalid":  # ours: the message says it all
        return str(first["msg"])
    where = _where(first["loc"])
    if first["type"] == "missing":
        return f"{where} is required"
    expected = _EXPECTED.get(first["type"])
    if first["type"] == "literal_error":
        expected = first["msg"].removeprefix("Input should be ")
    if expected is None:
        msg = first["msg"].rstrip(".")
        expected = (
            msg.removeprefix("Input should be ")
            if msg.startswith("Input ")
            else (f"valid ({msg[0].lower()}{msg[1:]})")
        )
    return f"{where} must be {expected}, got {short_repr(first['input'], 80)}"


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid", message)


def _context(info: pydantic.ValidationInfo, key: str, default: int | None = None) -> int | None:
    """An int that :func:`parse` was given for the checks (``vocab``, ``max_prompts``)."""
    value = (info.context or {}).get(key)
    return value if isinstance(value, int) else default


def _token_ids(value: Any, where: str, vocab: int | None, *, empty: bool = True) -> list[int]:
    if not isinstance(value, list):
        raise _invalid(f"{where} must be a list of token ids, got {short_repr(value, 80)}")
    if not empty and not value:
        raise _invalid(f"{where} cannot be empty.")
    for i, t in enumerate(value):
        if type(t) is not int or t < 0 or (vocab is not None and t >= vocab):
            span = f"[0, {vocab})" if vocab is not None else ">= 0"
            raise _invalid(f"{where}[{i}] must be a token id {span}, got {short_repr(t, 80)}")
    return value


def _batch_size(n: int, where: str, info: pydantic.ValidationInfo) -> None:
    limit = _context(info, "max_prompts", MAX_PROMPTS)
    if limit is not None and n > limit:
        raise _invalid(
            f"{where} holds {n} prompts; this server takes at most {limit} per request "
            "(agentenv serve --max-prompts): split the batch into several requests"
        )


def _version(value: Any, where: str) -> str:
    """A weight version: a non-empty, printable string of at most MAX_VERSION_CHARS."""
    if not isinstance(value, str):
        raise _invalid(f"{where} must be a string, got {short_repr(value, 80)}")
    if not value or len(value) > MAX_VERSION_CHARS or not value.isprintable():
        raise _invalid(
            f"{where} must be 1 to {MAX_VERSION_CHARS} printable characters (no control "
            f"characters or lone surrogates), got {short_repr(value, 80)}"
        )
    return value


Version = Annotated[
    str, pydantic.PlainValidator(lambda value, info: _version(value, info.field_name))
]
"""A weight version field, checked by :func:`_version` under the field's name."""


def _load_format(value: str | None) -> str | None:
    if value not in (None, "auto"):
        raise _invalid(
            f"load_format {value!r} is not supported here; send the tensors as they are "
            "(load_format null)"
        )
    return value


LoadFormat = Annotated[str | None, pydantic.AfterValidator(_load_format)]
"""SGLang's ``load_format`` of a weight update: only the tensors as they are."""


def _strings(value: Any, where: str) -> list[str]:
    items = value if isinstance(value, list) else [value]
    for i, s in enumerate(items):
        if not isinstance(s, str):
            at = f"{where}[{i}]" if isinstance(value, list) else where
            raise _invalid(f"{at} must be a string, got {short_repr(s, 80)}")
    return items


# SGLang's sampling parameters this engine does not implement, with the values that mean
# "off" (``null`` always does): accepted at those, refused otherwise -- never ignored.
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    "frequency_penalty": ((0, 0.0), "0"),
    "presence_penalty": ((0, 0.0), "0"),
    "repetition_penalty": ((1, 1.0), "1"),
    "n": ((1,), "1 (send a batch of the same prompt instead)"),
    "json_schema": ((), "null"),
    "regex": ((), "null"),
    "ebnf": ((), "null"),
    "structural_tag": ((), "null"),
    "stop_regex": (("", []), "null"),
    "logit_bias": (({},), "null"),
    "custom_params": (({},), "null"),
    "stream_interval": ((), "null (a stream sends every step's tokens)"),
}


def _check_sampling_keys(data: dict[Any, Any]) -> dict[Any, Any]:
    """Refuse a key SGLang does not know, or a parameter this engine does not implement
    set to anything but its neutral value; returns the keys the schema takes."""
    out = {}
    for key, value in data.items():
        if key in SamplingBody.model_fields:
            out[key] = value
            continue
        if key in _NEUTRAL:
            neutral, say = _NEUTRAL[key]
            if value is None or (type(value) is not bool and value in neutral):
                continue
            raise _invalid(
                f"sampling_params.{key}={short_repr(value, 80)} is not supported by this "
                f"engine; leave it out or send {say}"
            )
        hint = " (the seed is sampling_params.sampling_seed)" if key == "seed" else ""
        name = key if isinstance(key, str) and key.isidentifier() else short_repr(key, 40)
        raise _invalid(
            f"sampling_params.{name} is not a sampling parameter{hint}; "
            f"supported: {', '.join(SamplingBody.model_fields)}"
        )
    return out


class SamplingBody(Body):
    """SGLang's ``sampling_params``: the keys this engine uses, ranges as
    :meth:`SamplingParams.verify`. SGLang's other parameters are accepted only at their
    neutral value, and a key SGLang does not know (``seed``) is refused (SGLang refuses it
    too), so no parameter is silently ignored."""

    max_new_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_new_tokens: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    sampling_seed: int | None = None
    # How the answer's text is decoded (SGLang's names). The text keeps special tokens
    # unless skip_special_tokens is true; a fast tokenizer decodes the same whatever
    # spaces_between_special_tokens says (as in SGLang); stop strings stay in the output.
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    no_stop_trim: bool | None = None

    @pydantic.model_validator(mode="before")
    @classmethod
    def _keys(cls, data: Any) -> Any:
        return _check_sampling_keys(data) if isinstance(data, dict) else data

    @pydantic.field_validator("no_stop_trim", mode="after")
    @classmethod
    def _no_stop_trim(cls, value: bool | None) -> bool | None:
        if value is False:
            raise _invalid(
                "sampling_params.no_stop_trim=false is not supported by this engine: the "
                "output keeps the stop string or token it stopped at; send true or leave it out"
            )
        return value

    @pydantic.field_validator("sampling_seed", mode="after")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value < SEED_LIMIT:
            raise _invalid(
                f"sampling_params.sampling_seed must be in [0, 2**63), got {short_repr(value, 80)}"
            )
        return value

    @pydantic.field_validator("stop", mode="plain")
    @classmethod
    def _stop(cls, value: Any) -> list[str] | None:
        if value is None:
            return None
        stops = _strings(value, "sampling_params.stop")
        if any(not s for s in stops):
            raise _invalid("sampling_params.stop must hold non-empty strings, got ''")
        return stops

    @pydantic.field_validator("stop_token_ids", mode="plain")
    @classmethod
    def _stop_ids(cls, value: Any, info: pydantic.ValidationInfo) -> list[int] | None:
        if value is None:
            return None
        return _token_ids(value, "sampling_params.stop_token_ids", _context(info, "vocab"))

    def params(self) -> SamplingParams:
        """These parameters, range-checked (:class:`ConfigError` naming the field)."""
        fields = self.model_dump(
            exclude_none=True,
            exclude={"skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"},
        )
        if "sampling_seed" in fields:
            fields["seed"] = fields.pop("sampling_seed")
        return SamplingParams(**fields)


class GenerateBody(Body):
    """``/generate``: one prompt or a batch (a list of id lists, or of texts)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: SamplingBody | None = None
    rid: str | list[str] | None = None
    return_logprob: bool = False
    stream: bool = False

    @pydantic.field_validator("text", mode="plain")
    @classmethod
    def _text(cls, value: Any, info: pydantic.ValidationInfo) -> str | list[str] | None:
        if value is None:
            return None
        _strings(value, "text")
        if isinstance(value, list) and not value:
            raise _invalid("text cannot be an empty list: send one string or several")
        if isinstance(value, list):
            _batch_size(len(value), "text", info)
        return value  # type: ignore[no-any-return]

    @pydantic.field_validator("input_ids", mode="plain")
    @classmethod
    def _input_ids(
        cls, value: Any, info: pydantic.ValidationInfo
    ) -> list[int] | list[list[int]] | None:
        if value is None:
            return None
        vocab = _context(info, "vocab")
        if isinstance(value, list) and value and all(isinstance(p, list) for p in value):
            _batch_size(len(value), "input_ids", info)
            return [
                _token_ids(p, f"input_ids[{i}]", vocab, empty=False) for i, p in enumerate(value)
            ]
        if isinstance(value, list) and any(isinstance(p, list) for p in value):
            raise _invalid(
                "input_ids must be a list of token ids or a list of such lists, not a mix"
            )
        if not isinstance(value, list):
            raise _invalid(
                f"input_ids must be a list of token ids or a list of such lists, got "
                f"{short_repr(value, 80)}"
            )
        return _token_ids(value, "input_ids", vocab, empty=False)

    @pydantic.field_validator("rid", mode="plain")
    @classmethod
    def _rid(cls, value: Any) -> str | list[str] | None:
        if value is None:
            return None
        _strings(value, "rid")
        return value  # type: ignore[no-any-return]

    @pydantic.model_validator(mode="after")
    def _prompt(self) -> GenerateBody:
        if self.text is None and self.input_ids is None:
            raise _invalid("Either text or input_ids should be provided.")
        if self.text is not None and self.input_ids is not None:
            raise _invalid("text and input_ids cannot be provided at the same time")
        return self

    @property
    def batch(self) -> bool:
        """Whether the body holds several prompts."""
        if self.input_ids is not None:
            return bool(self.input_ids) and isinstance(self.input_ids[0], list)
        return isinstance(self.text, list)

    def params(self) -> SamplingParams:
        """The sampling parameters, range-checked (:class:`ConfigError` naming the field)."""
        return (self.sampling_params or SamplingBody()).params()


class AbortBody(Body):
    """``/abort_request``: one request id, or every request."""

    rid: str | None = None
    abort_all: bool = False


class PauseBody(Body):
    """``/pause_generation``."""

    mode: Literal["abort", "retract", "in_place"] = "abort"


class UpdateFromDiskBody(Body):
    """``/update_weights_from_disk``."""

    model_path: str
    weight_version: Version | None = None
    abort_all_requests: bool = False

    @pydantic.field_validator("model_path")
    @classmethod
    def _path(cls, value: str) -> str:
        if not value:
            raise _invalid("model_path must be a directory of safetensors weights, got ''")
        return value


class UpdateVersionBody(Body):
    """``/update_weight_version``."""

    new_version: Version
    abort_all_requests: bool = True


class InitGroupBody(Body):
    """``/init_weights_update_group``: join the trainer's process group."""

    master_address: str = pydantic.Field(min_length=1)
    master_port: int = pydantic.Field(ge=1, le=65535)
    rank_offset: int
    world_size: int = pydantic.Field(ge=2, le=MAX_WORLD_SIZE)
    group_name: str = pydantic.Field(DEFAULT_GROUP_NAME, min_length=1)
    backend: Literal["nccl", "gloo"] = "nccl"
    timeout: float = pydantic.Field(RENDEZVOUS_TIMEOUT, gt=0, le=24 * 3600)

    @pydantic.model_validator(mode="after")
    def _rank(self) -> InitGroupBody:
        if not 0 < self.rank_offset < self.world_size:
            raise _invalid(
                f"rank_offset must be in [1, {self.world_size - 1}] (rank 0 is the trainer; "
                f"this server takes one rank), got {self.rank_offset}"
            )
        return self


class UpdateFromDistributedBody(Body):
    """``/update_weights_from_distributed``: one bucket's names, dtypes and shapes (their
    meaning is checked against the group and the model by the server)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = DEFAULT_GROUP_NAME
    weight_version: Version | None = None
    load_format: LoadFormat = None
    abort_all_requests: bool = False


class UpdateFromTensorBody(Body):
    """``/update_weights_from_tensor``: the tensors as handles to the sender's memory on
    this machine (:mod:`agentenv.engine._ipc`), one payload per tensor-parallel rank."""

    serialized_named_tensors: list[str]
    load_format: LoadFormat = None
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: Version | None = None

    @pydantic.field_validator("serialized_named_tensors")
    @classmethod
    def _one(cls, value: list[str]) -> list[str]:
        if len(value) != 1:
            raise _invalid(
                "serialized_named_tensors must hold one payload (this server runs on one "
                f"device: tensor-parallel rank 0 only), got {len(value)}"
            )
        return value


class MemoryBody(Body):
    """``/release_memory_occupation`` and ``/resume_memory_occupation``: which memory
    (SGLang's tags; none: all of it)."""

    tags: list[Literal["weights", "kv_cache", "cuda_graph"]] | None = None


class DestroyGroupBody(Body):
    """``/destroy_weights_update_group``."""

    group_name: str = DEFAULT_GROUP_NAME


def parse(schema: type[B], request: Request, **context: Any) -> B:
    """``request``'s JSON body checked against ``schema``; :class:`ConfigError` naming the
    field otherwise. ``context``: what a check needs to know (``vocab``: the vocabulary
    size that token ids must stay below; ``max_prompts``: the most prompts one
    ``/generate`` body may hold, :data:`MAX_PROMPTS` by default)."""
    data: Any = {}
    if request.body:
        try:
            data = decode_json(request.body)
        except ValueError as e:  # malformed, or nested deeper than MAX_JSON_DEPTH
            raise ConfigError(f"the request body is not JSON: {short_repr(str(e), 160)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"the request body must be a JSON object, got {short_repr(data, 80)}")
    try:
        return schema.model_validate(data, context=context)
    except pydantic.ValidationError as e:
        raise ConfigError(_message(e)) from None
