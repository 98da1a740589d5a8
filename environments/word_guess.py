"""``word_guess``: two agents, one secret.

The *clue giver* knows a secret word and writes a one-sentence clue without saying it;
the *guesser* sees only the clues and answers with one word. Up to ``max_rounds`` rounds.
Both score 1 when the guess is right; a clue that says the word ends the episode with
-1 for the clue giver (and the clue is never shown to the guesser). Each agent keeps its
own transcript and yields its own sample with ``role`` set, so one policy can play both
seats (self-play) or a fixed model can take one (``policies={"guesser": other}``).
"""

from __future__ import annotations

import random
import re

from agentenv import Environment, Episode, Sample, Task

WORDS = (
    "apple",
    "river",
    "candle",
    "mountain",
    "piano",
    "garden",
    "rocket",
    "window",
    "bridge",
    "island",
    "coffee",
    "thunder",
    "mirror",
    "forest",
    "castle",
    "pencil",
    "anchor",
    "violin",
    "desert",
    "lantern",
    "glacier",
    "compass",
    "harbor",
    "meadow",
)

CLUE_GIVER, GUESSER = "clue_giver", "guesser"


def first_word(text: str) -> str:
    """The first alphabetic word of ``text``, lower-cased ('' if none)."""
    m = re.search(r"[A-Za-z]+", text)
    return m.group(0).lower() if m else ""


class WordGuessEnv(Environment):
    """A cooperative two-agent game with private information."""

    name = "word_guess"

    def __init__(self, max_rounds: int = 3, n_tasks: int = 200) -> None:
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be at least 1, got {max_rounds}")
        self.max_rounds = max_rounds
        self.n_tasks = n_tasks

    def tasks(self, split: str = "train") -> list[Task]:
        rng = random.Random({"train": 3, "test": 4}[split])
        return [Task(id=f"{split}-{i}", answer=rng.choice(WORDS)) for i in range(self.n_tasks)]

    async def rollout(self, task: Task, episode: Episode) -> list[Sample]:
        secret = str(task.answer)
        giver = episode.transcript(
            [
                {"role": "system", "content": "You are the clue giver in a word game."},
                {
                    "role": "user",
                    "content": f"The secret word is '{secret}'. Give a one-sentence "
                    "clue that helps a partner guess it, without saying the word.",
                },
            ],
            role=CLUE_GIVER,
        )
        guesser = None
        solved = leaked = False
        for _ in range(self.max_rounds):
            clue = (await episode.generate(giver))["content"]
            if secret in clue.lower():
                leaked = True
                break
            if guesser is None:
                guesser = episode.transcript(
                    [
                        {
                            "role": "system",
                            "content": "You are the guesser in a word game. "
                            "Answer with a single word.",
                        },
                        {"role": "user", "content": f"Clue: {clue}"},
                    ],
                    role=GUESSER,
                )
            else:
                guesser.add_messages([{"role": "user", "content": f"Another clue: {clue}"}])
            guess = first_word((await episode.generate(guesser))["content"])
            if guess == secret:
                solved = True
                break
            giver.add_messages(
                [
                    {
                        "role": "user",
                        "content": f"Your partner guessed '{guess}', which is wrong. "
                        "Give another clue.",
                    }
                ]
            )
        giver_reward = -1.0 if leaked else float(solved)
        meta = {"solved": solved, "leaked": leaked}
        samples = episode.samples(giver, giver_reward, metadata=meta)
        if guesser is not None:
            samples += episode.samples(guesser, float(solved), metadata=meta)
        return samples
