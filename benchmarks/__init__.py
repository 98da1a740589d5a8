"""agentenv's benchmarks: every ``agentenv bench BENCH`` (docs/benchmarks.md).

This package sits beside the product in the same distribution and uses it only as a user
would, through its public names (an import contract checks it); the product never imports
it. Each bench is added to ``agentenv bench`` by an entry point of the group
``agentenv.benches`` (pyproject.toml) and most run their measurements in child processes
(:func:`run_child`, ``python -m benchmarks.MODULE``) so that one measurement's imports and
threads do not colour the next. The helpers here are what the benches share; the tests
reach the test machinery through its modules (:mod:`benchmarks.hosts`: hosts in network
namespaces; :mod:`benchmarks.cuda_check`: a tiny random Llama and its tokenizer).
"""

from benchmarks._child import ROOT, emit, free_port, run_child
from benchmarks._parser import bench_parser

__all__ = ["ROOT", "bench_parser", "emit", "free_port", "run_child"]
