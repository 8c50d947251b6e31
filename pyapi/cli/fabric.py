"""`wse fabric run`: a reference program on the simulated PE mesh, checked against numpy."""
import json
import time

from pyapi.cli.options import print_json_or_lines
# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).


def _cmd_fabric_run(args):
    import numpy as np

    from wse_core.fabric.programs import PROGRAMS

    program = PROGRAMS[args.kernel]
    kw = program.keywords(args)
    t0 = time.perf_counter()
    got, expected, result = program.run(args.width, args.height, seed=args.seed, **kw)
    wall = time.perf_counter() - t0
    err = float(np.abs(got.astype(np.float64) - expected).max()) if got.size else 0.0
    report = {"kernel": args.kernel, "width": args.width, "height": args.height, **kw,
              "max_abs_error": err, **result.report(), "wall_seconds": wall, **program.extra(result, kw)}
    if args.heatmap:
        report["heatmap"] = str(result.heatmap(args.heatmap))
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_json_or_lines(report, False)
    return 0


def add_fabric(sub, chosen):
    p = sub.add_parser("fabric", help="run a reference program on the simulated PE mesh",
                       description="Dataflow PE-mesh simulator: run a reference program, check it against numpy, "
                                   "report cycles and per-PE activity.")
    fab_sub = p.add_subparsers(dest="fabric_command", metavar="ACTION", required=True,
                               help="`wse fabric ACTION --help` says more")
    if chosen[:1] == ("fabric",):  # the programs' registry loads numpy: only for the command that uses it
        # As for a benchmark (bench.add_bench), the process is set up before the registry loads numpy.
        from wse_core import configure_process
        from wse_core.fabric.programs import PROGRAMS, options

        configure_process()
        fp = fab_sub.add_parser("run", help=f"run KERNEL ({', '.join(PROGRAMS)}); report its error and cycles",
                                description="Run a reference program on a WIDTH x HEIGHT mesh of simulated PEs "
                                            "with random input, check its output against numpy, and report the "
                                            "largest error and the cycles it took (--heatmap draws each PE's "
                                            "activity).")
        fp.add_argument("kernel", metavar="KERNEL", choices=list(PROGRAMS),
                        help=f"the program: {', '.join(PROGRAMS)}")
        fp.add_argument("--width", type=int, default=16, help="PEs along x")
        fp.add_argument("--height", type=int, default=16, help="PEs along y")
        for flag, (kind, default, text) in options().items():
            fp.add_argument(f"--{flag}", type=kind, default=default, help=text)
        fp.add_argument("--seed", type=int, default=0, help="seed of the random input")
        fp.add_argument("--json", action="store_true", help="print JSON")
        fp.add_argument("--heatmap", metavar="FILE", help="write a PNG of per-PE activity")
        fp.set_defaults(func=_cmd_fabric_run)
