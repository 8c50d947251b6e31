"""`wse bench NAME`: a benchmark against a baseline measured in the same run.

The one arrow from pyapi up to bench (tests/test_imports.py): only the benchmark named is imported.
"""
import argparse
import importlib


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
    from bench import BENCHMARKS

    p = sub.add_parser("bench", help="run a benchmark against a baseline measured in the same run",
                       description="Run a benchmark; print its table and optionally write JSON.")
    bench_sub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, (module_name, summary) in BENCHMARKS.items():
        if chosen != ("bench", name):  # only the chosen benchmark is imported, for its own options
            bench_sub.add_parser(name, help=summary, description=summary)
            continue
        # A benchmark module loads the kernels as it is imported (here, for its options), so the process
        # is set up first; cli._main's call, which every other subcommand gets before it runs, is then a no-op.
        from wse_core import configure_process

        configure_process()
        module = importlib.import_module(module_name)
        bp = bench_sub.add_parser(name, help=summary, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        bp.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-' for stdout)")
        module.add_arguments(bp)
        bp.set_defaults(func=_cmd_bench, bench_module=module_name)
