"""``agentenv eval``: run an environment's tasks against a model and summarise.

    agentenv eval --env arithmetic --model scripted:examples/scripts/arithmetic_oracle.py \\
        --n 50 --n-samples-per-prompt 4 --out samples.jsonl --json

The summary lists the commonest reasons of failed samples; when every sample failed the
command exits with status 1.

Game environments also report win/draw/loss per seat with 95 % confidence intervals and
the invalid-move rate; ``--opponent`` picks who the model plays against:

    agentenv eval --env tictactoe --model smollm2-135m --opponent optimal --n 100 --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, Literal

import anyio
import pydantic

from agentenv._environment import Limits, Task, resolve_sampling
from agentenv._errors import ConfigError, ModelNotFoundError
from agentenv._generator import SamplingParams
from agentenv._policies import open_policy
from agentenv._registry import load_environment
from agentenv._runner import JsonlSink, ListSink, RolloutConfig, SampleSink, run_rollouts
from agentenv._text_model import TextGenerator
from agentenv.cli._config import add_command, add_model_arguments, build_config
from agentenv.games import GameEnv, ModelPlayer, TallySink


class EvalConfig(pydantic.BaseModel):
    """Settings of ``agentenv eval``."""

    model_config = pydantic.ConfigDict(extra="forbid")

    env: str = pydantic.Field(
        description="registered environment name, package.module:Class or path/file.py:Class"
    )
    model: str = pydantic.Field(
        description="http://host:port (SGLang or agentenv serve), a model name "
        "(smollm2-135m) or HF directory (embedded engine), scripted:<file.json|file.py>, "
        "or openai:<base url>[#<model>] (an OpenAI-compatible chat API such as vLLM or a "
        "hosted one: text-level, its samples are not token-exact; key from $OPENAI_API_KEY)"
    )
    tokenizer: str | None = pydantic.Field(
        None,
        description="tokenizer name or HF directory (default: the model's own; a "
        "server's, else smollm2-135m; scripted models bring theirs)",
    )
    env_args: dict[str, Any] = pydantic.Field(
        default_factory=dict, description="JSON object of keyword arguments for the environment"
    )
    split: Literal["train", "test"] = pydantic.Field("test", description="task split")
    n: int = pydantic.Field(100, ge=1, description="number of tasks (first N of the split)")
    n_samples_per_prompt: int = pydantic.Field(1, ge=1, description="episodes per task")
    concurrency: int = pydantic.Field(64, ge=1, description="episodes in flight")
    max_new_tokens: int = pydantic.Field(256, ge=1, description="tokens per model turn")
    temperature: float = pydantic.Field(1.0, ge=0.0, description="sampling temperature")
    top_p: float = pydantic.Field(1.0, gt=0.0, le=1.0, description="nucleus sampling")
    max_turns: int | None = pydantic.Field(None, ge=1, description="model turns per episode")
    context_length: int | None = pydantic.Field(
        None, ge=2, description="tokens per transcript; longer episodes end truncated"
    )
    episode_timeout: float | None = pydantic.Field(
        600.0, gt=0, description="seconds per episode before it fails"
    )
    seed: int = pydantic.Field(0, description="base seed")
    opponent: str | None = pydantic.Field(
        None,
        description="game environments: self-play, a named player of the game (random, "
        "optimal) or a frozen model (same forms as --model) in the other seats",
    )
    seat: str | None = pydantic.Field(
        None,
        description="game environments with an opponent: alternate, random or a role name",
    )
    out: Path | None = pydantic.Field(
        None,
        description="keep the samples: a .jsonl file, or a directory for a durable Data Buffer",
    )
    json_output: bool = pydantic.Field(
        False, alias="json", description="print the summary as one JSON object on the last line"
    )
    progress: bool | None = pydantic.Field(None, description="progress bar (default: on a TTY)")


def add_parser(sub: Any) -> None:
    parser = add_command(sub, "eval", "evaluate an environment", __doc__)
    add_model_arguments(
        parser,
        EvalConfig,
        metavars={
            "env": "NAME",
            "model": "MODEL",
            "tokenizer": "MODEL",
            "opponent": "PLAYER",
            "seat": "SEAT",
        },
    )
    parser.set_defaults(handler=run)


async def evaluate(cfg: EvalConfig) -> dict[str, Any]:
    """Run the evaluation ``cfg`` describes and return its summary."""
    env = load_environment(cfg.env, cfg.env_args)
    if (cfg.opponent is not None or cfg.seat is not None) and not isinstance(env, GameEnv):
        raise ConfigError(
            f"--opponent and --seat are for game environments; {cfg.env!r} "
            f"({type(env).__name__}) is not a GameEnv"
        )
    async with contextlib.AsyncExitStack() as stack:
        policy, tokenizer = await stack.enter_async_context(
            open_policy(cfg.model, tokenizer=cfg.tokenizer)
        )
        if isinstance(env, GameEnv) and (cfg.opponent is not None or cfg.seat is not None):
            await _set_opponent(cfg, env, stack)
        return await _evaluate(cfg, env, policy, tokenizer)


async def _set_opponent(cfg: EvalConfig, env: GameEnv, stack: contextlib.AsyncExitStack) -> None:
    spec = cfg.opponent
    if cfg.seat is not None and spec in (None, "self", "self-play") and env.opponent is None:
        raise ConfigError(
            f"--seat {cfg.seat} needs --opponent: in self-play the model plays every seat"
        )
    if spec is None or spec in env.players or spec in ("self", "self-play"):
        env.set_opponent(spec if spec is not None else env.opponent, seat=cfg.seat)
        return
    try:
        generator, tokenizer = await stack.enter_async_context(
            open_policy(spec, tokenizer=cfg.tokenizer)
        )
    except (ConfigError, ModelNotFoundError) as e:
        raise ConfigError(
            f"--opponent {spec!r} is neither a player of {cfg.env} ({sorted(env.players)}, "
            f"self-play) nor a model: {e}"
        ) from None
    env.set_opponent(ModelPlayer(generator, tokenizer=tokenizer, name=spec), seat=cfg.seat)


async def _evaluate(cfg: EvalConfig, env: Any, policy: Any, tokenizer: Any) -> dict[str, Any]:
    tasks = list(env.tasks(cfg.split))[: cfg.n]
    Task.check_all(tasks, f"{type(env).__name__}.tasks({cfg.split!r})")
    config = RolloutConfig(
        n_samples_per_prompt=cfg.n_samples_per_prompt,
        concurrency=cfg.concurrency,
        sampling=_sampling(cfg, env),
        limits=Limits(
            max_turns=cfg.max_turns,
            context_length=cfg.context_length,
            timeout_s=cfg.episode_timeout,
        ),
        seed=cfg.seed,
        progress=cfg.progress,
    )
    async with _open_sink(cfg, len(tasks)) as sink:
        tally = TallySink(sink) if isinstance(env, GameEnv) else None
        stats = await run_rollouts(
            env, tasks, policy, tokenizer=tokenizer, sink=tally or sink, config=config
        )
    summary = stats.to_dict()
    summary["env"] = cfg.env
    summary["model"] = cfg.model
    if isinstance(policy, TextGenerator):
        # Its replies were re-tokenized here: what it scored, never what it sampled.
        summary["token_exact"] = False
    if tally is not None:
        assert isinstance(env, GameEnv)
        games = tally.tally.summary()
        summary["opponent"] = env.opponent_name
        summary["seat_episodes"] = games.pop("episodes")
        summary.update(games)
    if cfg.out:
        summary["out"] = str(cfg.out)
    return summary


def _sampling(cfg: EvalConfig, env: Any) -> SamplingParams:
    """The flags' sampling, the environment's ``sampling`` attribute in place of the
    flags left at their defaults (:func:`~agentenv.resolve_sampling`)."""
    base = SamplingParams(
        max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p
    )
    given: dict[str, str] = {
        name: f"--{name.replace('_', '-')} {getattr(cfg, name)}"
        for name in ("max_new_tokens", "temperature", "top_p")
        if name in cfg.model_fields_set
    }
    return resolve_sampling(env, base, given)


@contextlib.asynccontextmanager
async def _open_sink(cfg: EvalConfig, groups: int) -> AsyncIterator[SampleSink]:
    if cfg.out is None:
        yield ListSink()
    elif cfg.out.suffix == ".jsonl":
        async with JsonlSink(cfg.out) as sink:
            yield sink
    else:
        from agentenv.buffer import Buffer, BufferConfig

        # Nothing consumes during an evaluation: room for every group it will put.
        config = BufferConfig(
            n_samples_per_prompt=cfg.n_samples_per_prompt, capacity=max(1024, groups)
        )
        async with Buffer(config, path=cfg.out) as buffer:
            yield buffer


def run(args: argparse.Namespace) -> int:
    cfg = build_config(EvalConfig, args)
    summary = anyio.run(evaluate, cfg)
    print(f"\nagentenv eval  env={cfg.env}  model={cfg.model}  split={cfg.split}")
    print(_table(summary))
    if cfg.json_output:
        print(json.dumps(summary, separators=(",", ":")))
    sys.stdout.flush()
    failed = summary["status"].get("failed", 0)
    if summary["samples"] and failed == summary["samples"]:
        # Nothing was measured: a script or CI must not read this run as a result.
        print(
            f"agentenv eval: every sample failed ({failed} of {summary['samples']}); "
            "the commonest reasons are in the summary above",
            file=sys.stderr,
        )
        return 1
    return 0


def _table(summary: dict[str, Any]) -> str:
    rows = [
        ("episodes", summary["episodes"]),
        ("samples", summary["samples"]),
        ("turns", summary["turns"]),
        ("reward mean", f"{summary['reward_mean']:.4f}"),
        ("reward std", f"{summary['reward_std']:.4f}"),
        ("completion tokens", summary["completion_tokens"]),
        ("status", ", ".join(f"{k}={v}" for k, v in summary["status"].items()) or "-"),
        ("failed", ", ".join(f"{k}={v}" for k, v in summary["failed"].items()) or "0"),
        ("wall", f"{summary['wall_s']:.2f} s"),
    ]
    if "seats" in summary:
        rows.append(("opponent", summary["opponent"]))
        rows.append(("all seats", _seat_line(summary, summary["seat_episodes"])))
        for role, seat in summary["seats"].items():
            rows.append((role, _seat_line(seat, seat["episodes"])))
        rows.append(("invalid moves", _rate(summary, "invalid_move_rate")))
    if "out" in summary:
        rows.append(("samples file", summary["out"]))
    if summary.get("token_exact") is False:
        rows.append((
            "token-exact",
            "no: a text-level model (OpenAI-compatible chat API); its replies were "
            "re-tokenized here and carry no log-probs -- fine for evaluation, refused for "
            "training (metadata token_exact: false)",
        ))  # fmt: skip
    for i, (reason, n) in enumerate(summary["failure_reasons"]):
        rows.append(("why failed" if i == 0 else "", f"{n}x {reason}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"  {k:<{width}}  {v}" for k, v in rows)


def _rate(stats: dict[str, Any], key: str) -> str:
    lo, hi = stats[f"{key}_ci"]
    return f"{stats[key]:.3f} [{lo:.3f}, {hi:.3f}]"


def _seat_line(stats: dict[str, Any], n: int) -> str:
    parts = [f"{k} {_rate(stats, f'{k}_rate')}" for k in ("win", "draw", "loss")]
    if stats["truncated_rate"]:
        parts.append(f"truncated {stats['truncated_rate']:.3f}")
    # The score beside the outcome: in a general-sum game a loss may still gain.
    parts.append(f"return {stats['mean_return']:.3f}")
    return f"{', '.join(parts)}  (n={n})"
