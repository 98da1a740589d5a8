"""The import graph's rule that the contracts in pyproject.toml cannot state: no module
imports a package that it lives in. The package's ``__init__`` imports its modules, so
such an import is a cycle (``agentenv.cli._bench`` importing ``agentenv.cli`` was one)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import grimp

PACKAGES = ("agentenv", "environments", "sandboxes", "trainer")
ROOT = Path(__file__).resolve().parents[1]


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


def _contract_rows() -> dict[str, tuple[str, str]]:
    """docs/architecture.md's table of contracts: each id's rule and exceptions."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    table = text[text.index("| contract | rule |") :].split("\n\n")[0].splitlines()[2:]
    rows = {}
    for line in table:
        name, rule, exceptions = (cell.strip() for cell in line.strip("|").split(" | "))
        rows[name.strip("`")] = (rule, exceptions)
    return rows


def test_the_architecture_docs_table_is_the_contracts() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    contracts = {c["id"]: c for c in config["contracts"]}
    rows = _contract_rows()
    assert sorted(rows) == sorted([*contracts, "tests/test_layers.py"]), (
        "docs/architecture.md's contract table and pyproject.toml's [tool.importlinter] "
        f"differ: the table has {sorted(rows)}, the contracts are {sorted(contracts)}"
    )
    for cid, contract in contracts.items():
        rule, exceptions = rows[cid]
        importers = {
            i.split(" -> ")[0].removesuffix(".**") for i in contract.get("ignore_imports", [])
        }
        listed = set(re.findall(r"`([\w.]+)`", exceptions))
        named = set(re.findall(r"`([\w.]+)`", rule))
        assert listed <= importers, f"{cid}: the table lists {listed - importers}, not ignored"
        assert importers <= listed | named, (
            f"{cid}: pyproject ignores imports of {importers - listed - named}, "
            "which docs/architecture.md neither allows in the rule nor lists as an exception"
        )
        for module in contract.get("forbidden_modules", []):
            assert f"`{module}`" in rule or module in rule, f"{cid}: the rule omits {module}"
