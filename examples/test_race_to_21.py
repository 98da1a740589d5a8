import agentenv
from agentenv import ChatTokenizer, ScriptedModel
from race_to_21 import RaceTo21Env


def test_race_to_21() -> None:
    tok = ChatTokenizer.load("smollm2-135m")
    model = ScriptedModel(tok, [(r"Legal: \[(\d)\]", r"I add \1. [\1]")])  # always the least
    result = agentenv.run(RaceTo21Env(opponent="random"), model, split="test", n=20)
    finals = [s for s in result.samples if s.metadata.get("final")]
    assert len(finals) == 20 and {s.role for s in finals} == {"first", "second"}
    assert all(s.metadata["invalid"] == 0 for s in result.samples)
