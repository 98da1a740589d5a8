"""The megatron backend's public surface, its lazy import of megatron, and the error
when megatron-core is missing."""

from __future__ import annotations

import subprocess
import sys

import pytest

import trainer.megatron
from agentenv import AgentEnvError
from tests.trainer.megatron.tiny import TINY
from trainer.megatron import (
    EXTRA,
    MegatronModelConfig,
    MegatronNotInstalledError,
    megatron_args,
    model_provider,
    require_megatron,
    vocab_parallel_logprobs,
)


def test_all_is_sorted_and_complete() -> None:
    names = trainer.megatron.__all__
    assert names == sorted(names, key=lambda n: (not n.isupper(), n))
    public = {n for n in dir(trainer.megatron) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(trainer.megatron, n)).__name__ == "module"}
    assert set(names) == public - modules


def test_importing_the_backend_does_not_import_megatron() -> None:
    code = "import sys, trainer.megatron; print('megatron' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_missing_megatron_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("megatron", "megatron.core", "megatron.training", "megatron.training.arguments"):
        monkeypatch.setitem(sys.modules, name, None)  # makes `import` raise ImportError
    cfg = MegatronModelConfig.from_hf({**TINY, "architectures": ["LlamaForCausalLM"]})
    calls = [
        lambda: require_megatron(),
        lambda: model_provider(cfg),
        lambda: megatron_args(["--tensor-model-parallel-size", "2"]),
        lambda: vocab_parallel_logprobs(
            __import__("torch").zeros(1, 128), __import__("torch").zeros(1).long(), vocab_size=100
        ),
    ]
    for call in calls:
        with pytest.raises(MegatronNotInstalledError, match=rf"pip install 'agentenv\[{EXTRA}\]'"):
            call()
    assert issubclass(MegatronNotInstalledError, AgentEnvError)
    assert issubclass(MegatronNotInstalledError, ImportError)
