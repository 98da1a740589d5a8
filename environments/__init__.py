"""Environments bundled with agentenv, written only against its public API.

| name | kind | what |
|---|---|---|
| ``arithmetic`` | single-turn | integer arithmetic questions, exact-answer reward |
| ``calculator`` | tool-use | multi-step arithmetic solved by calling ``add`` and ``multiply`` |
| ``word_guess`` | two agents | a clue-giver who knows a secret word and a guesser who does not |
| ``humaneval`` | single-turn, code | the 164 HumanEval problems, unit tests run in a sandbox |
| ``reasoning_gym`` | single-turn | any reasoning-gym dataset by name and config, its own verifier |
| ``prompt_data`` | single-turn | JSONL/Parquet/datasets prompts scored by ``--rm-type`` |
| ``harbor`` | tool-use, Docker | Harbor-format (Terminal-Bench) tasks, played through ``bash`` |

``environments.python_tool.python_interpreter()`` is a sandboxed Python tool for any
tool-use environment.
"""
