"""The `wse` command line: one subcommand per task, each with its own --help."""
import argparse
import importlib
import importlib.metadata
import os
import sys

from mpi_launch import MPILaunchError


def _version():
    try:
        return importlib.metadata.version("wse-cluster")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def _cmd_doctor(args):
    from pyapi import doctor

    return doctor.main()


def _cmd_demo(args):
    from pyapi import demo

    return demo.main()


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


def build_parser():
    from bench import BENCHMARKS

    parser = argparse.ArgumentParser(
        prog="wse",
        description="wse-cluster: an emulated wafer-scale cluster (CS-2 systems, MemoryX, SwarmX) on CPUs and MPI.")
    parser.add_argument("--version", action="version", version=f"wse-cluster {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("doctor", help="check the installation and run a 2-rank MPI job",
                       description="Print Python, numpy/BLAS, OpenMP, h5py/HDF5 and MPI versions, "
                                   "then run a 2-rank MPI job through the mpich wheel's mpiexec.")
    p.set_defaults(func=_cmd_doctor)

    p = sub.add_parser("demo", help="run the main demo job on built-in defaults",
                       description="Run the main demo job on built-in defaults (no data or config needed).")
    p.set_defaults(func=_cmd_demo)

    p = sub.add_parser("bench", help="run a benchmark against a baseline measured in the same run",
                       description="Run a benchmark; print its table and optionally write JSON.")
    bench_sub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, module_name in BENCHMARKS.items():
        module = importlib.import_module(module_name)
        bp = bench_sub.add_parser(name, help=module.__doc__.splitlines()[0],
                                  description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        bp.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-' for stdout)")
        module.add_arguments(bp)
        bp.set_defaults(func=_cmd_bench, bench_module=module_name)
    return parser


def main(argv=None):
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, OSError, MPILaunchError) as exc:
        # User-facing failures are one line; WSE_DEBUG=1 shows the traceback behind it.
        if os.environ.get("WSE_DEBUG"):
            raise
        print(f"wse {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"wse {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
