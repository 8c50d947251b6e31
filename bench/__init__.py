"""Microbenchmarks and end-to-end benchmarks; each compares against a baseline measured in the same run.

Every benchmark module has ``add_arguments(parser)`` and ``run(args) -> dict``; ``wse bench NAME``
prints its table and writes its JSON.
"""
BENCHMARKS = {
    "optim": "bench.optim",
    "nn": "bench.nn",
    "input": "bench.input",
    "stream": "bench.stream",
    "sparse": "bench.sparse",
    "fabric": "bench.fabric",
}
