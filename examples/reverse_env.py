from agentenv import Rubric, SingleTurnEnv, State, Task


def exact(task: Task, state: State) -> float:
    return 1.0 if state.completion.strip() == task.answer else 0.0


class ReverseEnv(SingleTurnEnv):
    name = "reverse"
    system_prompt = "Reverse the word. Reply with the reversed word only."
    rubric = Rubric(exact)

    def tasks(self, split: str = "train") -> list[Task]:
        words = ["agent", "reward", "policy", "token"]
        return [Task(id=w, prompt=w, answer=w[::-1]) for w in words]
