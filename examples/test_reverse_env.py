import anyio
from agentenv import ChatTokenizer, ListSink, ScriptedModel, run_rollouts
from reverse_env import ReverseEnv


def test_reverse_env() -> None:
    tok = ChatTokenizer.load("smollm2-135m")
    model = ScriptedModel(tok, [("agent", "tnega"), ("token", "nekot!")])
    env, sink = ReverseEnv(), ListSink()
    tasks = [t for t in env.tasks() if t.id in ("agent", "token")]
    anyio.run(lambda: run_rollouts(env, tasks, model, tokenizer=tok, sink=sink))
    rewards = {s.group_id.split("@")[0]: s.reward for s in sink.samples}
    assert rewards == {"agent": 1.0, "token": 0.0}
