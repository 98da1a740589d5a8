import random

from agentenv import Game, GameEnv, Message


class RaceTo21(Game):
    """Players take turns adding 1, 2 or 3 to a total; whoever reaches 21 wins."""

    name = "race_to_21"
    roles = ("first", "second")
    move_hint = "[2]"

    def reset(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.total = self.rng.randint(0, 5)  # a seeded head start varies the matches
        self.moves: list[str] = []

    def current_role(self) -> str | None:
        return None if self.total >= 21 else self.roles[len(self.moves) % 2]

    def legal_actions(self) -> list[str] | None:
        return [str(n) for n in (1, 2, 3) if self.total + n <= 21]

    def apply(self, action: str) -> None:
        self.total += int(action)
        self.moves.append(action)

    def returns(self) -> dict[str, float]:
        winner = self.roles[(len(self.moves) - 1) % 2]
        return {role: 1.0 if role == winner else -1.0 for role in self.roles}

    def observation(self, role: str) -> list[Message]:
        rules = (
            "Race to 21: players take turns adding 1, 2 or 3 to the total; whoever "
            "reaches exactly 21 wins. End your reply with your number in brackets, e.g. [2]."
        )
        legal = ", ".join(f"[{a}]" for a in self.legal_actions() or [])
        return [
            {"role": "system", "content": rules},
            {"role": "user", "content": f"You are {role}. Total: {self.total}. Legal: {legal}"},
        ]


class RaceTo21Env(GameEnv):
    name = "race_to_21"

    def new_game(self) -> Game:
        return RaceTo21()
