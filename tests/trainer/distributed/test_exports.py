"""trainer.distributed's public surface: ``__all__`` sorted and complete, each name
documented, and importing it starts no Ray."""

from __future__ import annotations

import inspect
import subprocess
import sys

import trainer.distributed as distributed


def test_all_is_sorted_complete_and_documented() -> None:
    names = distributed.__all__
    assert names == sorted(names)
    public = {n for n in dir(distributed) if not n.startswith("_")}
    modules = {n for n in public if inspect.ismodule(getattr(distributed, n))}
    assert set(names) == public - modules - {"annotations"}
    for name in names:
        value = getattr(distributed, name)
        assert value.__module__.startswith("trainer.distributed."), name
        assert inspect.getdoc(value), f"{name} has no docstring"


def test_import_loads_no_ray() -> None:
    code = "import sys, trainer.distributed; print('ray' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
