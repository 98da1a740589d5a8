"""Environments bundled with agentenv, written only against its public API.

| name | kind | what |
|---|---|---|
| ``arithmetic`` | single-turn | integer arithmetic questions, exact-answer reward |
| ``calculator`` | tool-use | multi-step arithmetic solved by calling ``add`` and ``multiply`` |
| ``word_guess`` | two agents | a clue-giver who knows a secret word and a guesser who does not |
"""
