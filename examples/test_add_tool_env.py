"""The tool episode scripted: the first rule calls the tool, the second reads its result,
which the chat template renders as a ``tool`` turn (``<|im_start|>tool\n5<|im_end|>`` in
SmolLM2's template; print ``ctx.text`` in a script function to see a template's own)."""

from __future__ import annotations

from add_tool_env import AddEnv

import agentenv
from agentenv import ChatTokenizer, ScriptedModel


def test_add_env() -> None:
    tok = ChatTokenizer.load("smollm2-135m")
    rules = [
        (
            r"What is (\d+) \+ (\d+)\?",
            '<tool_call>\n{"name": "add", "arguments": {"a": \\1, "b": \\2}}\n</tool_call>',
        ),
        (r"<\|im_start\|>tool\n(\d+)<\|im_end\|>", r"The answer is \1."),
    ]
    result = agentenv.run(AddEnv(), ScriptedModel(tok, rules))
    assert [s.reward for s in result.samples] == [1.0, 1.0]
    assert all(s.metadata["tool_calls"] == 1 for s in result.samples)
    # The tool's output is environment tokens (mask 0) between the model's turns.
    mask = list(result.samples[0].loss_mask)
    assert 0 in mask and mask[0] == 1 and mask[-1] == 1
