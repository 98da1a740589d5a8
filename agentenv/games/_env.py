""":class:`GameEnv`: an environment that plays a :class:`Game`, one sample per trained turn.

Each episode is one match: the trained policy in every seat (self-play) or in one seat
against a fixed opponent. Every turn of a trained seat is a fresh transcript (the role's
observation, the reply, any retry feedback) and one sample with ``role`` set; each role
only sees its own observation, which holds parsed moves, never another player's text.
Rewards, discounting, baselines and the metadata: docs/games.md ("Playing: GameEnv").
Samples keep the episode's ``group_id``: the Buffer groups by (task, role)."""

from __future__ import annotations

import dataclasses
import math
import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar

from agentenv._environment import Environment, Episode, Task, complete, derive_seed
from agentenv._errors import (
    ConfigError,
    EpisodeAborted,
    EpisodeTruncated,
    IllegalMoveError,
    OpponentError,
    at_least,
)
from agentenv._generator import Generator
from agentenv._sample import JSONValue, Sample, Status
from agentenv._transcript import Transcript
from agentenv.games._baseline import RoleBaseline
from agentenv.games._game import Game, InvalidMove, checked_legal_actions
from agentenv.games._players import ModelPlayer, Player, RandomPlayer

__all__ = ["GameEnv", "Opponent"]

Opponent = Player | ModelPlayer
SELF_PLAY = "self-play"
_SPLIT_SEEDS = {"train": 1, "test": 2}


def _derive_seed(*parts: object) -> int:
    return derive_seed(*parts, size=8) & 0x7FFFFFFF


@dataclasses.dataclass(slots=True)
class _Turn:
    """One turn of a seat: its transcript, the match move number, what happened."""

    transcript: Transcript
    move: int
    action: str | None = None
    invalid: list[str] = dataclasses.field(default_factory=list)
    attempts: int = 0


def _outcomes(returns: Mapping[str, float]) -> dict[str, str]:
    """Each role's outcome: ``win`` above every other role's return, ``draw`` tying the
    best, ``loss`` below it; a one-role game wins with a positive return."""
    if len(returns) == 1:
        return {r: "win" if v > 0 else "loss" if v < 0 else "draw" for r, v in returns.items()}
    out: dict[str, str] = {}
    for role, value in returns.items():
        best_other = max(v for r, v in returns.items() if r != role)
        out[role] = "win" if value > best_other else "draw" if value == best_other else "loss"
    return out


class GameEnv(Environment):
    """Self-play, or play against a fixed opponent, in a :class:`Game`.

    Args (the playing ones as docs/games.md's table explains them):
        game: makes a new match (a :class:`Game` subclass or any factory; or override
            :meth:`new_game`).
        opponent: ``None`` (self-play), a name in :attr:`players`, a :class:`Player`, a
            :class:`ModelPlayer` or a generator (a frozen model in the other seats).
        seat: with an opponent: ``"alternate"`` (by task index), ``"random"`` or a role.
        retries: invalid moves a player may retry, told why, before it forfeits.
        invalid_penalty, forfeit_reward: the forfeiting role's return; every other's.
        discount: in ``(0, 1]``: ``Sample.advantage_scale = discount ** (K - 1 - k)``.
        baseline: a :class:`RoleBaseline` (or its decay) subtracted from returns.
        max_moves: moves per match before it ends truncated.
        n_train, n_test: tasks per split (each a seed).

    Class attributes:
        players: the named scripted opponents (``--opponent NAME``).
    """

    players: ClassVar[Mapping[str, Callable[[], Player]]] = {"random": RandomPlayer}

    def __init__(
        self,
        game: Callable[[], Game] | None = None,
        *,
        opponent: Opponent | Generator | str | None = None,
        seat: str = "alternate",
        retries: int = 0,
        invalid_penalty: float = -1.0,
        forfeit_reward: float = 0.0,
        discount: float = 1.0,
        baseline: RoleBaseline | float | None = None,
        max_moves: int = 100,
        n_train: int = 1000,
        n_test: int = 200,
    ) -> None:
        self._factory = game
        if not (0.0 < discount <= 1.0):
            raise ConfigError(f"discount must be in (0, 1], got {discount}")
        for label, value in (
            ("invalid_penalty", invalid_penalty),
            ("forfeit_reward", forfeit_reward),
        ):
            if not math.isfinite(value):
                raise ConfigError(f"{label} must be finite, got {value}")
        self.retries = at_least("retries", retries, 0)
        self.invalid_penalty = float(invalid_penalty)
        self.forfeit_reward = float(forfeit_reward)
        self.discount = discount
        self.baseline = RoleBaseline(baseline) if isinstance(baseline, (int, float)) else baseline
        self.max_moves = at_least("max_moves", max_moves, 1)
        self.sizes = {"train": at_least("n_train", n_train, 1)}
        self.sizes["test"] = at_least("n_test", n_test, 1)
        probe = self.new_game()
        self.roles: tuple[str, ...] = tuple(probe.roles)
        self.game_name = probe.name or type(probe).__name__
        if len(self.roles) < 1 or len(set(self.roles)) != len(self.roles):
            raise ConfigError(f"{self.game_name} must have distinct roles, got {self.roles}")
        self.opponent: Opponent | None = None
        self.seat = "alternate"
        self.set_opponent(opponent, seat=seat)

    # -- configuration -------------------------------------------------------------------
    def check(self) -> None:
        """Before a run: the game's first position lists its moves as strings (or none)."""
        probe = self.new_game()
        probe.reset(0)
        if probe.current_role() is not None:
            checked_legal_actions(probe)

    def new_game(self) -> Game:
        """A new, not yet reset, match."""
        if self._factory is None:
            raise ConfigError(
                f"{type(self).__name__} has no game: pass game=<Game subclass> or override "
                "new_game()"
            )
        game = self._factory()
        if not isinstance(game, Game):
            raise ConfigError(f"game factory returned {type(game).__name__}, not a Game")
        return game

    def set_opponent(
        self, opponent: Opponent | Generator | str | None, *, seat: str | None = None
    ) -> None:
        """Change the opponent (and the trained seat); see the class arguments."""
        if isinstance(opponent, str):
            if opponent in (SELF_PLAY, "self"):
                opponent = None
            elif opponent in self.players:
                opponent = self.players[opponent]()
            else:
                raise ConfigError(
                    f"unknown opponent {opponent!r} for {self.game_name}; named players: "
                    f"{sorted(self.players)} (or {SELF_PLAY!r}, a Player, a ModelPlayer or "
                    "a generator)"
                )
        elif isinstance(opponent, type):
            raise ConfigError(
                f"opponent must be an instance, got the class {opponent.__name__}; "
                f"pass {opponent.__name__}()"
            )
        elif opponent is not None and not isinstance(opponent, (Player, ModelPlayer)):
            if not isinstance(opponent, Generator):
                raise ConfigError(
                    f"opponent must be a Player, a ModelPlayer, a generator, a player name or "
                    f"None, got {type(opponent).__name__}"
                )
            opponent = ModelPlayer(opponent)
        seat = self.seat if seat is None else seat
        if seat not in ("alternate", "random", *self.roles):
            raise ConfigError(
                f"seat must be 'alternate', 'random' or a role of {self.game_name} "
                f"{list(self.roles)}, got {seat!r}"
            )
        self.opponent, self.seat = opponent, seat

    @property
    def opponent_name(self) -> str:
        return SELF_PLAY if self.opponent is None else self.opponent.name

    def tasks(self, split: str = "train") -> list[Task]:
        """``n_train``/``n_test`` matches, each a seed (``info["seed"]``) and an index."""
        if split not in self.sizes:
            raise ConfigError(f"split must be one of {sorted(self.sizes)}, got {split!r}")
        rng = random.Random(_SPLIT_SEEDS[split])
        return [
            Task(id=f"{split}-{i}", info={"seed": rng.getrandbits(31), "index": i, "split": split})
            for i in range(self.sizes[split])
        ]

    async def score_group(self, task: Task, samples: Sequence[Sample]) -> Sequence[Sample]:
        """With a :class:`RoleBaseline`: every sample of a role in this group gets the same
        baseline subtracted (one snapshot per group, so equal outcomes stay equal), then
        the group's completed training matches update it (matches of the test split never
        do)."""
        if self.baseline is None:
            return samples
        out = list(samples)
        for role in sorted({s.role for s in out if s.role is not None}):
            base = self.baseline.value(self.game_name, role)
            for i, s in enumerate(out):
                if s.role == role:
                    meta = {**s.metadata, "baseline": base}
                    out[i] = dataclasses.replace(s, reward=s.reward - base, metadata=meta)
        if task.info.get("split", "train") == "train":
            seen: set[tuple[int | None, str]] = set()
            for s in samples:
                ret, key = s.metadata.get("return"), (s.episode, s.role or "")
                done = s.status is Status.COMPLETED and isinstance(ret, (int, float))
                if done and key not in seen:
                    seen.add(key)
                    self.baseline.update(self.game_name, key[1], float(ret))  # type: ignore[arg-type]
        return out

    def trained_roles(self, task: Task, episode: Episode) -> tuple[str, ...]:
        """The roles the trained policy plays in this episode."""
        if self.opponent is None:
            return self.roles
        if self.seat == "alternate":
            index = task.info.get("index")
            i = index if isinstance(index, int) else episode.index
            return (self.roles[i % len(self.roles)],)
        if self.seat == "random":
            rng = random.Random(_derive_seed("seat", episode.seed, task.id, episode.index))
            return (rng.choice(self.roles),)
        return (self.seat,)

    # -- the episode ---------------------------------------------------------------------
    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        game = self.new_game()
        info_seed = task.info.get("seed")
        seed = info_seed if isinstance(info_seed, int) else _derive_seed("task", task.id)
        game.reset(seed)
        trained = self.trained_roles(task, episode)
        rng = random.Random(_derive_seed("opponent", episode.seed, seed, episode.index))
        turns: dict[str, list[_Turn]] = {r: [] for r in trained}
        moves = 0
        forfeit: str | None = None
        status, reason = Status.COMPLETED, None
        try:
            while (role := game.current_role()) is not None:
                if moves >= self.max_moves:
                    status = Status.TRUNCATED
                    reason = f"max_moves: {self.max_moves} moves without the match ending"
                    break
                if role in turns:
                    played = await self._model_turn(game, role, episode, turns[role], moves)
                elif isinstance(self.opponent, ModelPlayer):
                    played = await self._frozen_turn(game, role, episode, self.opponent, moves)
                else:
                    assert self.opponent is not None
                    self._scripted_turn(game, role, self.opponent, rng, moves)
                    played = True
                if not played:
                    forfeit = role
                    break
                moves += 1
            if status is Status.COMPLETED and forfeit is None and game.truncated():
                status, reason = Status.TRUNCATED, f"{self.game_name} cut the match short"
        except EpisodeTruncated as e:
            status, reason = Status.TRUNCATED, e.reason
        except EpisodeAborted as e:
            status, reason = Status.ABORTED, str(e) or "aborted"
        returns, outcomes = self._returns(game, status, forfeit)
        meta: dict[str, JSONValue] = {
            "game": self.game_name,
            "opponent": self.opponent_name,
            "moves": moves,
        }
        samples: list[Sample] = []
        for role in trained:
            samples += self._role_samples(
                game, role, turns[role], returns[role], outcomes[role], forfeit, meta, episode,
                status, reason,
            )  # fmt: skip
        return samples

    def _returns(
        self, game: Game, status: Status, forfeit: str | None
    ) -> tuple[dict[str, float], dict[str, str]]:
        if status is not Status.COMPLETED:
            label = "truncated" if status is Status.TRUNCATED else "aborted"
            return dict.fromkeys(self.roles, 0.0), dict.fromkeys(self.roles, label)
        if forfeit is not None:
            returns = dict.fromkeys(self.roles, self.forfeit_reward)
            returns[forfeit] = self.invalid_penalty
            outcomes = dict.fromkeys(self.roles, "win")
            outcomes[forfeit] = "loss"
            return returns, outcomes
        raw = game.returns()
        returns = {}
        for role in self.roles:
            value = raw.get(role)
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
            ):
                raise ConfigError(
                    f"{type(game).__name__}.returns() must give a finite number for every role "
                    f"{list(self.roles)}, got {raw!r}"
                )
            returns[role] = float(value)
        return returns, _outcomes(returns)

    def _role_samples(
        self,
        game: Game,
        role: str,
        turns: Sequence[_Turn],
        ret: float,
        outcome: str,
        forfeit: str | None,
        meta: Mapping[str, JSONValue],
        episode: Episode,
        status: Status,
        reason: str | None,
    ) -> list[Sample]:
        common: dict[str, JSONValue] = {**meta, "return": ret, "outcome": outcome}
        out: list[Sample] = []
        k_last = len(turns) - 1
        for k, turn in enumerate(turns):
            metadata: dict[str, JSONValue] = {
                **common,
                "turn": turn.move,
                "role_turn": k,
                "action": turn.action,
                "invalid": len(turn.invalid),
                "invalid_reasons": list(turn.invalid),
                "attempts": turn.attempts,
                "forfeit": forfeit == role and k == k_last,
            }
            # Scales the advantage, not the reward: GRPO's normalisation would turn a
            # discounted reward of a won match into a negative advantage.
            out += episode.samples(
                turn.transcript, ret, status=status, reason=reason, metadata=metadata,
                advantage_scale=self.discount ** (k_last - k),
            )  # fmt: skip
        if not out:
            # The seat never generated (an opponent forfeited first, or a limit hit before
            # its first turn): one sample with no completion keeps the outcome on record.
            prompt = Transcript(
                episode.tokenizer,
                game.observation(role),
                role=role,
                chat_template_kwargs=episode.chat_template_kwargs,
            )
            out.append(
                Sample(
                    prompt_ids=prompt.ids,
                    completion_ids=[],
                    reward=ret,
                    group_id=episode.group_id,
                    role=role,
                    status=status,
                    reason=reason,
                    metadata={**common, "turn": None, "attempts": 0, "invalid": 0},
                )
            )
        out[-1].metadata["final"] = True
        return out

    async def _model_turn(
        self, game: Game, role: str, episode: Episode, turns: list[_Turn], move: int
    ) -> bool:
        """One turn of a trained seat; False when it forfeits after its retries."""
        transcript = episode.transcript(game.observation(role), role=role)
        turn = _Turn(transcript, move)
        turns.append(turn)
        for attempt in range(self.retries + 1):
            turn.attempts += 1
            sampling: dict[str, Any] = {}
            if episode.seed is not None and episode.sampling.seed is None:
                # Every turn is a new transcript: seed each one apart, or all turns of a
                # role would sample with the same seed.
                sampling["seed"] = _derive_seed("turn", episode.seed, role, move, attempt)
            reply = await episode.generate(transcript, **sampling)
            played = self._try_move(game, role, reply["content"])
            if not isinstance(played, InvalidMove):
                turn.action = played
                return True
            turn.invalid.append(played.reason)
            if attempt < self.retries:
                transcript.add_messages([_feedback(played)])
        return False

    async def _frozen_turn(
        self, game: Game, role: str, episode: Episode, player: ModelPlayer, move: int
    ) -> bool:
        """One turn of a frozen model's seat (no sample); False when it forfeits."""
        tokenizer = player.tokenizer or episode.tokenizer
        # The episode's template arguments are for its tokenizer's template, not another's.
        kwargs = episode.chat_template_kwargs if player.tokenizer is None else None
        transcript = Transcript(
            tokenizer, game.observation(role), role=role, chat_template_kwargs=kwargs
        )
        params = player.sampling or episode.sampling
        for attempt in range(self.retries + 1):
            rid = f"{episode.group_id}/{episode.index}/{role}/{move}/{attempt}"
            call = params
            if params.seed is None and episode.seed is not None:
                call = params.replace(
                    seed=_derive_seed("frozen", episode.seed, role, move, attempt)
                )
            try:
                completion = await complete(player.generator, transcript, call, rid)
                if completion.finish_reason.type == "abort":
                    raise EpisodeAborted(completion.finish_reason.message or "opponent aborted")
                reply = transcript.add_completion(completion)
            except EpisodeAborted:
                raise
            except Exception as e:
                raise OpponentError(
                    f"opponent {player.name!r} (as {role!r}, move {move} of {self.game_name}) "
                    f"raised {type(e).__name__}: {e}"
                ) from e
            played = self._try_move(game, role, reply["content"])
            if not isinstance(played, InvalidMove):
                return True
            if attempt < self.retries:
                transcript.add_messages([_feedback(played)])
        return False

    def _scripted_turn(
        self, game: Game, role: str, player: Player, rng: random.Random, move: int
    ) -> None:
        where = f"as {role!r}, move {move} of {self.game_name}"
        try:
            action = player.act(game, role, rng)
        except Exception as e:
            raise OpponentError(
                f"opponent {player.name!r} ({where}) raised {type(e).__name__}: {e}"
            ) from e
        try:
            game.play(role, action)
        except IllegalMoveError as e:
            raise OpponentError(
                f"opponent {player.name!r} ({where}) chose an illegal move: {e}"
            ) from e

    @staticmethod
    def _try_move(game: Game, role: str, text: str) -> str | InvalidMove:
        """Parse ``text`` and play it: the move played, or why it is not a legal move."""
        choice = game.parse(text)
        if isinstance(choice, InvalidMove):
            return choice
        try:
            game.play(role, choice)
        except IllegalMoveError as e:
            return InvalidMove(str(e), text=choice)
        return choice


def _feedback(problem: InvalidMove) -> dict[str, Any]:
    return {"role": "user", "content": f"Invalid move: {problem.reason} Try again."}
