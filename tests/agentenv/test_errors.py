"""The exception tree: every error class of the product derives from its root, and the tree
drawn in ``agentenv/_errors.py``'s docstring shows each one under its parent."""

from __future__ import annotations

import importlib
import pkgutil
import re
from types import ModuleType

import agentenv._errors
import sandboxes
from agentenv import AgentEnvError

# Modules that run in another interpreter, so they cannot import the product's root.
OTHER_INTERPRETERS = {
    "environments._mini_swe_driver": "mini-swe-agent's venv imports it (minisweagent)",
    "sandboxes._grader": "the stdlib-only grader inside a sandbox",
}
ROOTS: dict[str, type[BaseException]] = {
    "agentenv": AgentEnvError,
    "trainer": AgentEnvError,
    "environments": AgentEnvError,
    # sandboxes imports no agentenv (its import contract): its errors have their own root.
    "sandboxes": sandboxes.SandboxError,
}


def _modules(package: str) -> list[ModuleType]:
    root = importlib.import_module(package)
    modules = [root]
    for info in pkgutil.walk_packages(root.__path__, package + "."):
        name = info.name
        if name.endswith(".__main__") or ".harbor_tasks" in name or name in OTHER_INTERPRETERS:
            continue
        modules.append(importlib.import_module(name))
    return modules


def _exceptions(package: str) -> list[type[BaseException]]:
    """The exception classes defined in ``package``, but those private to their module."""
    found = {
        obj
        for module in _modules(package)
        for obj in vars(module).values()
        if isinstance(obj, type)
        and issubclass(obj, BaseException)
        and obj.__module__ == module.__name__
        and not obj.__name__.startswith("_")
    }
    return sorted(found, key=lambda c: f"{c.__module__}.{c.__qualname__}")


def _tree() -> dict[str, tuple[str | None, str]]:
    """Each class the docstring draws: its parent in the drawing and its description."""
    doc = agentenv._errors.__doc__ or ""
    lines = doc[doc.index("    AgentEnvError\n") :].split("\n\n")[0].splitlines()
    entries: dict[str, tuple[str | None, str]] = {"AgentEnvError": (None, "")}
    stack = ["AgentEnvError"]
    last = "AgentEnvError"
    for line in lines[1:]:
        entry = re.match(r"    (?P<pre>[│ ]*)[├└]── (?P<name>\w+)\s*(?P<text>.*)$", line)
        if entry is None:  # the description of the entry above goes on
            parent, text = entries[last]
            entries[last] = (parent, f"{text} {line.strip(' │')}")
            continue
        depth = len(entry["pre"]) // 4 + 1
        del stack[depth:]
        last = entry["name"]
        assert last not in entries, f"{last} is drawn twice in agentenv/_errors.py"
        entries[last] = (stack[-1], entry["text"])
        stack.append(last)
    return entries


def test_every_error_class_derives_from_its_packages_root() -> None:
    outside = [
        f"{c.__module__}.{c.__qualname__}{tuple(b.__name__ for b in c.__bases__)}"
        for package, root in ROOTS.items()
        for c in _exceptions(package)
        if not issubclass(c, root)
    ]
    assert outside == [], (
        "derive these from the package's root (agentenv.AgentEnvError; "
        "sandboxes.SandboxError in sandboxes), keeping a builtin base beside it where "
        f"callers catch that: {outside}"
    )


def test_the_docstring_draws_every_error_under_its_parent() -> None:
    drawn = _tree()
    packages = ("agentenv", "trainer", "environments")
    classes = {c.__name__: c for p in packages for c in _exceptions(p)}
    missing = sorted(set(classes) - set(drawn))
    stale = sorted(set(drawn) - set(classes))
    assert missing == [] and stale == [], (
        f"agentenv/_errors.py's tree lacks {missing} and draws classes that are gone: {stale}"
    )
    misplaced = []
    for name, cls in classes.items():
        parent, text = drawn[name]
        ours = [b for b in cls.__bases__ if issubclass(b, AgentEnvError)]
        builtins = [b.__name__ for b in cls.__bases__ if b.__module__ == "builtins"]
        if parent is not None and [b.__name__ for b in ours] != [parent]:
            misplaced.append(f"{name} is drawn under {parent}, derives from {ours}")
        said = re.findall(r"also an? (\w+)", text)
        if parent is not None and said != builtins:
            misplaced.append(f"{name} says it is also {said}, derives from {builtins}")
    assert misplaced == [], misplaced
