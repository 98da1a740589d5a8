"""Games for multi-agent training, each a :class:`~agentenv.Game` plus its environment:
``tictactoe``, ``kuhn_poker``, ``nim``, and the adapters ``openspiel`` (any sequential
OpenSpiel game) and ``pettingzoo`` (any PettingZoo AEC game). Their roles, conventions and
opponents: docs/games.md, "Bundled games". Each game is checked move by move against
OpenSpiel's implementation in the tests.
"""
