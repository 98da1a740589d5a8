"""A small OpenEnv game built with OpenEnv's own server (``create_app``), for the tests.

Run by the OpenEnv interpreter (``uvicorn guess_server:app``), never imported by agentenv.
The player guesses a number from 1 to 3 (``seed % 3 + 1``): reward 1 and ``done`` on the
right guess, 0 on a wrong one, ``done`` after three guesses. Two messages misbehave on
purpose: ``die`` kills the server mid-episode, ``hang`` never answers.
"""

from __future__ import annotations

import os
import time
from typing import Any

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State


class GuessAction(Action):
    message: str


class GuessObservation(Observation):
    text: str = ""


class GuessEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        self._state = State(step_count=0)
        self._secret = 1

    def reset(
        self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any
    ) -> GuessObservation:
        self._state = State(episode_id=episode_id, step_count=0)
        self._secret = (seed or 0) % 3 + 1
        return GuessObservation(text="Guess my number from 1 to 3.", done=False, reward=0.0)

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        guess = action.message.strip()
        if guess == "die":
            os._exit(3)
        if guess == "hang":
            time.sleep(3600)
        if guess == str(self._secret):
            return GuessObservation(text="Right!", done=True, reward=1.0)
        over = self._state.step_count >= 3
        return GuessObservation(text=f"{guess} is wrong. Guess again.", done=over, reward=0.0)

    @property
    def state(self) -> State:
        return self._state


app = create_app(GuessEnvironment, GuessAction, GuessObservation, env_name="guess")
