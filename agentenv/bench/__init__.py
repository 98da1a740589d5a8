"""The measurements behind ``agentenv bench``: each runs in a child process of its own
(:func:`run_child`) so that one measurement's imports and threads do not colour the next.

``engine_bench`` (the embedded engine against Hugging Face ``generate``) imports torch when
it runs, and ``http_compare`` (agentenv's HTTP server against a plain aiohttp application)
starts server processes, so both load on first use.
"""

from typing import TYPE_CHECKING, Any

from agentenv.bench._child import run_child
from agentenv.bench._parser import bench_parser

if TYPE_CHECKING:
    from agentenv.bench._engine import bench as engine_bench
    from agentenv.bench._grpo_engine import bench as grpo_engine_bench
    from agentenv.bench._http import compare as http_compare

__all__ = ["bench_parser", "engine_bench", "grpo_engine_bench", "http_compare", "run_child"]


def __getattr__(name: str) -> Any:
    if name == "engine_bench":
        from agentenv.bench._engine import bench

        return bench
    if name == "grpo_engine_bench":
        from agentenv.bench._grpo_engine import bench as grpo

        return grpo
    if name == "http_compare":
        from agentenv.bench._http import compare

        return compare
    raise AttributeError(f"module 'agentenv.bench' has no attribute {name!r}")
