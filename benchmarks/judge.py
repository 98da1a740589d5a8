"""``agentenv bench judge``: the LLM judge (:class:`agentenv.rewards.JudgeRubric`) with the
embedded engine on this machine -- judgements per second, and the cache's hit rate on
GRPO groups of a reasoning-gym task.

1. **Throughput**: ``--n`` distinct answers judged at once (every one a judge call).
2. **GRPO groups**: the policy (the same model) answers ``--tasks`` reasoning-gym
   questions ``--group-size`` times each at temperature 1, as a GRPO step would; a fresh
   judge scores every sample; the hit rate is the share answered without a call (an
   answer its group gave before). Also how often the judge agrees with reasoning-gym's
   own verifier.

    agentenv bench judge --json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time
from typing import Any

from benchmarks import bench_parser

__all__ = ["add_parser", "bench"]

DATASET = "basic_arithmetic"
CONFIG: dict[str, Any] = {
    "min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+", "-"],
    "allow_negation": False, "allow_parentheses": False,
}  # fmt: skip


def add_parser(sub: Any) -> None:
    parser = bench_parser(
        sub, "judge", help="the LLM judge on the embedded engine: judgements/s, cache hit rate",
        doc=__doc__, json="one JSON line",
    )  # fmt: skip
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        metavar="MODEL",
        help="judge and policy model (default: smollm2-135m)",
    )
    parser.add_argument(
        "--n",
        type=int,
        default=64,
        metavar="N",
        help="distinct answers judged at once (default: 64)",
    )
    parser.add_argument(
        "--tasks", type=int, default=16, metavar="N", help="GRPO groups (default: 16)"
    )
    parser.add_argument("--group-size", type=int, default=8, metavar="N",
                        help="samples per group (default: 8)")  # fmt: skip
    parser.set_defaults(handler=_main)


def _main(args: argparse.Namespace) -> int:
    import anyio

    result = anyio.run(bench, args.model, args.n, args.tasks, args.group_size)
    print(json.dumps(result, indent=None if args.json else 1), flush=True)
    return 0


async def bench(model: str, n: int, tasks: int, group_size: int) -> dict[str, Any]:
    """The two measurements of the module docstring, as one record."""
    from agentenv import (
        ChatTokenizer,
        ListSink,
        RewardError,
        RolloutConfig,
        SamplingParams,
        run_rollouts,
    )
    from agentenv.engine import Engine
    from agentenv.rewards import JudgeRubric, last_number
    from environments.reasoning_gym import ReasoningGymEnv

    tokenizer = ChatTokenizer.load(model)
    env = ReasoningGymEnv(DATASET, CONFIG, n_train=max(tasks, 1), n_test=n,
                          system_prompt="Answer the question. End your reply with the "
                          "number alone.")  # fmt: skip
    out: dict[str, Any] = {"model": model, "task": {"dataset": DATASET, "config": CONFIG}}
    async with Engine(model, context_length=1024) as engine:
        # A loaded 2-core machine takes minutes for a batch: the limit is not measured here.
        judge = JudgeRubric(engine, tokenizer, max_concurrency=n, timeout_s=1800)
        # 1. n distinct answers at once: the reference's neighbours, none repeated.
        items = [(t, str(int(str(t.answer)) + i % 3 - 1)) for i, t in enumerate(env.tasks("test"))]
        with contextlib.suppress(RewardError):  # weights paged in, kernels chosen
            await judge.score_answer(items[0][0], "warm-up")
        start_load = os.getloadavg()[0]
        started = time.perf_counter()
        async with anyio_group() as tg:
            for task, answer in items:
                tg.start_soon(_judged, judge, task, answer)
        wall = time.perf_counter() - started
        out["throughput"] = {
            "judgements": len(items), "failures": judge.stats().failures,
            "wall_s": round(wall, 2),
            "judgements_per_s": round(len(items) / wall, 2),
            "load_average": [round(start_load, 2), round(os.getloadavg()[0], 2)],
        }  # fmt: skip
        # 2. GRPO groups: the policy's samples, then a fresh judge over all of them.
        sink = ListSink()
        config = RolloutConfig(
            n_samples_per_prompt=group_size, seed=0,
            sampling=SamplingParams(max_new_tokens=48, temperature=1.0),
        )  # fmt: skip
        train = env.tasks("train")[:tasks]
        await run_rollouts(env, train, engine, sink=sink, config=config, tokenizer=tokenizer)
        by_id = {t.id: t for t in train}
        out["grpo_groups"] = {"groups": tasks, "group_size": group_size}
        # The judge sees the whole reply, then only its final answer (its last number).
        for kind, extract in (("whole_reply", None), ("final_answer", last_number)):
            grouped = JudgeRubric(engine, tokenizer, max_concurrency=group_size * tasks,
                                  extract=extract, timeout_s=1800)  # fmt: skip
            verdicts: list[tuple[float, float]] = []

            async def judge_one(sample: Any, rubric: JudgeRubric = grouped,
                                into: list[tuple[float, float]] = verdicts) -> None:  # fmt: skip
                task = by_id[str(sample.group_id).split("@")[0]]
                reply = tokenizer.decode(sample.completion_ids, skip_special_tokens=True)
                with contextlib.suppress(RewardError):  # unreadable: in the judge's stats
                    into.append((await rubric.score_answer(task, reply), sample.reward))

            started = time.perf_counter()
            async with anyio_group() as tg:
                for sample in sink.samples:
                    tg.start_soon(judge_one, sample)
            wall = time.perf_counter() - started
            stats = grouped.stats()
            agree = sum(1 for j, v in verdicts if (j >= 0.5) == (v >= 0.5))
            out["grpo_groups"][kind] = {
                "judgements": stats.judgements, "judge_calls": stats.calls,
                "failures": stats.failures,
                "hit_rate": round(stats.hit_rate, 3), "wall_s": round(wall, 2),
                "judgements_per_s": round(stats.judgements / wall, 2),
                "verifier_reward_mean": round(sum(v for _, v in verdicts) / len(verdicts), 3),
                "judge_reward_mean": round(sum(j for j, _ in verdicts) / len(verdicts), 3),
                "agreement_with_verifier": round(agree / len(verdicts), 3),
                "load_average": round(os.getloadavg()[0], 2),
            }  # fmt: skip
    return out


async def _judged(judge: Any, task: Any, answer: str) -> None:
    from agentenv import RewardError

    with contextlib.suppress(RewardError):  # an unreadable verdict: in the judge's stats
        await judge.score_answer(task, answer)


def anyio_group() -> Any:
    import anyio

    return anyio.create_task_group()
