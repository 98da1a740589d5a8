"""Token-exact transcripts across template families."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv import (
    ChatTokenizer,
    Completion,
    ContextLengthError,
    EpisodeTruncated,
    FinishReason,
    GenerationError,
    HistoryRewriteError,
    MessageError,
    TemplateError,
    Transcript,
)
from agentenv._scripted import scripted_logprob


def completion(
    tok: ChatTokenizer, text: str, *, eot: bool = True, version: str = "v0"
) -> Completion:
    """What an engine returns for ``text``: its ids, the end-of-turn id, aligned log-probs."""
    ids = tok.encode(text)
    assert tok.eos_token_id is not None
    if eot:
        ids.append(tok.eos_token_id)
        finish = FinishReason("stop", matched=tok.eos_token_id)
    else:
        finish = FinishReason("length", length=len(ids))
    return Completion(
        output_ids=ids,
        logprobs=[scripted_logprob(t, i) for i, t in enumerate(ids)],
        finish_reason=finish,
        weight_version=version,
    )


def test_prompt_is_the_template_rendering(any_template: ChatTokenizer) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
    t = Transcript(any_template, msgs)
    rendered = any_template.render(t.messages, add_generation_prompt=True)
    assert any_template.decode(t.ids) == rendered
    assert t.ids == any_template.encode(rendered)
    assert t.current.completion_ids == []


def test_model_tokens_appended_exactly_and_env_suffix_masked(any_template: ChatTokenizer) -> None:
    t = Transcript(any_template, "What is 2+2?")
    prompt = list(t.ids)
    c1 = completion(any_template, "It is 4.")
    msg = t.add_completion(c1)
    assert msg == {"role": "assistant", "content": "It is 4."}
    seg = t.current
    assert seg.prompt_ids == prompt
    assert seg.completion_ids == c1.output_ids
    assert seg.loss_mask == [1] * len(c1.output_ids)
    appended = t.add_messages([{"role": "user", "content": "And 3+3?"}])
    assert seg.completion_ids[len(c1.output_ids) :] == appended
    assert seg.loss_mask[len(c1.output_ids) :] == [0] * len(appended)
    assert seg.logprobs[len(c1.output_ids) :] == [0.0] * len(appended)
    c2 = completion(any_template, "6")
    t.add_completion(c2)
    # Both model spans are byte-for-byte the ids returned, at their positions.
    n1, n2 = len(c1.output_ids), len(appended)
    assert seg.completion_ids[:n1] == c1.output_ids
    assert seg.completion_ids[n1 + n2 :] == c2.output_ids
    assert seg.logprobs[:n1] == c1.logprobs
    # The whole sequence decodes to what the template renders for the conversation.
    assert any_template.render(t.messages).startswith(any_template.decode(t.ids))


def test_chatml_newline_after_end_of_turn_is_environment_token(smollm2: ChatTokenizer) -> None:
    t = Transcript(smollm2, "hello")
    c = completion(smollm2, "hi")
    t.add_completion(c)
    appended = t.add_messages("bye")
    # The template puts "\n" after <|im_end|>; the model never emitted it: it is mask 0.
    assert smollm2.decode(appended).startswith("\n<|im_start|>user\nbye<|im_end|>\n")
    assert t.current.completion_ids[len(c.output_ids) - 1] == smollm2.eos_token_id


def test_llama3_has_no_newline_after_eot(llama3: ChatTokenizer) -> None:
    eot = llama3.token_to_id("<|eot_id|>")
    assert eot is not None and llama3.eos_token_id == eot
    t = Transcript(llama3, "hello")
    assert t.ids[0] == llama3.token_to_id("<|begin_of_text|>")
    t.add_completion(completion(llama3, "hi"))
    appended = t.add_messages("bye")
    assert llama3.decode(appended).startswith("<|start_header_id|>user<|end_header_id|>")


def test_tools_rendered_by_template(chatml_tools: ChatTokenizer) -> None:
    schema = {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add",
            "parameters": {"type": "object", "properties": {}},
        },
    }
    t = Transcript(chatml_tools, "use a tool", tools=[schema])
    assert chatml_tools.supports_tools
    assert '"name": "add"' in t.text
    assert t.messages[0]["role"] == "user"  # nothing injected: the template handles tools
    t.add_completion(
        completion(chatml_tools, '<tool_call>{"name": "add", "arguments": {}}</tool_call>')
    )
    appended = t.add_messages(
        [
            {"role": "tool", "content": "3", "name": "add"},
            {"role": "tool", "content": "4", "name": "add"},
        ]
    )
    text = chatml_tools.decode(appended)
    assert text.count("<tool_response>") == 2 and text.count("<|im_start|>user") == 1


def test_tools_described_in_system_prompt_when_template_cannot(smollm2: ChatTokenizer) -> None:
    schema = {"type": "function", "function": {"name": "add", "parameters": {}}}
    t = Transcript(
        smollm2,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
        tools=[schema],
    )
    assert not smollm2.supports_tools
    assert t.messages[0]["content"].startswith("Be brief.\n\n")
    assert "<tools>" in t.messages[0]["content"] and '"name": "add"' in t.text


def test_history_rewrite_raises_with_error_policy(thinking: ChatTokenizer) -> None:
    t = Transcript(thinking, "2+2?", on_history_rewrite="error")
    t.add_completion(completion(thinking, "<think>easy</think>4"))
    with pytest.raises(HistoryRewriteError, match="rewrites history"):
        t.add_messages("and 3+3?")
    # Nothing was appended: the transcript is unchanged.
    assert len(t.segments) == 1 and t.current.loss_mask.count(0) == 0


def test_history_rewrite_starts_new_sample(thinking: ChatTokenizer) -> None:
    t = Transcript(thinking, "2+2?")
    c1 = completion(thinking, "<think>easy</think>4")
    t.add_completion(c1)
    t.add_messages("and 3+3?")
    assert len(t.segments) == 2
    # The new prompt is the history as the template renders it now, think block stripped.
    new_prompt = thinking.decode(t.current.prompt_ids)
    assert "<think>" not in new_prompt and new_prompt.endswith("<|im_start|>assistant\n")
    assert new_prompt == thinking.render(t.messages, add_generation_prompt=True)
    c2 = completion(thinking, "<think>also easy</think>6")
    t.add_completion(c2)
    samples = t.to_samples(1.0)
    assert len(samples) == 2
    assert list(samples[0].completion_ids) == c1.output_ids
    assert list(samples[1].completion_ids) == c2.output_ids
    assert [s.metadata["segment"] for s in samples] == [0, 1]


def test_llama3_trim_of_model_whitespace_is_detected(llama3: ChatTokenizer) -> None:
    t = Transcript(llama3, "hi", on_history_rewrite="error")
    t.add_completion(completion(llama3, "hello \n"))
    with pytest.raises(HistoryRewriteError):
        t.add_messages("again")


def test_truncated_completion_gets_end_of_turn_from_environment(smollm2: ChatTokenizer) -> None:
    t = Transcript(smollm2, "count")
    c = completion(smollm2, "1 2 3", eot=False)
    msg = t.add_completion(c)
    assert msg["content"] == "1 2 3"
    appended = t.add_messages("go on")
    assert smollm2.decode(appended).startswith("<|im_end|>\n<|im_start|>user")


def test_weight_versions_recorded_per_span(smollm2: ChatTokenizer) -> None:
    t = Transcript(smollm2, "a")
    t.add_completion(completion(smollm2, "b", version="3"))
    t.add_messages("c")
    t.add_completion(completion(smollm2, "d", version="4"))
    (sample,) = t.to_samples(0.5)
    assert sample.weight_versions == ["3", "4"]


def test_no_logprobs_means_none_in_sample(smollm2: ChatTokenizer) -> None:
    t = Transcript(smollm2, "a")
    c = completion(smollm2, "b")
    c.logprobs = None
    t.add_completion(c)
    (sample,) = t.to_samples(0.0)
    assert sample.rollout_logprobs is None


# -- bad input ---------------------------------------------------------------------------
def test_malformed_messages(smollm2: ChatTokenizer) -> None:
    with pytest.raises(MessageError, match="unknown role 'robot'"):
        Transcript(smollm2, [{"role": "robot", "content": "x"}])
    with pytest.raises(MessageError, match="must have string 'content'"):
        Transcript(smollm2, [{"role": "user", "content": 3}])
    with pytest.raises(MessageError, match="must be a dict"):
        Transcript(smollm2, ["hello"])  # type: ignore[list-item]
    t = Transcript(smollm2, "x")
    t.add_completion(completion(smollm2, "y"))
    with pytest.raises(MessageError, match="unknown fields"):
        t.add_messages([{"role": "user", "content": "z", "colour": "red"}])


def test_tokenizer_without_chat_template(smollm2: ChatTokenizer) -> None:
    bare = ChatTokenizer(smollm2._tok, None, eos_token="<|im_end|>", name="bare")
    with pytest.raises(TemplateError, match="has no chat template"):
        Transcript(bare, "hi")


def test_broken_template_is_a_template_error(smollm2: ChatTokenizer) -> None:
    with pytest.raises(TemplateError, match="does not compile"):
        smollm2.with_template("{% for %}")
    bad = smollm2.with_template("{{ raise_exception('no system role allowed') }}")
    with pytest.raises(TemplateError, match="no system role allowed"):
        Transcript(bad, "hi")


def test_prompt_longer_than_context(smollm2: ChatTokenizer) -> None:
    with pytest.raises(ContextLengthError, match=r"prompt has \d+ tokens but context_length is 16"):
        Transcript(smollm2, "word " * 50, context_length=16)


def test_environment_turn_past_context_truncates(smollm2: ChatTokenizer) -> None:
    t = Transcript(smollm2, "hi", context_length=40)
    t.add_completion(completion(smollm2, "hello"))
    with pytest.raises(EpisodeTruncated, match="context"):
        t.add_messages("tell me a long story " * 10)


def test_characters_without_tokens_are_dropped_not_fatal(smollm2: ChatTokenizer) -> None:
    t = Transcript(smollm2, "a\x06b")
    assert "\x06" not in smollm2.decode(t.ids)
    t.add_completion(completion(smollm2, "ok"))
    t.add_messages("tool said \x06")  # the prefix check uses rendered text, so this works
    assert smollm2.decode(t.ids).endswith("tool said <|im_end|>\n<|im_start|>assistant\n")


def test_empty_completion_is_an_error(smollm2: ChatTokenizer) -> None:
    t = Transcript(smollm2, "hi")
    empty = Completion(output_ids=[], logprobs=[], finish_reason=FinishReason("length", length=0))
    with pytest.raises(GenerationError, match="empty completion"):
        t.add_completion(empty)


# -- property test ------------------------------------------------------------------------
_text = st.text(
    # Excluded: characters SmolLM2 has no byte token for (some controls, planes 4+).
    alphabet=st.characters(
        blacklist_categories=("Cs", "Cc", "Cn", "Co"),
        max_codepoint=0x2FFFF,
        blacklist_characters="<>",
    ),
    min_size=1,
    max_size=40,
).filter(lambda s: s.strip() == s and s.strip() != "")


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    opening=_text,
    turns=st.lists(
        st.tuples(
            _text,
            st.lists(st.tuples(st.sampled_from(["user", "tool"]), _text), min_size=1, max_size=3),
        ),
        min_size=1,
        max_size=4,
    ),
    family=st.sampled_from(["smollm2", "chatml_tools", "llama3"]),
)
def test_property_decode_reproduces_render_and_spans_are_exact(
    request: pytest.FixtureRequest,
    opening: str,
    turns: list[tuple[str, list[tuple[str, str]]]],
    family: str,
) -> None:
    tok: ChatTokenizer = request.getfixturevalue(family)
    t = Transcript(tok, opening, on_history_rewrite="error")
    spans: list[tuple[int, list[int]]] = []
    for reply, env_msgs in turns:
        c = completion(tok, reply)
        spans.append((len(t.current.completion_ids), list(c.output_ids)))
        t.add_completion(c)
        # Group tool messages after each other, as a tool-use environment sends them.
        msgs = sorted(({"role": r, "content": x} for r, x in env_msgs), key=lambda m: m["role"])
        t.add_messages(msgs)
        assert tok.decode(t.ids) == tok.render(t.messages, add_generation_prompt=True)
    seg = t.current
    for start, ids in spans:
        assert seg.completion_ids[start : start + len(ids)] == ids
        assert seg.loss_mask[start : start + len(ids)] == [1] * len(ids)
    assert sum(seg.loss_mask) == sum(len(ids) for _, ids in spans)
    assert len(seg.completion_ids) == len(seg.loss_mask) == len(seg.logprobs)
