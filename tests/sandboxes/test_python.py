"""check_python's per-test results: one sandbox job grades every test of a solution."""

from __future__ import annotations

import pytest

from sandboxes import GradedTest, Limits, Sandbox, check_python

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(120)]

PYTEST_STYLE = """
def test_sorts():
    assert sort_list([3, 1, 2]) == [1, 2, 3]

def test_empty():
    assert sort_list([]) == []

def test_keeps_duplicates():
    assert sort_list([2, 1, 2]) == [1, 2, 2]

def test_descending_input():
    assert candidate([3, 2, 1]) == [1, 2, 3]
"""
# Sorts, but drops duplicates: three of the four tests pass.
DEDUPES = "def sort_list(xs):\n    return sorted(set(xs))\n"


async def test_each_test_function_gets_its_own_result(sandbox: Sandbox) -> None:
    v = await check_python(sandbox, DEDUPES, PYTEST_STYLE, entry_point="sort_list", check=None)
    assert not v.passed
    assert [(t.name, t.passed) for t in v.tests] == [
        ("test_sorts", True),
        ("test_empty", True),
        ("test_keeps_duplicates", False),
        ("test_descending_input", True),
    ]
    assert v.fraction_passed == 0.75
    failed = v.tests[2]
    assert isinstance(failed, GradedTest)
    assert "line 9: assert sort_list([2, 1, 2]) == [1, 2, 2]" in failed.reason
    assert v.reason.startswith("1 of 4 tests failed; test_keeps_duplicates: a test failed")

    honest = await check_python(
        sandbox, "def sort_list(xs):\n    return sorted(xs)\n", PYTEST_STYLE,
        entry_point="sort_list", check=None,
    )  # fmt: skip
    assert honest.passed and honest.fraction_passed == 1.0, honest
    assert honest.reason == "all tests passed" and len(honest.tests) == 4


async def test_a_check_function_is_one_test_and_test_functions_run_beside_it(
    sandbox: Sandbox,
) -> None:
    tests = (
        "def check(candidate):\n    assert candidate(2, 3) == 5\n"
        "def test_negative():\n    assert add(-1, -1) == -2\n"
    )
    v = await check_python(sandbox, "def add(a, b):\n    return abs(a + b)\n", tests,
                           entry_point="add")  # fmt: skip
    assert [(t.name, t.passed) for t in v.tests] == [("check", True), ("test_negative", False)]
    assert v.fraction_passed == 0.5 and not v.passed


async def test_a_crash_or_a_hang_fails_that_test_and_the_ones_after_it(sandbox: Sandbox) -> None:
    tests = (
        "def test_first():\n    assert f(1) == 1\n"
        "def test_hangs():\n    assert f(2) == 2\n"
        "def test_after_the_hang():\n    assert f(3) == 3\n"
    )
    # The late answer of the call that ran out of time (2) must never be read as the
    # answer to a later call.
    hangs = "import time\ndef f(x):\n    if x == 2:\n        time.sleep(30)\n    return x\n"
    v = await check_python(
        sandbox, hangs, tests, entry_point="f", check=None, limits=Limits(timeout_s=3)
    )
    assert [(t.name, t.passed) for t in v.tests] == [
        ("test_first", True),
        ("test_hangs", False),
        ("test_after_the_hang", False),
    ]
    assert "ran out of time" in v.tests[1].reason and "ran out of time" in v.tests[2].reason
    assert v.fraction_passed == pytest.approx(1 / 3)

    crashes = "import os\ndef f(x):\n    if x == 2:\n        os._exit(0)\n    return x\n"
    v = await check_python(sandbox, crashes, tests, entry_point="f", check=None)
    assert [t.passed for t in v.tests] == [True, False, False]
    assert "process ended" in v.tests[2].reason


async def test_no_result_without_a_solution_or_with_broken_tests(sandbox: Sandbox) -> None:
    v = await check_python(sandbox, "def f(:\n", "def test_a():\n    assert f()\n",
                           entry_point="f", check=None)  # fmt: skip
    assert not v.passed and v.tests == () and v.fraction_passed == 0.0
    assert "failed to load" in v.reason
    # A failing top-level statement stops the module: nothing after it is defined.
    v = await check_python(sandbox, "def f():\n    return 1\n",
                           "assert f() == 2\ndef test_a():\n    assert f() == 1\n",
                           entry_point="f", check=None)  # fmt: skip
    assert [(t.name, t.passed) for t in v.tests] == [("tests", False)]
    v = await check_python(sandbox, "def f():\n    return 1\n", "assert f() == 1\n",
                           entry_point="f")  # fmt: skip
    assert not v.passed and "no function 'check'" in v.reason
