"""`wse plot`: the loss curves of one or more runs, on the same axes."""
from pathlib import Path

# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).


def _cmd_plot(args):
    from mpi_launch.rundir import RunDir
    from pyapi import plot

    # One run: its own loss.png, the picture `wse fit` leaves there, redrawn (a run still training, or one
    # stopped before its end). Several: a picture of them all, where the command runs.
    output = args.output or (RunDir(args.runs[0]).loss_png if len(args.runs) == 1 else Path("loss.png"))
    print(f"wrote {plot.save(plot.loss_figure(args.runs), output)}")
    return 0


def add_plot(sub, chosen):
    p = sub.add_parser("plot", help="draw the loss and simulated samples/s of runs against the step",
                       description="Draw the loss (training, and evaluations as points) and the simulated "
                                   "samples/s of each RUN (a model_dir: its metrics.jsonl) against the step, one "
                                   "line per run, labelled by its directory's name. `wse fit` draws its own run's "
                                   "into MODEL_DIR/loss.png when it ends.")
    p.add_argument("runs", nargs="+", metavar="RUN", help="a run directory (model_dir)")
    p.add_argument("--output", metavar="PNG",
                   help="where to write the picture (default: RUN/loss.png for one run, loss.png here for "
                        "several; an .svg or .pdf suffix writes that format)")
    p.set_defaults(func=_cmd_plot)
