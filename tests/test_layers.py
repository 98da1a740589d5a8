"""The import graph's rule that the contracts in pyproject.toml cannot state: no module
imports a package that it lives in. The package's ``__init__`` imports its modules, so
such an import is a cycle (``agentenv.cli._bench`` importing ``agentenv.cli`` was one)."""

from __future__ import annotations

import grimp

PACKAGES = ("agentenv", "environments", "sandboxes", "trainer")


def test_no_module_imports_its_own_package() -> None:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    upward = []
    for module in sorted(graph.modules):
        parts = module.split(".")
        for depth in range(1, len(parts)):
            package = ".".join(parts[:depth])
            for line in graph.get_import_details(importer=module, imported=package):
                upward.append(f"{module}:{line['line_number']} {line['line_contents']!r}")
    assert upward == [], (
        "these modules import the package they live in (a cycle through its __init__); "
        "import the sibling module that defines the name instead: " + "; ".join(upward)
    )
