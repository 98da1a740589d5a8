"""The public surface: ``__all__`` is sorted, complete and importable."""

from __future__ import annotations

import inspect
import subprocess
import sys

import agentenv


def test_all_is_sorted_and_complete() -> None:
    assert agentenv.__all__ == sorted(agentenv.__all__, key=lambda n: (not n.isupper(), n))
    public = {n for n in dir(agentenv) if not n.startswith("_")}
    modules = {n for n in public if type(getattr(agentenv, n)).__name__ == "module"}
    assert set(agentenv.__all__) == public - modules
    for name in agentenv.__all__:
        value = getattr(agentenv, name)
        if name.isupper():  # a constant
            assert not callable(value), name
        else:  # a class or function of agentenv's own, with its documentation
            assert value.__module__.startswith("agentenv."), (name, value.__module__)
            assert inspect.getdoc(value), f"{name} has no docstring"


def test_import_is_light() -> None:
    # torch, transformers and jinja2 load only when used.
    code = (
        "import sys, agentenv; "
        "print(sorted(m for m in ('torch', 'transformers', 'jinja2', 'tokenizers', 'numpy') "
        "if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_errors_share_one_root() -> None:
    errors = [getattr(agentenv, n) for n in agentenv.__all__ if n.endswith("Error")]
    assert errors
    assert all(issubclass(e, agentenv.AgentEnvError) for e in errors)
    assert issubclass(agentenv.EpisodeTruncated, agentenv.AgentEnvError)
