"""ChatTokenizer renders like transformers and its cached encode equals a plain encode."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv import ChatTokenizer, ConfigError, TemplateError
from agentenv.engine._models import resolve_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "Add two integers. ü",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 3? Ünïcode ✓"},
    {
        "role": "assistant",
        "content": '<tool_call>{"name": "add", "arguments": {"a": 2}}</tool_call>',
    },
    {"role": "tool", "content": "5", "name": "add"},
    {"role": "tool", "content": "7", "name": "add"},
]


@pytest.fixture(scope="module")
def hf_tokenizer() -> Any:
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(resolve_model("smollm2-135m")))


@pytest.mark.parametrize("family", ["smollm2", "chatml_tools", "llama3", "thinking"])
@pytest.mark.parametrize("tools", [None, TOOLS])
@pytest.mark.parametrize("gen", [False, True])
def test_render_matches_transformers(
    request: pytest.FixtureRequest, hf_tokenizer: Any, family: str, tools: Any, gen: bool
) -> None:
    tok: ChatTokenizer = request.getfixturevalue(family)
    ours = tok.render(CONVERSATION, tools=tools, add_generation_prompt=gen)
    theirs = hf_tokenizer.apply_chat_template(
        CONVERSATION,
        tools=tools,
        add_generation_prompt=gen,
        tokenize=False,
        chat_template=tok.chat_template,
        bos_token=tok.bos_token,
        eos_token=tok.eos_token,
    )
    assert ours == theirs


@pytest.mark.parametrize("kwargs", [{"enable_thinking": False}, {"enable_thinking": True}])
def test_template_arguments_render_as_transformers_does(
    thinking: ChatTokenizer, hf_tokenizer: Any, kwargs: dict[str, Any]
) -> None:
    msgs = [{"role": "user", "content": "2+2?"}]
    ours = thinking.render(msgs, add_generation_prompt=True, chat_template_kwargs=kwargs)
    theirs = hf_tokenizer.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False, chat_template=thinking.chat_template,
        **kwargs,
    )  # fmt: skip
    assert ours == theirs
    assert ours.endswith("<think>\n\n</think>\n\n") is (kwargs["enable_thinking"] is False)


def test_template_arguments_that_render_sets_are_refused(thinking: ChatTokenizer) -> None:
    msgs = [{"role": "user", "content": "x"}]
    with pytest.raises(ConfigError, match=r"'add_generation_prompt'.*render's own argument"):
        thinking.render(msgs, chat_template_kwargs={"add_generation_prompt": True})
    with pytest.raises(ConfigError, match=r"a mapping of names to values, got list"):
        thinking.render(msgs, chat_template_kwargs=[("enable_thinking", False)])  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"names must be strings, got 1"):
        thinking.render(msgs, chat_template_kwargs={1: False})  # type: ignore[dict-item]


def test_template_tool_support_is_detected(
    smollm2: ChatTokenizer, chatml_tools: ChatTokenizer
) -> None:
    assert not smollm2.supports_tools
    assert chatml_tools.supports_tools


@settings(
    max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    st.lists(
        st.one_of(
            st.sampled_from(["<|im_start|>", "<|im_end|>", "<|endoftext|>", "\n", " ", "12"]),
            st.text(max_size=30),
        ),
        max_size=12,
    )
)
def test_cached_encode_equals_plain_encode(smollm2: ChatTokenizer, parts: list[str]) -> None:
    text = "".join(parts)
    assert smollm2.encode(text) == smollm2._tok.encode(text, add_special_tokens=False).ids
    assert smollm2.encode(text) == smollm2.encode(text)  # and again, from the cache


def test_decode_keeps_special_tokens(smollm2: ChatTokenizer) -> None:
    ids = smollm2.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == smollm2.token_to_id("<|im_start|>")
    assert smollm2.decode(ids) == "<|im_start|>user\nhi<|im_end|>"
    assert smollm2.decode(ids[-1:]) == "<|im_end|>"


def test_from_dir_without_tokenizer_json(tmp_path: Any) -> None:

    with pytest.raises(ConfigError, match=r"no tokenizer\.json"):
        ChatTokenizer.from_dir(tmp_path)


def test_render_without_template_names_the_fix(smollm2: ChatTokenizer) -> None:
    bare = ChatTokenizer(smollm2._tok, None, name="bare")
    with pytest.raises(TemplateError, match="with_template"):
        bare.render([{"role": "user", "content": "x"}])


# Texts that pack the most text into the fewest tokens, or that the tokenizer drops.
DENSE_TEXTS = [
    "#" * 80 * 50,
    "\n" + " " * 80,
    ("\n" + " " * 79) * 30,
    "\x04" * 500 + "a",  # a byte SmolLM2's vocabulary lacks: dropped
    "<|im_end|>" * 40,
    "\U00040000" * 30,  # a lead byte without a token; its continuation bytes stay
    "日本語のテキスト" * 50,
    "🙂" * 100,
    "hello world " * 300,
]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=300) | st.sampled_from(DENSE_TEXTS))
def test_the_text_bound_never_exceeds_the_tokens(smollm2: ChatTokenizer, text: str) -> None:
    bound = smollm2.text_bound
    assert bound is not None
    n = len(smollm2.encode(text))
    assert bound.fewest_tokens(text) <= n
    assert bound.may_fit(text, n)


def test_the_text_bound_is_proven_or_absent(smollm2: ChatTokenizer) -> None:
    import tokenizers
    from tokenizers import models, normalizers, pre_tokenizers

    from agentenv._text_bound import text_bound

    bound = smollm2.text_bound
    assert bound is not None and bound.max_token_bytes == 81  # its longest token
    assert "\x04" in bound.dropped
    assert not bound.may_fit("hello world " * 10_000, 1000)
    assert bound.fewest_tokens("\x04" * 10_000) == 0
    # Whitespace drops text; a fused unknown token covers any run; Strip has no bound.
    whitespace = tokenizers.Tokenizer(models.BPE(vocab={"a": 0}, merges=[], unk_token="a"))
    whitespace.pre_tokenizer = pre_tokenizers.Whitespace()
    fused = tokenizers.Tokenizer(
        models.BPE(vocab={"a": 0, "?": 1}, merges=[], unk_token="?", fuse_unk=True)
    )
    stripped = tokenizers.Tokenizer(models.BPE(vocab={"a": 0}, merges=[], unk_token="a"))
    stripped.normalizer = normalizers.Strip()
    for tok in (whitespace, fused, stripped):
        assert text_bound(tok) is None
    # An NFC normalizer shrinks text at most 4-fold; an unknown token is one character.
    nfc = tokenizers.Tokenizer(models.BPE(vocab={"abc": 0, "?": 1}, merges=[], unk_token="?"))
    nfc.normalizer = normalizers.NFC()
    assert text_bound(nfc) == type(bound)(4 * 4)
