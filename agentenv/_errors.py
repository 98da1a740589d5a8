"""The exception tree of agentenv.

Every error the product raises on purpose (``agentenv``, ``trainer``, ``environments``)
derives from :class:`AgentEnvError`; a class defined elsewhere is shown with the public
package it comes from, and "also a X" means it is a builtin's subclass too, for callers
that catch that::

    AgentEnvError
    ├── ConfigError                a setting or argument is invalid (also a ValueError)
    │   ├── BufferLockedError      agentenv.buffer: another Buffer holds the directory
    │   ├── PlacementTimeoutError  trainer.distributed: no resources within the timeout
    │   └── WeightShapeError       trainer.megatron: a checkpoint tensor has the wrong shape
    ├── MessageError               a chat message is malformed (also a ValueError)
    ├── SampleError                a Sample violates the data contract (also a ValueError)
    │   └── FrameLimitError        agentenv.buffer: a frame stream holds too many frames
    ├── TemplateError              no usable chat template, or rendering failed
    │   └── HistoryRewriteError    earlier turns render unlike what the model saw
    ├── ContextLengthError         a prompt does not fit in the model's context
    ├── GenerationError            the generator failed or returned an unusable completion
    │   ├── SGLangError            agentenv.sglang: the server refused or failed
    │   └── EngineGroupError       trainer.distributed: the engine group cannot serve
    ├── ToolCallError              a tool call could not be parsed, validated or run
    ├── RewardError                a reward function returned NaN, inf or a non-number
    ├── EpisodeTruncated           control flow: the episode hit a turn or context limit
    ├── EpisodeAborted             control flow: the generator aborted the request
    ├── ModelNotFoundError         a model name or path did not resolve (also a LookupError)
    ├── IllegalMoveError           a move the game's rules forbid now (also a ValueError)
    ├── OpponentError              a game's fixed player raised or moved illegally
    ├── ClosedResourceError        a resource was used after ``aclose()``
    ├── HTTPError                  agentenv.http: a handler answers an error status
    ├── ChatError                  agentenv.endpoint: a request refused with OpenAI's error
    ├── UnknownBatchError          agentenv.buffer: ack or release of a batch not handed out
    │   │                          (also a KeyError)
    │   └── LeaseExpiredError      agentenv.buffer: the batch's lease ran out
    ├── BufferStoreError           agentenv.buffer: the durable store failed
    ├── BufferServiceError         agentenv.buffer: the Buffer service failed
    ├── FailedRoundsError          trainer: too many rounds in a row failed every sample
    ├── TrainerRankError           trainer.distributed: a trainer rank died
    │                              (also a RuntimeError)
    ├── MegatronNotInstalledError  trainer.megatron: megatron-core cannot be imported
    │                              (also an ImportError)
    ├── OpenEnvError               environments.openenv: the OpenEnv server or client failed
    ├── HarborBuildError           environments.harbor: a task's image did not build
    └── VerifiersError             environments.verifiers: a verifiers episode failed
                                   (also a RuntimeError)

``sandboxes`` imports nothing of agentenv (its import contract), so its errors have a root
of their own, ``sandboxes.SandboxError`` (with ``SandboxUnavailable`` under it); the
grader that runs inside a sandbox is a stdlib-only program and raises only builtins'
subclasses. ``tests/agentenv/test_errors.py`` keeps this tree complete.

Inside an episode, errors are data: the rollout runner turns an exception into a
failed :class:`~agentenv.Sample` whose ``error_type`` and ``reason`` name it, and the
episode's siblings carry on. ``ToolCallError`` never leaves a tool-use episode: it goes
back to the model as a tool message.
"""

from __future__ import annotations

import math

__all__ = [
    "AgentEnvError",
    "ClosedResourceError",
    "ConfigError",
    "ContextLengthError",
    "EpisodeAborted",
    "EpisodeTruncated",
    "GenerationError",
    "HistoryRewriteError",
    "IllegalMoveError",
    "MessageError",
    "ModelNotFoundError",
    "OpponentError",
    "RewardError",
    "SampleError",
    "TemplateError",
    "ToolCallError",
    "at_least",
    "positive",
    "short_repr",
]


def short_repr(value: object, limit: int = 60) -> str:
    """``repr(value)`` cut to ``limit`` characters, for quoting a bad value in a message."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def at_least(name: str, value: object, low: int) -> int:
    """``value``, an int (not a bool) of at least ``low``; else a :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ConfigError(f"{name} must be at least {low}, got {value!r}")
    return value


def positive(name: str, value: object) -> float:
    """``value``, a finite number (not a bool) above 0, as a float; else a :class:`ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
        raise ConfigError(f"{name} must be a positive number, got {value!r}")
    return float(value)


class AgentEnvError(Exception):
    """Root of every exception agentenv raises on purpose."""


class ConfigError(AgentEnvError, ValueError):
    """A setting or argument is invalid; the message names the value and the fix."""


class MessageError(AgentEnvError, ValueError):
    """A chat message is malformed (unknown role, missing or non-string content, ...)."""


class SampleError(AgentEnvError, ValueError):
    """A Sample violates the data contract (misaligned lengths, non-finite reward, ...)."""


class TemplateError(AgentEnvError):
    """The tokenizer has no chat template, or the template failed to render."""


class HistoryRewriteError(TemplateError):
    """The chat template renders earlier turns differently from the ids the model saw.

    Templates that strip earlier reasoning (``<think>``) or trim whitespace do this. A
    :class:`~agentenv.Transcript` with ``on_history_rewrite="new_sample"`` starts a new
    segment instead of raising.
    """


class ContextLengthError(AgentEnvError):
    """A prompt is longer than the model's context."""


class GenerationError(AgentEnvError):
    """The generator failed or returned an unusable completion (e.g. empty)."""


class ToolCallError(AgentEnvError):
    """A tool call is malformed, names an unknown tool, fails validation, raises or times out."""


class RewardError(AgentEnvError):
    """A reward function returned NaN, an infinity or something that is not a number."""


class EpisodeTruncated(AgentEnvError):
    """Raised inside an episode when it reaches its turn limit or context budget.

    The convenience environments catch it and emit truncated samples; the runner does
    the same for a custom ``rollout`` that lets it escape.
    """

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class EpisodeAborted(AgentEnvError):
    """Raised inside an episode when the generator aborts a request (finish type ``abort``).

    The episode's samples are emitted with status ``aborted``.
    """


class ModelNotFoundError(AgentEnvError, LookupError):
    """A model name or path could not be resolved to a local model."""


class IllegalMoveError(AgentEnvError, ValueError):
    """A game was asked to play a move its rules forbid: out of turn, not a legal action,
    or after the game ended. The game's state is unchanged."""


class OpponentError(AgentEnvError):
    """A fixed player (scripted or a frozen model's seat) raised, or chose an illegal move.

    The episode fails with this error as data; its siblings carry on.
    """


class ClosedResourceError(AgentEnvError):
    """A resource (generator, sink, pool) was used after it was closed."""
