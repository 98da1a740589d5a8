"""A producer + consumer on one durable Buffer, for the kill -9 test.

Usage: python crash_worker.py BUFFER_DIR LOG_DIR TOTAL_GROUPS

Puts groups 0..TOTAL-1 (after a restart it starts two groups before the last logged put,
so retried puts are exercised), and consumes batches, acknowledging each as the next step.
After each put returns it appends the group index to puts.log; after each ack returns it
appends the step and the batch's sample ids to steps.log. Both logs are fsynced.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import anyio

from agentenv import Sample
from agentenv.buffer import Buffer, BufferConfig

N, BATCH = 2, 3


def make_group(i: int) -> list[Sample]:
    gid = f"task{i}@run"
    return [
        Sample(
            prompt_ids=[1, 2, 3],
            completion_ids=list(range(100, 300)),
            reward=float(k),
            group_id=gid,
            id=f"{gid}/{k}",
            episode=k,
            task_id=f"task{i}",
        )
        for k in range(N)
    ]


def append(path: Path, line: str) -> None:
    with path.open("a") as f:
        f.write(line + "\n")
        f.flush()
        os.fsync(f.fileno())


def complete_lines(path: Path) -> list[str]:
    if not path.exists():
        return []
    text = path.read_text()
    return text.split("\n")[:-1]  # a torn last line (no newline) is ignored


async def main(buffer_dir: str, log_dir: str, total: int) -> None:
    logs = Path(log_dir)
    puts, steps = logs / "puts.log", logs / "steps.log"
    done_puts = [int(x) for x in complete_lines(puts)]
    start = max(0, (max(done_puts) + 1 if done_puts else 0) - 2)
    async with Buffer(
        BufferConfig(n_samples_per_prompt=N, rollout_batch_size=BATCH, capacity=12), path=buffer_dir
    ) as buffer:
        step = (await buffer.position()) or 0
        produced = anyio.Event()

        async def produce() -> None:
            for i in range(start, total):
                await buffer.put_group(make_group(i))
                append(puts, str(i))
            produced.set()

        async def consume() -> None:
            nonlocal step
            while True:
                try:
                    batch = await buffer.get_batch(timeout=0.2)
                except TimeoutError:
                    if produced.is_set():
                        return
                    continue
                step += 1
                await buffer.ack(batch, step=step)
                append(steps, json.dumps({"step": step, "ids": [s.id for s in batch.samples]}))

        async with anyio.create_task_group() as tg:
            tg.start_soon(produce)
            tg.start_soon(consume)


if __name__ == "__main__":
    anyio.run(main, sys.argv[1], sys.argv[2], int(sys.argv[3]))
