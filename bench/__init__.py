"""Microbenchmarks and end-to-end benchmarks; each compares against a baseline measured in the same run.

Every benchmark module has ``add_arguments(parser)`` and ``run(args) -> dict``; ``wse bench NAME``
prints its table and writes its JSON. The table below is all the command line reads until a
benchmark is chosen, so ``wse --help`` imports none of them (the first line of each help is the
module's docstring; a test holds them equal).

``wse bench`` is this package's command: ``add_bench`` plugs it into the command line through the
entry-point group ``wse.commands`` (pyproject.toml), so the command line, a layer below, names no
benchmark (tests/test_imports.py).
"""
import argparse
import importlib

BENCHMARKS = {
    "optim": ("bench.optim", "Fused AdamW against plain numpy and against memory-copy bandwidth, in the same run."),
    "nn": ("bench.nn", "Forward + backward of one GPT-2 block and of a small GPT-2: fused kernels against "
                       "unfused numpy (and PyTorch, if installed)."),
    "input": ("bench.input", "The input pipeline: preprocessing against the tokenizer alone and a plain h5py "
                             "write; loading against raw h5py."),
    "stream": ("bench.stream", "Weight streaming end to end: step time and its breakdown for 1, 2 and 4 CS-2s, "
                               "against the single-process step."),
    "sparse": ("bench.sparse", "Sparse kernels on transformer-sized weights: GFLOP/s against scipy.sparse and "
                               "dense numpy, spmv against copy bandwidth."),
    "faults": ("bench.faults", "Fault campaign: kill and stop every role at random moments, kill the launcher; "
                               "count what is named right."),
    "scaling": ("bench.scaling", "Scaling of the emulated cluster, from the simulated-time model: samples/s and "
                                 "speed-up for 1 to 192 CS-2s."),
    "fidelity": ("bench.fidelity", "The simulated time held against real CS-2 and CS-3 training runs: published "
                                   "samples/s next to the walk's."),
    "appliance": ("bench.appliance", "The appliance against `wse fit`: the same jobs queued on a CS-2 pool, and run "
                                     "one after another directly."),
    "cstorch": ("bench.cstorch", "A user's PyTorch model through the Cerebras-API front-end: step time on 1 CS-2 "
                                 "against eager PyTorch."),
    "peers": ("bench.peers", "The same GPT-2 trained by `wse fit` on 1, 2 and 4 CS-2s, against PyTorch in one "
                             "process and DDP, in one run."),
    "serve": ("bench.serve", "`wse serve` against transformers' generate: requests/s and tokens/s, and the "
                             "emulated hardware's time per output token."),
    "fabric": ("bench.fabric", "The PE-mesh simulator's speed, and BiCGSTAB cycles per iteration next to the "
                               "SC20 figures."),
}


def _cmd_bench(args):
    from bench.harness import write_json

    module = importlib.import_module(args.bench_module)
    result = module.run(args)
    print(module.report(result))
    if args.json:
        write_json(result, args.json)
        if args.json != "-":
            print(f"wrote {args.json}")
    return 0


def add_bench(sub, chosen):
    """Add ``wse bench NAME`` to the command line's subparsers; only the chosen benchmark is imported."""
    p = sub.add_parser("bench", help="run a benchmark against a baseline measured in the same run",
                       description="Run a benchmark; print its table and optionally write JSON.")
    bench_sub = p.add_subparsers(dest="bench", metavar="NAME", required=True,
                                 help="the benchmark; `wse bench NAME --help` says what it measures")
    for name, (module_name, summary) in BENCHMARKS.items():
        if chosen != ("bench", name):  # only the chosen benchmark is imported, for its own options
            bench_sub.add_parser(name, help=summary, description=summary)
            continue
        # A benchmark module loads the kernels as it is imported (here, for its options), so the process
        # is set up first; the command line's own call, which every subcommand gets before it runs, is
        # then a no-op.
        from wse_core import configure_process

        configure_process()
        module = importlib.import_module(module_name)
        bp = bench_sub.add_parser(name, help=summary, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        bp.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-' for stdout)")
        module.add_arguments(bp)
        bp.set_defaults(func=_cmd_bench, bench_module=module_name)
