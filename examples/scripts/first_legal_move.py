"""A scripted player for game environments: it plays the first legal move it is offered.

    agentenv eval --env tictactoe --model scripted:examples/scripts/first_legal_move.py \
        --opponent random --n 100 --json
"""

import re

LEGAL = re.compile(r"Legal(?: moves)?: (\[[^\]\n]+\])")


def reply(ctx):
    offered = LEGAL.findall(ctx.text)
    if not offered:
        return "I do not know the legal moves."
    return f"I play the first legal move. {offered[-1]}"
