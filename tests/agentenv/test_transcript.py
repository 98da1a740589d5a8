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
    tok: ChatTokenizer,
    text: str,
    *,
    eot: bool = True,
    stop: int | None = None,
    version: str = "v0",
) -> Completion:
    """What an engine returns for ``text``: its ids, a stop id (default: the end-of-turn)
    unless ``eot=False`` (cut at max_new_tokens), aligned log-probs."""
    ids = tok.encode(text)
    assert tok.eos_token_id is not None
    if eot:
        end = tok.eos_token_id if stop is None else stop
        ids.append(end)
        finish = FinishReason("stop", matched=end)
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


def endoftext(tok: ChatTokenizer) -> int:
    """The second stop id of Qwen2.5-style models (``<|endoftext|>``), not the template's."""
    eos = tok.token_to_id("<|endoftext|>")
    assert eos is not None and eos != tok.eos_token_id
    return eos


def test_turns_ending_on_another_stop_id_stay_one_sample(chatml_tools: ChatTokenizer) -> None:
    # Qwen2.5 stops on <|im_end|> and <|endoftext|>; its template closes turns with <|im_end|>.
    tok, eos = chatml_tools, endoftext(chatml_tools)
    t = Transcript(tok, "2+2?", on_history_rewrite="error")
    prompt = list(t.ids)
    replies = ["4", "6", "8"]
    model: list[Completion] = []
    env: list[list[int]] = []
    for k, reply in enumerate(replies):
        c = completion(tok, reply, stop=eos)
        model.append(c)
        assert t.add_completion(c) == {"role": "assistant", "content": reply}
        if k < len(replies) - 1:
            env.append(t.add_messages(f"and {k}?"))
    # What the environment appends is what the template renders after its end-of-turn.
    assert tok.decode(env[0]) == "\n<|im_start|>user\nand 0?<|im_end|>\n<|im_start|>assistant\n"
    (sample,) = t.to_samples(1.0)
    assert sample.metadata["turns"] == 3 and len(t.segments) == 1
    assert list(sample.prompt_ids) == prompt
    a, b, c = (m.output_ids for m in model)
    assert list(sample.completion_ids) == [*a, *env[0], *b, *env[1], *c]  # the model's own ids
    assert a[-1] == b[-1] == c[-1] == eos
    mask = [*[1] * len(a), *[0] * len(env[0]), *[1] * len(b), *[0] * len(env[1]), *[1] * len(c)]
    assert list(sample.loss_mask) == mask
    la, lb, lc = (m.logprobs or [] for m in model)
    zeros = [[0.0] * len(e) for e in env]
    assert list(sample.rollout_logprobs or []) == [*la, *zeros[0], *lb, *zeros[1], *lc]
    # The ids are the template's rendering with the model's stop id where it ended its turns.
    rendered = tok.render(t.messages).removesuffix("<|im_end|>\n")
    assert tok.decode([*prompt, *sample.completion_ids]) == (
        rendered.replace("<|im_end|>\n<|im_start|>user", "<|endoftext|>\n<|im_start|>user")
        + "<|endoftext|>"
    )


def test_turn_cut_at_max_new_tokens_gets_end_of_turn_among_other_stops(
    chatml_tools: ChatTokenizer,
) -> None:
    tok, eos = chatml_tools, endoftext(chatml_tools)
    t = Transcript(tok, "count", on_history_rewrite="error")
    c1 = completion(tok, "1 2", stop=eos)
    t.add_completion(c1)
    t.add_messages("more")
    c2 = completion(tok, "3 4 5", eot=False)  # cut at max_new_tokens: no stop id
    assert t.add_completion(c2)["content"] == "3 4 5"
    appended = t.add_messages("go on")
    # No stop id to keep: the template's end-of-turn is the environment's (mask 0).
    assert tok.decode(appended).startswith("<|im_end|>\n<|im_start|>user\ngo on")
    c3 = completion(tok, "6")
    t.add_completion(c3)
    (sample,) = t.to_samples(0.0)
    assert sample.metadata["turns"] == 3
    ids = list(sample.completion_ids)
    n1 = len(c1.output_ids)
    assert ids[:n1] == c1.output_ids and ids[-len(c3.output_ids) :] == c3.output_ids
    start = ids.index(c2.output_ids[0], n1)
    assert ids[start : start + len(c2.output_ids)] == c2.output_ids
    assert sum(sample.loss_mask) == n1 + len(c2.output_ids) + len(c3.output_ids)
    after = start + len(c2.output_ids)
    assert ids[after] == tok.eos_token_id and sample.loss_mask[after] == 0


def test_rewrite_after_another_stop_id_is_explained_where_it_is(thinking: ChatTokenizer) -> None:
    eos = endoftext(thinking)
    t = Transcript(thinking, "2+2?", on_history_rewrite="error")
    t.add_completion(completion(thinking, "4", stop=eos))
    t.add_messages("and 3+3?")  # <|endoftext|> where the template has <|im_end|>: no rewrite
    t.add_completion(completion(thinking, "<think>easy</think>6", stop=eos))
    with pytest.raises(HistoryRewriteError, match="model saw '<think>easy"):
        t.add_messages("and 4+4?")


def test_template_arguments_reach_every_render(thinking: ChatTokenizer) -> None:
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    t = Transcript(thinking, "2+2?", chat_template_kwargs={"enable_thinking": False})
    assert thinking.decode(t.ids).endswith(empty_think)
    t.add_completion(completion(thinking, "4"))
    t.add_messages("and 3+3?")
    assert thinking.decode(t.ids).endswith(f"and 3+3?<|im_end|>\n{empty_think}")
    assert not Transcript(thinking, "2+2?").text.endswith(empty_think)


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
            # How the model's turn ends: the end-of-turn id, another stop id, max_new_tokens.
            st.sampled_from(["eot", "other", "length"]),
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
    turns: list[tuple[str, str, list[tuple[str, str]]]],
    family: str,
) -> None:
    tok: ChatTokenizer = request.getfixturevalue(family)
    eot, other = tok.eos_token_id, endoftext(tok)
    t = Transcript(tok, opening, on_history_rewrite="error")
    spans: list[tuple[int, list[int]]] = []
    for reply, end, env_msgs in turns:
        c = completion(tok, reply, eot=end != "length", stop=other if end == "other" else None)
        spans.append((len(t.current.completion_ids), list(c.output_ids)))
        t.add_completion(c)
        # Group tool messages after each other, as a tool-use environment sends them.
        msgs = sorted(({"role": r, "content": x} for r, x in env_msgs), key=lambda m: m["role"])
        t.add_messages(msgs)
        # With the model's other stop ids read as the end-of-turn, the ids are the render.
        ids = list(t.ids)
        for start, span in spans:
            if span[-1] == other:
                ids[t.current.prompt_len + start + len(span) - 1] = eot
        assert tok.decode(ids) == tok.render(t.messages, add_generation_prompt=True)
    seg = t.current
    for start, ids in spans:
        assert seg.completion_ids[start : start + len(ids)] == ids
        assert seg.loss_mask[start : start + len(ids)] == [1] * len(ids)
    assert sum(seg.loss_mask) == sum(len(ids) for _, ids in spans)
    assert len(seg.completion_ids) == len(seg.loss_mask) == len(seg.logprobs)


def test_rewrite_continues_when_the_new_messages_extend_what_the_model_saw(
    any_template: ChatTokenizer,
) -> None:
    t = Transcript(any_template, [{"role": "user", "content": "hi"}])
    t.add_completion(completion(any_template, "hello"))
    ids = list(t.ids)
    conversation = [*t.messages, {"role": "user", "content": "again"}]
    appended = t.rewrite(conversation)
    assert len(t.segments) == 1 and t.ids[: len(ids)] == ids and t.ids[len(ids) :] == appended


def test_rewrite_of_earlier_messages_starts_a_segment_or_raises(smollm2: ChatTokenizer) -> None:
    t = Transcript(smollm2, [{"role": "user", "content": "a long question"}])
    t.add_completion(completion(smollm2, "an answer"))
    summary = [{"role": "user", "content": "a question"}, *t.messages[1:]]
    prompt = t.rewrite([*summary, {"role": "user", "content": "next"}])
    assert len(t.segments) == 2 and t.current.prompt_ids == prompt
    assert "a question" in smollm2.decode(prompt) and "a long" not in smollm2.decode(prompt)
    strict = Transcript(smollm2, "q", on_history_rewrite="error")
    strict.add_completion(completion(smollm2, "r"))
    with pytest.raises(HistoryRewriteError, match="renders the conversation differently"):
        strict.rewrite([{"role": "user", "content": "other"}])
    with pytest.raises(TemplateError, match="at least one message"):
        strict.rewrite([])
