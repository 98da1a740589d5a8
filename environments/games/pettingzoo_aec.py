"""Any PettingZoo AEC game as an agentenv :class:`~agentenv.Game` (``pip install pettingzoo``).

:class:`PettingZooGame` wraps an AEC environment (turn-based: one ``agent_selection`` at a
time): roles are its ``possible_agents``; a role sees ``env.observe(role)`` rendered as
text (by ``describe``, default: the observation's arrays as nested lists) and its legal
moves, the indices of the ``action_mask`` (or of a ``Discrete`` action space); a move is
the action's number in brackets. Returns are the sums of ``env.rewards`` after every
step. Agents that are done are stepped with ``None`` as the AEC API asks; the match is
over when no agent is left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from agentenv import ConfigError, Game, GameEnv, IllegalMoveError, Message, resolve_name
from environments.games._prompt import prompt

Describe = Callable[[Any, str], str]


def _as_text(value: Any) -> str:
    if isinstance(value, dict):
        return "\n".join(f"{k}: {_as_text(v)}" for k, v in value.items() if k != "action_mask")
    tolist = getattr(value, "tolist", None)
    return str(tolist() if callable(tolist) else value)


def default_describe(env: Any, role: str) -> str:
    """``env.observe(role)`` as text: arrays as nested lists, the action mask left out."""
    return _as_text(env.observe(role))


class PettingZooGame(Game):
    """A PettingZoo AEC game.

    Args:
        make_env: returns a new AEC environment (e.g. ``tictactoe_v3.env``).
        describe: ``(env, role) -> str``, what ``role`` is shown of the game.
        name: the game's name (default: ``env.metadata["name"]``).
        rules: a system message explaining the game and its action numbers.
    """

    def __init__(
        self,
        make_env: Callable[[], Any],
        *,
        describe: Describe = default_describe,
        name: str | None = None,
        rules: str = "",
    ) -> None:
        self.env = make_env()
        self.describe = describe
        self.name = name or str(getattr(self.env, "metadata", {}).get("name", "pettingzoo"))
        self.rules = rules
        self.roles = tuple(self.env.possible_agents)
        self.totals: dict[str, float] = dict.fromkeys(self.roles, 0.0)
        self._truncated = False

    def reset(self, seed: int) -> None:
        self.env.reset(seed=seed)
        self.totals = dict.fromkeys(self.roles, 0.0)
        self._truncated = False
        self._skip_done()

    def _skip_done(self) -> None:
        env = self.env
        while env.agents and (
            env.terminations[env.agent_selection] or env.truncations[env.agent_selection]
        ):
            if env.truncations[env.agent_selection]:
                self._truncated = True
            env.step(None)

    def truncated(self) -> bool:
        return self._truncated

    def current_role(self) -> str | None:
        return str(self.env.agent_selection) if self.env.agents else None

    def legal_actions(self) -> list[str] | None:
        role = self.current_role()
        if role is None:
            return []
        obs = self.env.observe(role)
        if isinstance(obs, dict) and "action_mask" in obs:
            return [str(i) for i, ok in enumerate(obs["action_mask"]) if ok]
        n = getattr(self.env.action_space(role), "n", None)
        return [str(i) for i in range(int(n))] if n is not None else None

    def normalize(self, text: str) -> str:
        return text.strip()

    def apply(self, action: str) -> None:
        if not action.isdigit():
            raise IllegalMoveError(f"a move is an action number, got {action!r}")
        self.env.step(int(action))
        for role, reward in self.env.rewards.items():
            self.totals[role] += float(reward)
        self._skip_done()

    def returns(self) -> dict[str, float]:
        return dict(self.totals)

    def observation(self, role: str) -> list[Message]:
        legal = self.legal_actions() if self.current_role() == role else []
        rules = self.rules or (
            f"You are playing {self.name}. Think briefly, then end your reply with the "
            "number of your action in square brackets."
        )
        situation = f"You are {role}. What you see:\n{self.describe(self.env, role)}"
        return prompt(rules, situation, legal or [])


def import_factory(spec: str) -> Callable[[], Any]:
    """The callable named ``package.module:attribute``."""
    factory = resolve_name(spec, what="PettingZoo environment", kind="function")
    if not callable(factory):
        raise ConfigError(f"{spec!r} is not callable")
    return factory  # type: ignore[no-any-return]


class PettingZooEnv(GameEnv):
    """A PettingZoo AEC game as an environment (see :class:`GameEnv` for the options).

    Args:
        env: ``package.module:function`` making the AEC environment, e.g.
            ``pettingzoo.classic.tictactoe.tictactoe:env``.
    """

    name = "pettingzoo"

    def __init__(
        self, env: str = "pettingzoo.classic.tictactoe.tictactoe:env", **kwargs: Any
    ) -> None:
        self.make_env = import_factory(env)
        super().__init__(**kwargs)

    def new_game(self) -> Game:
        return PettingZooGame(self.make_env)
