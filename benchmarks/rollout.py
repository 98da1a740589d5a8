"""The rollout-overhead benchmark: the SDK itself, with an instant model.

One episode is a 3-turn tool-use conversation (the same one the verifiers comparison
plays): the prompt asks for ``a + b + c``; turn 1 calls ``add(a, b)``, turn 2 calls
``add(<result>, c)`` with the number read back from the tool result, turn 3 answers with
it; the reward is 1 when the answer is right. The model is :class:`InstantModel`, which
costs a few microseconds per call, so the time measured is agentenv's: chat-template
rendering, tokenization of the environment turns, tool-call parsing and validation, the
tool call, transcript bookkeeping, sample construction and the runner.

Each concurrency level runs in a fresh process pinned to one CPU core, so peak RSS is per
level and the numbers are single-core numbers::

    python -m benchmarks.rollout --concurrency 1024 --episodes 4096
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import resource
import sys
import time
import tracemalloc
from collections.abc import Sequence
from typing import Any

import anyio

from agentenv import (
    ChatTokenizer,
    Completion,
    Episode,
    FinishReason,
    RolloutConfig,
    Rubric,
    Sample,
    SamplingParams,
    State,
    Task,
    ToolEnv,
    run_rollouts,
    tool,
)

SYSTEM_PROMPT = "You are a careful calculator. Always use the add tool for arithmetic."


@tool
async def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first addend.
        b: the second addend.
    """
    return a + b


def _correct(task: Task, state: State) -> float:
    found = re.findall(r"-?\d+", state.completion)
    return 1.0 if found and int(found[-1]) == task.answer else 0.0


class AddEnv(ToolEnv):
    """``a + b + c`` with an ``add`` tool."""

    name = "bench_add"
    system_prompt = SYSTEM_PROMPT
    tools = (add,)
    max_turns = 3
    rubric = Rubric(_correct)


def make_tasks(n: int) -> list[Task]:
    tasks = []
    for i in range(n):
        a, b, c = 10 + i % 89, 3 + i % 31, 7 + i % 53
        tasks.append(
            Task(
                id=str(i),
                prompt=f"What is {a} + {b} + {c}? Use the add tool.",
                answer=a + b + c,
                info={"abc": [a, b, c]},
            )
        )
    return tasks


class InstantModel:
    """A generator that answers the bench episode instantly with real token ids.

    Replies are tokenized up front (outside the timed region), so a call costs a dict
    lookup: the time measured is the SDK's, not the fake model's. The turn comes from the
    request id (``<group>/<index>/<role>/<turn>``).
    """

    def __init__(self, tokenizer: ChatTokenizer, tasks: Sequence[Task]) -> None:
        eos = tokenizer.eos_token_id
        assert eos is not None
        self.eos = eos
        self.replies: dict[str, list[list[int]]] = {}
        for t in tasks:
            a, b, c = t.info["abc"]
            texts = [
                f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n'
                "</tool_call>",
                f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a + b}, "b": {c}}}}}\n'
                "</tool_call>",
                f"The answer is {a + b + c}.",
            ]
            self.replies[t.id] = [[*tokenizer.encode(x), eos] for x in texts]
        self.finish = FinishReason("stop", matched=eos)

    async def generate(
        self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
    ) -> Completion:
        assert rid is not None
        group, _, _, turn = rid.split("/")
        ids = self.replies[group.partition("@")[0]][int(turn)]
        return Completion(
            output_ids=list(ids),
            logprobs=[-0.5] * len(ids),
            finish_reason=self.finish,
            weight_version="bench",
            prompt_tokens=len(input_ids),
        )


class CountingSink:
    """Keeps counts, not samples, so memory measures episodes in flight only."""

    def __init__(self) -> None:
        self.samples = 0
        self.rewards = 0.0
        self.tool_calls = 0

    async def put_group(self, samples: Sequence[Sample]) -> None:
        for sample in samples:
            self.samples += 1
            self.rewards += sample.reward
            # The answer is only right if both tool calls really ran without error.
            if sample.metadata.get("tool_calls") == 2 and not sample.metadata.get("tool_errors"):
                self.tool_calls += 2


def pin_to_one_core() -> int | None:
    """Pin this process to one CPU (the last one); return it, or None where unsupported."""
    try:
        cpu = max(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return cpu
    except (AttributeError, OSError):
        return None


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


async def run_level(tokenizer: ChatTokenizer, concurrency: int, episodes: int) -> dict[str, Any]:
    """Play ``episodes`` bench episodes at ``concurrency``; return the measurements."""
    tasks = make_tasks(episodes)
    model = InstantModel(tokenizer, tasks)
    env = AddEnv()
    sink = CountingSink()
    config = RolloutConfig(
        concurrency=concurrency, progress=False, sampling=SamplingParams(max_new_tokens=64)
    )
    # Warm-up: compile the template, fill caches, import lazily imported modules.
    await run_rollouts(
        env,
        make_tasks(min(8, episodes)),
        InstantModel(tokenizer, make_tasks(8)),
        tokenizer=tokenizer,
        sink=CountingSink(),
        config=config,
    )
    rss_before = peak_rss_mb()
    start = time.perf_counter()
    stats = await run_rollouts(env, tasks, model, tokenizer=tokenizer, sink=sink, config=config)
    wall = time.perf_counter() - start
    memory = await _in_flight_memory(tokenizer, concurrency)
    return {
        "concurrency": concurrency,
        "episodes": stats.episodes,
        "turns": stats.turns,
        "wall_s": round(wall, 4),
        "turns_per_s": round(stats.turns / wall, 1),
        "overhead_us_per_turn": round(wall / stats.turns * 1e6, 1),
        "reward_mean": round(stats.reward_mean, 4),
        "failed": sum(stats.failed.values()),
        "tool_calls": sink.tool_calls,
        "peak_rss_mb": round(peak_rss_mb(), 1),
        "rss_before_mb": round(rss_before, 1),
        "heap_bytes_per_in_flight_episode": memory["heap_bytes"],
        "token_bytes_per_in_flight_episode": memory["token_bytes"],
        "bytes_per_episode_beyond_tokens": memory["beyond_tokens_bytes"],
    }


async def _in_flight_memory(tokenizer: ChatTokenizer, concurrency: int) -> dict[str, int]:
    """Python heap held per episode while ``concurrency`` episodes are all in flight.

    A separate, untimed run (tracemalloc slows Python down several times). Every episode
    is held at its last model turn until all have arrived; the traced heap is read then,
    and the per-token lists of the transcripts (ids, mask, log-probs, and the copy of the
    ids passed to the model) are counted separately as token storage.
    """
    tasks = make_tasks(concurrency)
    episodes: list[Episode] = []
    reading: dict[str, int] = {}

    class Tracked(AddEnv):
        async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
            episodes.append(episode)
            return await super().rollout(task, episode)

    class Held(InstantModel):
        arrived = 0
        released = anyio.Event()

        async def generate(
            self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
        ) -> Completion:
            if rid is not None and rid.endswith("/2"):
                Held.arrived += 1
                if Held.arrived == concurrency:
                    reading["heap"] = tracemalloc.get_traced_memory()[0] - base
                    reading["tokens"] = sum(_transcript_token_bytes(e) for e in episodes)
                    Held.released.set()
                else:
                    await Held.released.wait()
            return await super().generate(input_ids, params, rid=rid)

    # Steady state: the tokenizer's piece cache is bounded and, once full, evicts as much
    # as it adds; a first, untraced pass fills it for these prompts so its growth is not
    # counted as per-episode memory.
    await run_rollouts(
        AddEnv(),
        tasks,
        InstantModel(tokenizer, tasks),
        tokenizer=tokenizer,
        sink=CountingSink(),
        config=RolloutConfig(concurrency=concurrency, progress=False),
    )
    model = Held(tokenizer, tasks)
    config = RolloutConfig(
        concurrency=concurrency, progress=False, sampling=SamplingParams(max_new_tokens=64)
    )
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        await run_rollouts(
            Tracked(), tasks, model, tokenizer=tokenizer, sink=CountingSink(), config=config
        )
    finally:
        tracemalloc.stop()
    heap = reading["heap"] // concurrency
    tokens = reading["tokens"] // concurrency
    return {"heap_bytes": heap, "token_bytes": tokens, "beyond_tokens_bytes": heap - tokens}


def _transcript_token_bytes(episode: Episode) -> int:
    size = 0
    for t in episode.transcripts:
        for seg in t.segments:
            for seq in (seg.ids, seg.loss_mask, seg.logprobs):
                size += sys.getsizeof(seq)
    return size


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--episodes", type=int, required=True)
    parser.add_argument("--tokenizer", default="smollm2-135m")
    args = parser.parse_args(argv)
    cpu = pin_to_one_core()
    tokenizer = ChatTokenizer.load(args.tokenizer)
    result = anyio.run(run_level, tokenizer, args.concurrency, args.episodes)
    result["cpu"] = cpu
    print(json.dumps(result))


if __name__ == "__main__":
    main()
