"""Every ``--help`` of the ``agentenv`` command tree reads right.

The rules, checked on each command and sub-command (plug-ins included):

* every option has a help text, which states its default at most once and never as
  ``None`` or ``PydanticUndefined`` (a ``None`` default means "not set": the text says what
  that does);
* every option that takes a value names the kind of value: an explicit metavar (``N``,
  ``FLOAT``, ``TEXT``, ``PATH``, ``JSON``, or a more precise ``DIR``, ``FILE``, ``URL``...)
  or its ``{choices}``, never argparse's fallback, the upper-cased destination
  (``--save SAVE``);
* a description is printed as written: each of its lines is a line of the help (examples
  keep their line breaks), and no help line is wider than the source's 100 columns.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pydantic
import pytest
from annotated_types import Ge, Lt

from agentenv.cli import Option, add_model_arguments, add_options, build_parser

WIDTH = 100


def commands(
    parser: argparse.ArgumentParser, path: str = "agentenv"
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from commands(child, f"{path} {name}")


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    for action in parser._actions:
        if action.option_strings and action.help != argparse.SUPPRESS:
            yield action


@pytest.fixture(scope="module")
def tree() -> dict[str, argparse.ArgumentParser]:
    return dict(commands(build_parser()))


@pytest.fixture(autouse=True)
def width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", str(WIDTH))  # argparse wraps help to the terminal's width


def test_the_tree_has_every_command(tree: dict[str, argparse.ArgumentParser]) -> None:
    for path in (
        "agentenv eval",
        "agentenv serve",
        "agentenv train",
        "agentenv bench rollout",
        "agentenv bench train",
        "agentenv buffer serve",
        "agentenv buffer export",
        "agentenv sandbox exec",
    ):
        assert path in tree


def test_every_option_has_a_help_that_states_its_default_once(
    tree: dict[str, argparse.ArgumentParser],
) -> None:
    problems = []
    for path, parser in tree.items():
        assert "PydanticUndefined" not in parser.format_help(), path
        for action in options(parser):
            flag = f"{path} {action.option_strings[-1]}"
            text = action.help or ""
            if not text.strip():
                problems.append(f"{flag}: no help")
            if text.lower().count("default:") > 1:
                problems.append(f"{flag}: default stated twice: {text!r}")
            if "default: None" in text or "default: PydanticUndefined" in text:
                problems.append(f"{flag}: {text!r}")
    assert problems == []


def test_every_option_taking_a_value_names_its_kind(
    tree: dict[str, argparse.ArgumentParser],
) -> None:
    problems = []
    for path, parser in tree.items():
        for action in options(parser):
            if action.nargs == 0:  # a switch
                continue
            if action.metavar is None and action.choices is None:
                problems.append(f"{path} {action.option_strings[-1]} {action.dest.upper()}")
    assert problems == []
    train = tree["agentenv train"].format_help()
    for shown in (
        "--save DIR",
        "--load DIR",
        "--prompt-data FILE",
        "--env-args JSON",
        "--lr FLOAT",
    ):
        assert shown in train


def test_descriptions_are_printed_as_written(tree: dict[str, argparse.ArgumentParser]) -> None:
    for path, parser in tree.items():
        lines = parser.format_help().splitlines()
        for line in lines:
            assert len(line) <= WIDTH, f"{path}: {line!r}"
        for line in (parser.description or "").strip().splitlines():
            if line.strip():
                assert line.rstrip() in lines, f"{path}: lost the line {line!r}"


def test_train_names_both_backends(tree: dict[str, argparse.ArgumentParser]) -> None:
    first = (tree["agentenv train"].description or "").strip().split("\n\n")[0]
    assert "torch" in first
    assert "megatron" in first


class Example(pydantic.BaseModel):
    path: Path = pydantic.Field(description="where")
    args: dict[str, Any] = pydantic.Field(default_factory=dict, description="arguments")
    limit: int | None = pydantic.Field(None, description="at most this many")
    share: float = pydantic.Field(0.5, description="the 50 % mark")
    mode: Literal["a", "b"] | None = pydantic.Field(None, description="a or b (default: a)")
    n: int = pydantic.Field(3, description="count (default: three)")


def test_the_generator_renders_defaults_and_metavars() -> None:
    parser = argparse.ArgumentParser(prog="x")
    add_model_arguments(parser, Example, metavars={"path": "DIR"})
    helps = {a.dest: (a.help, a.metavar) for a in options(parser) if a.dest != "help"}
    assert helps == {
        "path": ("where", "DIR"),
        "args": ("arguments (default: {})", "JSON"),
        "limit": ("at most this many", "N"),
        "share": ("the 50 %% mark (default: 0.5)", "FLOAT"),
        "mode": ("a or b (default: a)", None),
        "n": ("count (default: three)", "N"),
    }
    assert "the 50 % mark" in parser.format_help()  # argparse formats help strings


def test_metavars_for_unknown_fields_are_refused() -> None:
    with pytest.raises(TypeError, match=r"\['sav'\]"):
        add_model_arguments(argparse.ArgumentParser(), Example, metavars={"sav": "DIR"})


def test_the_generator_renders_ranges_switches_and_json() -> None:
    """Every command's flags come from one generator: a range after the doc, a switch
    that takes no value (and shows no default), ``--x/--no-x`` for a bool, a tuple's
    default as JSON, and a declared metavar on a JSON-kind value (parsed as text)."""
    parser = argparse.ArgumentParser(prog="x")
    add_options(
        parser,
        [
            Option("--rate", "rate", float, 0.5, "the rate", (Ge(0.0), Lt(1.0))),
            Option("--per-token", "per_token", bool, False, "per token", switch=True),
            Option("--tis", "tis", bool, True, "truncated IS"),
            Option("--pair", "pair", tuple[int, int], (1, 2), "two numbers"),
            Option("--names", "names", list[str], [], "names", metavar="NAME,..."),
            Option("--must", "must", int, doc="required", required=True),
        ],
    )  # fmt: skip
    helps = {a.dest: (a.help, a.metavar) for a in options(parser) if a.dest != "help"}
    assert helps == {
        "rate": ("the rate [>= 0.0, < 1.0] (default: 0.5)", "FLOAT"),
        "per_token": ("per token", None),
        "tis": ("truncated IS (default: True)", None),
        "pair": ("two numbers (default: [1, 2])", "JSON"),
        "names": ("names (default: [])", "NAME,..."),
        "must": ("required", "N"),
    }
    args = parser.parse_args(["--must", "3", "--per-token", "--no-tis", "--pair", "[3, 4]",
                              "--names", "a,b"])  # fmt: skip
    assert vars(args) == {"must": 3, "per_token": True, "tis": False, "pair": [3, 4],
                          "names": "a,b"}  # fmt: skip
    with pytest.raises(SystemExit):
        parser.parse_args([])  # --must is required
