"""GameEnv with the scripted model: samples per turn, seats, invalid moves, opponents,
limits, baselines, and the Buffer's per-role groups."""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Sequence

import pytest

from agentenv import (
    ChatTokenizer,
    ConfigError,
    Game,
    GameEnv,
    Generator,
    Limits,
    ListSink,
    Message,
    RandomPlayer,
    RoleBaseline,
    RolloutConfig,
    Sample,
    ScriptedModel,
    Status,
    Task,
    run_rollouts,
)
from agentenv._scripted import ScriptContext
from agentenv.games import GameTally, TallySink
from environments.games.tictactoe import TicTacToe, TicTacToeEnv

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

LEGAL = re.compile(r"Legal moves: \[(\d)\]")


def first_legal(ctx: ScriptContext) -> str:
    return f"The first free cell. [{LEGAL.findall(ctx.text)[-1]}]"


def role_of(ctx: ScriptContext) -> str:
    assert ctx.rid is not None
    return ctx.rid.split("/")[2]


async def play(
    env: GameEnv,
    model: Generator,
    tok: ChatTokenizer,
    *,
    n: int = 1,
    config: RolloutConfig | None = None,
    tasks: Sequence[Task] | None = None,
) -> list[Sample]:
    sink = ListSink()
    await run_rollouts(
        env,
        list(tasks or env.tasks("test")[:n]),
        model,
        tokenizer=tok,
        sink=sink,
        config=config or RolloutConfig(concurrency=1),
    )
    return sink.samples


def by_role(samples: Sequence[Sample], role: str) -> list[Sample]:
    return [s for s in samples if s.role == role]


async def test_self_play_one_sample_per_turn_per_role(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, first_legal)
    samples = await play(TicTacToeEnv(), model, smollm2)
    # X takes 1, 3, 5, 7 (the 3-5-7 diagonal wins), O takes 2, 4, 6.
    x, o = by_role(samples, "x"), by_role(samples, "o")
    assert [s.metadata["action"] for s in x] == ["1", "3", "5", "7"]
    assert [s.metadata["action"] for s in o] == ["2", "4", "6"]
    assert [s.metadata["turn"] for s in x] == [0, 2, 4, 6]
    assert [s.metadata["turn"] for s in o] == [1, 3, 5]
    assert [s.reward for s in x] == [1.0] * 4 and [s.reward for s in o] == [-1.0] * 3
    assert {s.metadata["outcome"] for s in x} == {"win"} and o[0].metadata["outcome"] == "loss"
    assert [bool(s.metadata.get("final")) for s in x] == [False, False, False, True]
    assert len({s.group_id for s in samples}) == 1  # the Buffer splits it per role
    assert all(s.status is Status.COMPLETED and s.trainable for s in samples)
    # each turn is a fresh prompt: the observation holds the parsed moves so far
    third = smollm2.decode(o[2].prompt_ids)
    assert "You play O. Moves so far: X:1, O:2, X:3, O:4, X:5." in third
    assert "first free cell" not in third  # never the other player's text


async def test_discount_and_role_baseline(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, first_legal)
    x = by_role(await play(TicTacToeEnv(discount=0.5), model, smollm2), "x")
    # The reward stays the return; the discount scales the advantage after normalisation
    # (a discounted reward would give the first moves of a won match negative advantages).
    assert [s.reward for s in x] == [1.0] * 4
    assert [s.advantage_scale for s in x] == [0.125, 0.25, 0.5, 1.0]
    env = TicTacToeEnv(baseline=RoleBaseline(decay=0.5))
    train = env.tasks("train")[:2]
    samples = await play(env, model, smollm2, tasks=train)
    x_final = [s for s in by_role(samples, "x") if s.metadata.get("final")]
    assert [s.metadata["baseline"] for s in x_final] == [0.0, 0.5]
    assert [s.reward for s in x_final] == [1.0, 0.5]  # G - b, with b before its update
    # One snapshot per group: every sample of a role in a group has the same baseline.
    assert (
        len(
            {
                s.metadata["baseline"]
                for s in by_role(samples, "x")
                if s.group_id == x_final[0].group_id
            }
        )
        == 1
    )
    assert env.baseline is not None and env.baseline.values() == {
        "tictactoe/o": -0.75,
        "tictactoe/x": 0.75,
    }
    await play(env, model, smollm2, n=2)  # test matches never move the baseline
    assert env.baseline.values() == {"tictactoe/o": -0.75, "tictactoe/x": 0.75}


async def test_no_move_forfeits_with_the_penalty(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(
        smollm2, lambda ctx: "I will think about it." if role_of(ctx) == "x" else "[1]"
    )
    samples = await play(TicTacToeEnv(invalid_penalty=-2.0), model, smollm2)
    (x,) = by_role(samples, "x")
    assert x.reward == -2.0 and x.metadata["forfeit"] is True
    assert x.metadata["invalid"] == 1 and x.metadata["attempts"] == 1
    assert "no move found" in x.metadata["invalid_reasons"][0]
    # O never moved: a sample with no completion keeps its outcome, and it is not trained on
    (o,) = by_role(samples, "o")
    assert o.metadata["outcome"] == "win" and o.reward == 0.0 and o.metadata["final"] is True
    assert list(o.completion_ids) == [] and not o.trainable
    tally = GameTally()
    tally.add(samples)
    summary = tally.summary()
    assert summary["seats"]["x"]["loss_rate"] == 1.0 and summary["seats"]["x"]["forfeits"] == 1
    assert summary["seats"]["x"]["invalid_move_rate"] == 1.0
    assert summary["seats"]["o"]["win_rate"] == 1.0


async def test_illegal_move_retried_with_feedback(smollm2: ChatTokenizer) -> None:
    def script(ctx: ScriptContext) -> str:
        assert ctx.rid is not None
        attempt = int(ctx.rid.split("/")[3])
        if role_of(ctx) == "o" and attempt == 0:
            return "X took the centre, so I take it too. [5]"  # occupied: illegal
        return first_legal(ctx) if attempt == 0 else "Sorry. [9]"

    env = TicTacToeEnv(retries=1)
    model = ScriptedModel(
        smollm2, lambda ctx: "[5]" if "Moves so far: none" in ctx.text else script(ctx)
    )
    samples = await play(env, model, smollm2)
    o = by_role(samples, "o")[0]
    assert o.metadata["invalid"] == 1 and o.metadata["attempts"] == 2
    assert o.metadata["action"] == "9"
    assert o.metadata["invalid_reasons"] == [
        "[5] is not a legal move now; legal moves: [1], [2], [3], [4], [6], [7], [8], [9]."
    ]
    text = smollm2.decode(o.completion_ids)
    assert "Invalid move: [5] is not a legal move now" in text and "Try again." in text
    # the feedback is environment text (mask 0); both replies are the model's (mask 1)
    assert 0 in o.loss_mask and o.num_generated > 0
    masked = [t for t, m in zip(o.completion_ids, o.loss_mask, strict=True) if m == 0]
    assert "Invalid move" in smollm2.decode(masked)


async def test_retries_exhausted_forfeit(smollm2: ChatTokenizer) -> None:
    model = ScriptedModel(smollm2, lambda ctx: "[0]")  # never a cell
    samples = await play(TicTacToeEnv(retries=2), model, smollm2)
    (x,) = by_role(samples, "x")
    assert x.metadata["attempts"] == 3 and x.metadata["invalid"] == 3 and x.reward == -1.0
    assert x.metadata["outcome"] == "loss" and by_role(samples, "o")[0].metadata["outcome"] == "win"


class Endless(Game):
    """A game that never ends: players take turns saying [go]."""

    name = "endless"
    roles = ("a", "b")

    def reset(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.moves = 0

    def current_role(self) -> str | None:
        return self.roles[self.moves % 2]

    def legal_actions(self) -> list[str] | None:
        return ["go"]

    def apply(self, action: str) -> None:
        self.moves += 1

    def returns(self) -> dict[str, float]:
        raise AssertionError("never over")

    def observation(self, role: str) -> list[Message]:
        return [{"role": "user", "content": f"{role}, move {self.moves}"}]


async def test_a_game_that_never_ends_is_truncated(smollm2: ChatTokenizer) -> None:
    env = GameEnv(Endless, max_moves=6)
    samples = await play(env, ScriptedModel(smollm2, lambda ctx: "[go]"), smollm2)
    assert len(samples) == 6
    assert {s.status for s in samples} == {Status.TRUNCATED}
    assert {s.reason for s in samples} == {"max_moves: 6 moves without the match ending"}
    assert {s.reward for s in samples} == {0.0}
    summary = GameTally()
    summary.add(samples)
    seats = summary.summary()["seats"]
    assert seats["a"]["truncated_rate"] == 1.0 and seats["a"]["draw_rate"] == 0.0


async def test_context_limit_truncates_the_match(smollm2: ChatTokenizer) -> None:
    # the first reply fills the context; the feedback after it no longer fits
    config = RolloutConfig(concurrency=1, limits=Limits(context_length=60))
    model = ScriptedModel(smollm2, lambda ctx: "let me think " * 40)
    samples = await play(GameEnv(Endless, retries=1), model, smollm2, config=config)
    a, b = by_role(samples, "a"), by_role(samples, "b")
    assert len(a) == 1 and a[0].trainable and a[0].num_generated + len(a[0].prompt_ids) == 60
    assert len(b) == 1 and not b[0].trainable  # never moved
    assert {s.status for s in samples} == {Status.TRUNCATED}
    assert all(s.reason and s.reason.startswith("context: appending") for s in samples)
    assert {s.metadata["outcome"] for s in samples} == {"truncated"}


class Raises(RandomPlayer):
    name = "raiser"

    def act(self, game: Game, role: str, rng: random.Random) -> str:
        assert isinstance(game, TicTacToe)
        if game.history[0] == 5:
            raise RuntimeError("cannot handle the centre")
        return super().act(game, role, rng)


class Cheats(RandomPlayer):
    name = "cheater"

    def act(self, game: Game, role: str, rng: random.Random) -> str:
        return "5"


async def test_a_raising_opponent_fails_only_its_episode(smollm2: ChatTokenizer) -> None:
    # task test-0: the model (x) takes the centre and the opponent raises; test-2: a corner
    model = ScriptedModel(
        smollm2, lambda ctx: "[5]" if "test-0@" in (ctx.rid or "") else first_legal(ctx)
    )
    env = TicTacToeEnv(opponent=Raises(), seat="x")
    tasks = [t for t in env.tasks("test")[:3] if t.id != "test-1"]
    samples = await play(env, model, smollm2, tasks=tasks)
    failed = [s for s in samples if s.status is Status.FAILED]
    assert len(failed) == 1 and failed[0].error_type == "OpponentError"
    assert failed[0].reason == (
        "opponent 'raiser' (as 'o', move 1 of tictactoe) raised RuntimeError: "
        "cannot handle the centre"
    )
    assert failed[0].task_id == "test-0"
    assert {s.task_id for s in samples if s.status is Status.COMPLETED} == {"test-2"}


async def test_an_opponent_playing_an_illegal_move_fails_the_episode(
    smollm2: ChatTokenizer,
) -> None:
    model = ScriptedModel(smollm2, lambda ctx: "[5]")
    samples = await play(TicTacToeEnv(opponent=Cheats(), seat="x"), model, smollm2)
    (failed,) = samples
    assert failed.error_type == "OpponentError"
    assert (
        failed.reason is not None
        and "'cheater' (as 'o', move 1 of tictactoe) chose an illegal move: '5' is not a legal move"
        in failed.reason
    )


async def test_frozen_model_opponent_makes_no_samples(smollm2: ChatTokenizer) -> None:
    frozen_prompts: list[str] = []

    def frozen(ctx: ScriptContext) -> str:
        frozen_prompts.append(ctx.text)
        return first_legal(ctx)

    model = ScriptedModel(smollm2, first_legal)
    env = TicTacToeEnv(opponent=ScriptedModel(smollm2, frozen))
    assert env.opponent_name == "model"
    samples = await play(env, model, smollm2, n=2)
    assert {s.role for s in samples if s.task_id == "test-0"} == {"x"}
    assert {s.role for s in samples if s.task_id == "test-1"} == {"o"}  # seats alternate
    assert frozen_prompts and all("Legal moves" in p for p in frozen_prompts)
    assert model.calls == len(samples)


async def test_frozen_opponent_forfeit_before_the_seat_moved(smollm2: ChatTokenizer) -> None:
    env = TicTacToeEnv(opponent=ScriptedModel(smollm2, lambda ctx: "pass"), seat="o")
    samples = await play(env, ScriptedModel(smollm2, first_legal), smollm2)
    (o,) = samples
    assert o.metadata["outcome"] == "win" and o.metadata["moves"] == 0 and not o.trainable
    assert "You play O" in smollm2.decode(o.prompt_ids)


@pytest.mark.parametrize(
    ("seat", "expected"),
    [("alternate", ["x", "o", "x", "o"]), ("o", ["o", "o", "o", "o"])],
)
async def test_seats(smollm2: ChatTokenizer, seat: str, expected: list[str]) -> None:
    env = TicTacToeEnv(opponent="random", seat=seat)
    samples = await play(env, ScriptedModel(smollm2, first_legal), smollm2, n=4)
    roles = {s.task_id: s.role for s in samples}
    assert [roles[f"test-{i}"] for i in range(4)] == expected


async def test_random_seat_is_drawn_per_episode_and_reproducible(smollm2: ChatTokenizer) -> None:
    env = TicTacToeEnv(opponent="random", seat="random")
    model = ScriptedModel(smollm2, first_legal)
    config = RolloutConfig(concurrency=4, seed=7)
    runs = [await play(env, model, smollm2, n=12, config=config) for _ in range(2)]
    seats = [sorted({(s.task_id, s.role) for s in run}) for run in runs]
    assert seats[0] == seats[1]
    assert {r for _, r in seats[0]} == {"x", "o"}


async def test_scripted_opponents_are_seeded_per_episode(smollm2: ChatTokenizer) -> None:
    env = TicTacToeEnv(opponent="random", seat="x")
    model = ScriptedModel(smollm2, first_legal)
    config = RolloutConfig(concurrency=4, n_samples_per_prompt=4, seed=1)

    async def games() -> list[tuple[object, ...]]:
        samples = await play(env, model, smollm2, n=2, config=config)
        return sorted(
            (s.task_id, s.episode, s.metadata["turn"], s.metadata["action"]) for s in samples
        )

    first = await games()
    assert first == await games()
    lines = {
        tuple(a for t, e, _, a in first if (t, e) == key)
        for key in {(t, e) for t, e, _, _ in first}
    }
    assert len(lines) > 1  # the random opponent varies between episodes


def test_opponent_and_option_errors() -> None:
    with pytest.raises(
        ConfigError,
        match=r"unknown opponent 'optimall' for tictactoe; named players: \['optimal', 'random'\]",
    ):
        TicTacToeEnv(opponent="optimall")
    with pytest.raises(
        ConfigError,
        match=r"seat must be 'alternate', 'random' or a role of tictactoe \['x', 'o'\], got 'y'",
    ):
        TicTacToeEnv(opponent="random", seat="y")
    with pytest.raises(ConfigError, match=r"got the class RandomPlayer; pass RandomPlayer\(\)"):
        TicTacToeEnv(opponent=RandomPlayer)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="opponent must be a Player"):
        TicTacToeEnv(opponent=42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="pass game=<Game subclass> or override new_game"):
        GameEnv()
    with pytest.raises(ConfigError, match="game factory returned str, not a Game"):
        GameEnv(lambda: "tictactoe")  # type: ignore[arg-type, return-value]
    bad: list[tuple[dict[str, object], str]] = [
        ({"retries": -1}, "retries must be at least 0, got -1"),
        ({"discount": 0.0}, r"discount must be in \(0, 1\], got 0.0"),
        ({"max_moves": 0}, "max_moves must be at least 1, got 0"),
        ({"invalid_penalty": float("nan")}, "invalid_penalty must be finite, got nan"),
        ({"baseline": 1.5}, r"decay must be in \[0, 1\), got 1.5"),
    ]
    for kwargs, message in bad:
        with pytest.raises(ConfigError, match=message):
            TicTacToeEnv(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="split must be one of"):
        TicTacToeEnv().tasks("dev")


async def test_bad_returns_name_the_game(smollm2: ChatTokenizer) -> None:
    class NoReturns(TicTacToe):
        def returns(self) -> dict[str, float]:
            return {"x": 1.0}

    model = ScriptedModel(smollm2, first_legal)
    failed = await play(GameEnv(NoReturns), model, smollm2)
    assert {s.role for s in failed} == {"x", "o"}  # each seat's moves are kept to inspect
    for s in failed:
        assert s.error_type == "ConfigError" and s.completion_ids and not s.trainable
        assert s.reason == (
            "NoReturns.returns() must give a finite number for every role ['x', 'o'], "
            "got {'x': 1.0}"
        )
    # One failed episode, however many samples it keeps.
    stats = await run_rollouts(
        GameEnv(NoReturns), GameEnv(NoReturns).tasks("test")[:1], model, tokenizer=smollm2
    )
    assert stats.failed_episodes == 1 and sum(stats.failed.values()) > 1  # (a sample a move)


async def test_buffer_groups_are_per_role(smollm2: ChatTokenizer) -> None:
    from agentenv.buffer import Buffer, BufferConfig

    env = TicTacToeEnv()
    model = ScriptedModel(smollm2, first_legal)
    async with Buffer(BufferConfig(n_samples_per_prompt=2)) as buffer:
        await run_rollouts(
            env,
            env.tasks("train")[:3],
            model,
            tokenizer=smollm2,
            sink=buffer,
            config=RolloutConfig(n_samples_per_prompt=2),
        )
        batch = await buffer.get_batch(6)
    assert sorted((g.task_id, g.role) for g in batch.groups) == [
        (t, r) for t in ("train-0", "train-1", "train-2") for r in ("o", "x")
    ]
    for g in batch.groups:
        assert {s.role for s in g.samples} == {g.role}
        assert {s.episode for s in g.samples} == {0, 1}


async def test_every_trained_role_gets_a_final_sample(smollm2: ChatTokenizer) -> None:
    make: Callable[[], Game] = TicTacToe
    env = GameEnv(make, opponent="random")
    model = ScriptedModel(smollm2, first_legal)
    samples = await play(env, model, smollm2, n=10)
    finals = [s for s in samples if s.metadata.get("final")]
    assert len(finals) == 10 and len({s.task_id for s in finals}) == 10


async def test_an_engine_abort_ends_the_match_as_aborted(smollm2: ChatTokenizer) -> None:
    from agentenv import Completion, FinishReason, SamplingParams

    scripted = ScriptedModel(smollm2, first_legal)

    class AbortsThirdCall:
        calls = 0

        async def generate(
            self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
        ) -> Completion:
            self.calls += 1
            if self.calls == 3:
                return Completion(
                    output_ids=[],
                    logprobs=[],
                    finish_reason=FinishReason("abort", message="weights updated"),
                    weight_version="1",
                )
            return await scripted.generate(input_ids, params, rid=rid)

    samples = await play(TicTacToeEnv(), AbortsThirdCall(), smollm2)
    assert {s.status for s in samples} == {Status.ABORTED}
    assert {s.reason for s in samples} == {"weights updated"}
    assert {s.metadata["outcome"] for s in samples} == {"aborted"}
    assert len([s for s in samples if s.trainable]) == 2  # the two turns played before it


async def test_a_failing_frozen_model_is_an_opponent_error(smollm2: ChatTokenizer) -> None:
    from agentenv import Completion, ModelPlayer, SamplingParams

    class Down:
        async def generate(
            self, input_ids: Sequence[int], params: SamplingParams, *, rid: str | None = None
        ) -> Completion:
            raise RuntimeError("connection refused")

    env = TicTacToeEnv(opponent=ModelPlayer(Down(), name="endpoint"), seat="x")
    (failed,) = await play(env, ScriptedModel(smollm2, first_legal), smollm2)
    assert failed.error_type == "OpponentError"
    assert failed.reason == (
        "opponent 'endpoint' (as 'o', move 1 of tictactoe) raised RuntimeError: connection refused"
    )


class _CutShort(Game):
    """One move each, then the game's own limit ends the match undecided."""

    name = "cut_short"
    roles = ("a", "b")

    def reset(self, seed: int) -> None:
        self.moves: list[str] = []

    def current_role(self) -> str | None:
        return self.roles[len(self.moves)] if len(self.moves) < 2 else None

    def observation(self, role: str) -> list[Message]:
        return [{"role": "user", "content": f"You are {role}. Legal moves: [1]"}]

    def legal_actions(self) -> list[str] | None:
        return ["1"]

    def apply(self, action: str) -> None:
        self.moves.append(action)

    def returns(self) -> dict[str, float]:
        return {"a": 0.0, "b": 0.0}

    def truncated(self) -> bool:
        return True


async def test_a_match_the_game_cuts_short_is_truncated_not_a_draw(
    smollm2: ChatTokenizer,
) -> None:
    env = GameEnv(_CutShort, n_test=2)
    sink = TallySink(ListSink())
    model = ScriptedModel(smollm2, first_legal)
    config = RolloutConfig(concurrency=1)
    await run_rollouts(env, env.tasks("test"), model, tokenizer=smollm2, sink=sink, config=config)
    summary = sink.tally.summary()
    assert summary["truncated_rate"] == 1.0 and summary["draw_rate"] == 0.0
    assert {s.status for s in sink.inner.samples} == {Status.TRUNCATED}  # type: ignore[attr-defined]
