"""A scripted policy for ``arithmetic``: right on 80 % of questions, off by one otherwise.

Deterministic (the choice depends only on the question), so an evaluation with it is
reproducible. Use with ``--model scripted:examples/scripts/arithmetic_oracle.py``.
"""

import re
import zlib

_QUESTION = re.compile(r"What is (\d+) ([-+*]) (\d+)\?")


def reply(ctx) -> str:  # type: ignore[no-untyped-def]
    a, op, b = _QUESTION.findall(ctx.text)[-1]
    value = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
    if zlib.crc32(f"{a}{op}{b}".encode()) % 5 == 0:
        value += 1
    return f"{a} {op} {b} = {value}"
