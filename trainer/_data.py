"""Training prompts from a prompt data file (slime's ``--prompt-data``): agentenv's
reader (:func:`agentenv.load_prompt_data`: JSONL, Parquet, ``datasets`` directories)."""

from __future__ import annotations

from agentenv import load_prompt_data, read_prompt_data

__all__ = ["load_prompt_data", "read_prompt_data"]
