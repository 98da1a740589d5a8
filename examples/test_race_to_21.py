import anyio
from agentenv import ChatTokenizer, ListSink, ScriptedModel, run_rollouts
from race_to_21 import RaceTo21Env


def test_race_to_21() -> None:
    tok = ChatTokenizer.load("smollm2-135m")
    model = ScriptedModel(tok, [(r"Legal: \[(\d)\]", r"I add \1. [\1]")])  # always the least
    env, sink = RaceTo21Env(opponent="random"), ListSink()
    tasks = env.tasks("test")[:20]
    anyio.run(lambda: run_rollouts(env, tasks, model, tokenizer=tok, sink=sink))
    finals = [s for s in sink.samples if s.metadata.get("final")]
    assert len(finals) == 20 and {s.role for s in finals} == {"first", "second"}
    assert all(s.metadata["invalid"] == 0 for s in sink.samples)
