"""Games for multi-agent training, each a :class:`~agentenv.Game` plus its environment.

| name | roles | what |
|---|---|---|
| ``tictactoe`` | ``x``, ``o`` | 3x3 Tic-Tac-Toe; opponents ``random``, ``optimal`` (minimax) |
| ``kuhn_poker`` | ``player_0``, ``player_1`` | one hand of Kuhn Poker; opponents as above, Nash |
| ``nim`` | ``player_0``, ``player_1`` | Nim, normal play by default; optimal: nim-sum |
| ``openspiel`` | ``player_<i>`` | any sequential OpenSpiel game (``open_spiel`` package) |
| ``pettingzoo`` | the env's agents | any PettingZoo AEC game (``pettingzoo`` package) |

Each game is checked move by move against OpenSpiel's implementation in the tests.
"""
