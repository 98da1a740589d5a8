"""What a resuming trainer asks a durable Buffer: the steps it acknowledged after a
checkpoint, which of a round's groups are stored, and its own notes kept with the groups."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest

from agentenv.buffer import Buffer, BufferConfig
from tests.agentenv.buffer._groups import group

pytestmark = pytest.mark.timeout(60)


def test_steps_after_a_checkpoint_known_groups_and_notes_survive_a_reopen(tmp_path: Path) -> None:
    config = BufferConfig(n_samples_per_prompt=2, rollout_batch_size=2)

    async def first() -> None:
        async with Buffer(config, path=tmp_path / "buf") as b:
            for i in range(6):
                await b.put_group(group(f"t{i}@s1", [0.0, 1.0]))
            for step in range(3):
                await b.ack(await b.get_batch(), step=step)
            await b.set_note("producer", {"rounds": 3, "open": [["t9", 7]]})
            await b.set_note("producer", {"rounds": 4, "open": []})  # replaces

    async def again() -> None:
        async with Buffer(config, path=tmp_path / "buf") as b:
            assert await b.steps_after(0) == {1: 2, 2: 2}
            assert await b.steps_after(-1) == {0: 2, 1: 2, 2: 2}
            assert await b.known_groups(["t0@s1", "t5@s1", "t6@s1"]) == {"t0@s1", "t5@s1"}
            assert await b.note("producer") == {"rounds": 4, "open": []}
            assert await b.note("other") is None
            # What rewind gives back, step by step, oldest first: a redone step takes the
            # groups it took before.
            assert await b.rewind(0) == 4
            assert [g.group_id for g in (await b.get_batch()).groups] == ["t2@s1", "t3@s1"]
            assert await b.steps_after(0) == {}

    anyio.run(first)
    anyio.run(again)


def test_in_memory_the_notes_and_groups_last_as_long_as_the_buffer() -> None:
    async def go() -> None:
        async with Buffer(BufferConfig(n_samples_per_prompt=2, rollout_batch_size=1)) as b:
            await b.put_group(group("t0@s1", [0.0, 1.0]))
            await b.ack(await b.get_batch(), step=0)
            assert await b.steps_after(-1) == {}  # nothing to rewind in memory
            assert await b.known_groups(["t0@s1", "t1@s1"]) == {"t0@s1"}
            await b.set_note("k", [1, "two"])
            assert await b.note("k") == [1, "two"]

    anyio.run(go)
