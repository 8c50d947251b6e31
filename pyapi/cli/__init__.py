"""The `wse` command line: one subcommand per task, each with its own --help.

Each command group is a module that adds its subparser(s) and holds the functions that run them:

    doctor      doctor, demo
    train       fit, validate, compile
    plot        plot (the loss curves of runs)
    generate    generate
    serve       serve
    appliance   appliance start|stop|status, submit, jobs, logs, cancel
    params      params convert|keys
    data        data preprocess|inspect|verify
    checkpoint  checkpoint info|verify|convert|from-hf
    fabric      fabric run
    options     what several of them share (the parser and its spelling rule, a job's arguments)

Commands of the layer above plug in through the entry-point group ``wse.commands`` (a function
``add(subparsers, chosen)``): ``wse bench NAME`` is the bench package's, so nothing here imports
a benchmark (tests/test_imports.py).

Here: the top-level parser, and main() with its one-line errors and exit codes. The modules import
nothing heavy at import time, so `wse --help` stays quick (tests/test_cli.py).
"""
import importlib.metadata
import os
import select
import sys
import warnings

from pyapi.cli import appliance, checkpoint, data, doctor, fabric, generate, params, plot, serve, train
from pyapi.cli.options import Parser
# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).

#: The subcommands in the order `wse --help` lists them.
_COMMANDS = (doctor.add_doctor, doctor.add_demo, train.add_fit, appliance.add_appliance, appliance.add_submit,
             appliance.add_jobs, appliance.add_logs, appliance.add_cancel, train.add_validate, plot.add_plot,
             params.add_params, train.add_compile, generate.add_generate, serve.add_serve, data.add_data,
             checkpoint.add_checkpoint, fabric.add_fabric)
#: Where the commands of the layers above register (pyproject.toml's [project.entry-points]).
PLUGINS = "wse.commands"


def _version():
    try:
        return importlib.metadata.version("wse-cluster")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


def build_parser(argv=()):
    """The argument parser for ``argv``: the modules behind long help texts and benchmark options are
    imported only for the subcommand ``argv`` names, so ``wse --help`` stays quick."""
    chosen = tuple(argv[:2])
    parser = Parser(
        prog="wse",
        description="wse-cluster: an emulated wafer-scale cluster (CS-2 systems, MemoryX, SwarmX) on CPUs and MPI.",
        epilog="An option of several words takes either spelling: --num_csx or --num-csx.")
    parser.add_argument("--version", action="version", version=f"wse-cluster {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                help="what to do; `wse COMMAND --help` says how")
    plugged = {ep.name: ep for ep in importlib.metadata.entry_points(group=PLUGINS)}  # once each, by name
    for add in (*_COMMANDS, *(plugged[name].load() for name in sorted(plugged))):
        add(sub, chosen)
    return parser


def main(argv=None):
    _open_closed_std_fds()
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, where a reader that left is caught, rather than at exit
        return code
    except BrokenPipeError:
        if not _stdout_gone():
            raise
        # `wse ... | head`: the reader left. End quietly, as other command-line tools do; not by
        # SIGPIPE's default action, which would also end wse without a word when a pipe to one of
        # its own processes breaks (a killed preprocessing worker did).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # nothing left to flush at exit
        os.close(devnull)
        return 1


def _open_closed_std_fds():
    """Open /dev/null on a standard descriptor its caller closed (`wse fit >&-`: nothing to say there).
    Python has no sys.stdout then (a traceback at the first flush), and the first file opened later
    would take the descriptor: a job's log would receive what is written to standard output."""
    for fd, name, mode in ((0, "stdin", os.O_RDONLY), (1, "stdout", os.O_WRONLY), (2, "stderr", os.O_WRONLY)):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, mode)  # the lowest free descriptor: this one, the lower ones being open
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
            setattr(sys, name, open(fd, "r" if fd == 0 else "w", closefd=False))


def _stdout_gone():
    """Whether standard output's reader has gone: a pipe's reader closed it (POLLERR), a socket's
    peer shut it (POLLHUP)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), 0)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno, or no poll on this platform
        return False


def _main(argv):
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    if not argv:
        # Bare `wse` asks what there is, as `wse --help` does, and gets the same answer: the help on standard
        # output (`wse | less` pages it) and exit 0. Nothing was asked that failed; an error and exit 2 would
        # only add a line that sends the user to --help.
        parser.print_help()
        return 0
    args, extra = parser.parse_known_args(argv)  # parse_args, but for what a --set's mistake leaves over

    from data_tools.errors import DataWarning
    from mpi_launch.launcher import OutputLost
    from pyapi.modelzoo import ParamsWarning

    default_show = warnings.showwarning

    def show(message, category, *rest, **kwargs):  # our warnings are one line, as errors are
        if issubclass(category, (ParamsWarning, DataWarning, OutputLost)):
            print(f"wse {args.command}: warning: {message}", file=sys.stderr)
        else:
            default_show(message, category, *rest, **kwargs)

    warnings.showwarning = show
    from wse_core.errors import WseError  # here, not at the top: `wse --help` loads no wse_core

    try:
        if extra:
            # `--set k 5`: argparse would blame the 5 with the command's usage (exit 2); the --set missing its
            # = is the mistake, a value's, so it is one line and exit 1 as every params problem is.
            from pyapi.params import parse_override

            for item in getattr(args, "set", None) or ():
                parse_override(item)
            parser.chosen(args).error(f"unrecognized arguments: {' '.join(extra)}")  # with `wse fit`'s usage
        from wse_core import configure_process

        configure_process()
        return args.func(args)
    except (WseError, OSError) as exc:
        # User-facing failures are one line; WSE_DEBUG=1 shows the traceback behind it. Only the project's
        # root (wse_core.errors: a bad option, file or plan, a failed job) and the system's errors: a plain
        # ValueError or TypeError is a bug's, and keeps its traceback so it is reported rather than obeyed.
        if os.environ.get("WSE_DEBUG") or (isinstance(exc, BrokenPipeError) and _stdout_gone()):
            raise  # main() ends quietly when the reader of our output left
        print(f"wse {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"wse {args.command}: interrupted", file=sys.stderr)
        return 130
