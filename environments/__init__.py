"""Environments bundled with agentenv, written only against its public API.

| name | kind | what |
|---|---|---|
| ``arithmetic`` | single-turn | integer arithmetic questions, exact-answer reward |
| ``calculator`` | tool-use | multi-step arithmetic the model solves by calling ``add``/``multiply`` tools |
| ``word_guess`` | two agents | a clue-giver who knows a secret word and a guesser who does not |
"""
