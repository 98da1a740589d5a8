"""The trainer's public surface: ``__all__`` is sorted and complete, every name loads on
first use, and importing the package loads no torch."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import trainer


def test_all_is_sorted_and_every_name_loads() -> None:
    names = trainer.__all__
    assert names == sorted(names, key=lambda n: (not n.isupper(), n))
    assert set(names) <= set(dir(trainer))
    for name in names:
        value = getattr(trainer, name)
        module = importlib.import_module(getattr(value, "__module__", None) or "trainer")
        if module.__name__ != "trainer":  # a function or class: the object its module defines
            assert getattr(module, name) is value


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'Trainer'"):
        _ = trainer.Trainer


def test_import_loads_no_torch() -> None:
    code = "import sys, trainer, trainer.run._cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_the_config_classes_load_no_torch() -> None:
    """A config is built (and validated) before a model is: the classes of the config tree,
    reached as ``trainer.X``, come from their own torch-free modules."""
    names = ("OptimConfig", "LossConfig", "GRPOConfig", "TrainConfig", "SCHEDULES")
    code = (
        "import sys, trainer\n"
        f"for name in {names!r}: getattr(trainer, name)\n"
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
