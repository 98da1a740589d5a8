"""Rewards by name (``--rm-type``), from an HTTP service (``--rm-url``) or from the user's
function (``--custom-rm-path``), as a :class:`~agentenv.Rubric`."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio

from agentenv._errors import ConfigError
from agentenv._names import did_you_mean, import_file, no_attribute, resolve_name
from agentenv._rewards import Rubric, trl_style
from agentenv._sample import JSONValue
from agentenv.rewards import _rules
from agentenv.rewards._extract import last_boxed
from agentenv.rewards._remote import RemoteReward
from agentenv.rewards._trl import from_trl
from agentenv.rewards._verdict import Verdict
from agentenv.rewards._verifier import MathVerifier

if TYPE_CHECKING:
    from agentenv._environment import Task
    from agentenv._rewards import State

__all__ = ["RM_TYPES", "RuleReward", "check_rm_type", "load_reward_function", "reward_rubric",
           "score"]  # fmt: skip

RM_TYPES: tuple[str, ...] = ("dapo", "deepscaler", "f1", "math", "remote_rm")
_BOXED = "boxed_"


def check_rm_type(rm_type: str) -> None:
    """Refuse a name that is not a reward type (``boxed_`` + a rule type included),
    listing the known ones."""
    base = rm_type.removeprefix(_BOXED)
    if base in RM_TYPES and not (base == "remote_rm" and rm_type != base):
        return
    raise ConfigError(
        f"--rm-type {rm_type!r} is not a reward type; known: {', '.join(RM_TYPES)} (and "
        f"boxed_ before a rule type, e.g. boxed_f1), or --custom-rm-path module:function"
        + did_you_mean(rm_type, RM_TYPES)
    )


def score(
    rm_type: str, response: str, label: JSONValue, verifier: MathVerifier | None = None
) -> Verdict:
    """The :class:`Verdict` of a rule-based ``rm_type`` (not ``remote_rm``) on
    ``response``. Blocking (``math``/``deepscaler`` run ``math-verify`` in ``verifier``'s
    worker processes): call it from a worker thread in async code."""
    check_rm_type(rm_type)
    if rm_type.startswith(_BOXED):
        response = last_boxed(response) or ""
        rm_type = rm_type.removeprefix(_BOXED)
    if rm_type in ("math", "deepscaler"):
        if verifier is None:
            raise ConfigError(f"--rm-type {rm_type} needs a MathVerifier")
        return (_rules.math if rm_type == "math" else _rules.deepscaler)(response, label, verifier)
    if rm_type == "dapo":
        return _rules.dapo(response, label)
    if rm_type == "f1":
        return _rules.f1(response, label)
    raise ConfigError(f"--rm-type {rm_type} is not rule-based: it needs a server (--rm-url)")


class RuleReward:
    """The reward function ``(task, state) -> float`` of ``rm_type``: the episode's last
    assistant message against ``task.answer``. A task whose ``info`` has an ``rm_type``
    (slime's per-row metadata) is scored by that type. The verdict's answer and reason
    go to the sample's metadata (``rm_answer``, ``rm_reason``)."""

    def __init__(
        self,
        rm_type: str,
        *,
        remote: RemoteReward | None = None,
        verifier: MathVerifier | None = None,
    ) -> None:
        check_rm_type(rm_type)
        if rm_type == "remote_rm" and remote is None:
            raise ConfigError(
                "--rm-type remote_rm needs --rm-url, the reward service's URL "
                "(e.g. http://127.0.0.1:8000/reward)"
            )
        self.rm_type = rm_type
        self.remote = remote
        self.verifier = verifier or MathVerifier()
        self.__name__ = rm_type

    async def __call__(self, task: Task, state: State) -> float:
        kind = task.info.get("rm_type") or self.rm_type
        if not isinstance(kind, str):
            raise ConfigError(f"task {task.id!r}: its rm_type must be a string, got {kind!r}")
        if kind == "remote_rm":
            if self.remote is None:
                raise ConfigError(f"task {task.id!r} asks for remote_rm, but --rm-url is not set")
            return await self.remote(task, state)
        verdict = await anyio.to_thread.run_sync(
            score, kind, state.completion, task.answer, self.verifier
        )
        state.info.update(verdict.metadata())
        return verdict.reward

    async def aclose(self) -> None:
        """Close ``remote_rm``'s connections and stop the verifier's workers."""
        if self.remote is not None:
            await self.remote.aclose()
        self.verifier.close()


def load_reward_function(spec: str, *, what: str = "--custom-rm-path") -> Callable[..., Any]:
    """The function ``spec`` names: ``package.module:function`` or
    ``path/to/file.py:function``."""
    module, _, attr = spec.rpartition(":")
    if module.endswith(".py") and attr:
        path = Path(module)
        loaded = import_file(path, f"_agentenv_reward_{path.stem}", what)
        if not hasattr(loaded, attr):
            raise no_attribute(what, spec, module, attr, vars(loaded))
        fn = getattr(loaded, attr)
    else:
        fn = resolve_name(spec, what=what, kind="function")
    if not callable(fn):
        raise ConfigError(f"{what} {spec!r} is {type(fn).__name__}, not a function")
    return fn  # type: ignore[no-any-return]


def reward_rubric(
    rm_type: str | None = None,
    *,
    rm_url: str | None = None,
    reward_key: str | None = None,
    custom_rm_path: str | None = None,
    group_rm: bool = False,
    label_key: str | None = "answer",
    rm_timeout: float | None = None,
    rm_max_response_bytes: int | None = None,
    verifier: MathVerifier | None = None,
) -> Rubric:
    """The rubric slime's reward flags describe (docs/rewards.md): ``custom_rm_path``'s
    function (a whole group's with ``group_rm``; a TRL function through :func:`from_trl`,
    the answer as the ``label_key`` column), else the ``rm_type`` (``remote_rm`` asks
    ``rm_url``; ``None`` bounds: :class:`RemoteReward`'s)."""
    if custom_rm_path is not None:
        if rm_type is not None:
            raise ConfigError(
                f"--custom-rm-path {custom_rm_path!r} and --rm-type {rm_type!r} both name the "
                "reward: pass one"
            )
        fn = load_reward_function(custom_rm_path)
        if trl_style(fn):
            if group_rm:
                raise ConfigError(
                    f"--custom-rm-path {custom_rm_path!r} is a TRL reward function (it takes "
                    "completions), which scores each completion: drop --group-rm"
                )
            return Rubric(from_trl(fn, label_key=label_key))
        if group_rm:
            return Rubric(group=[fn])
        return Rubric(fn)
    if group_rm:
        raise ConfigError("--group-rm scores whole groups with --custom-rm-path's function: "
                          "pass --custom-rm-path module:function")  # fmt: skip
    if rm_type is None:
        raise ConfigError("no reward: pass --rm-type (e.g. math) or --custom-rm-path")
    check_rm_type(rm_type)
    remote = None
    if rm_url is not None:
        bounds: dict[str, Any] = {
            "timeout_s": rm_timeout,
            "max_response_bytes": rm_max_response_bytes,
        }
        remote = RemoteReward(
            rm_url, reward_key=reward_key, **{k: v for k, v in bounds.items() if v is not None}
        )
    return Rubric(RuleReward(rm_type, remote=remote, verifier=verifier))
