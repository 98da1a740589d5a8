"""A rank > 0 of a multi-GPU megatron backend: ``python -m trainer.megatron._follower
SPEC`` (started by rank 0, see :mod:`trainer.megatron._ranks`). A module of its own so
that the ranks' module is imported once, not also run as ``__main__``."""

import sys
from pathlib import Path

from trainer.megatron._ranks import follow

follow(Path(sys.argv[1]))
