import agentenv
from agentenv import ChatTokenizer, ScriptedModel
from reverse_env import ReverseEnv


def test_reverse_env() -> None:
    tok = ChatTokenizer.load("smollm2-135m")
    model = ScriptedModel(tok, [("agent", "tnega"), ("token", "nekot!")])
    env = ReverseEnv()
    tasks = [t for t in env.tasks() if t.id in ("agent", "token")]
    result = agentenv.run(env, model, tasks=tasks)
    rewards = {s.task_id: s.reward for s in result.samples}
    assert rewards == {"agent": 1.0, "token": 0.0}
