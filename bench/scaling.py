"""Scaling of the emulated cluster, from the simulated-time model: samples/s and speed-up for 1 to 192 CS-2s.

    wse bench scaling [--json PATH] [--plot PNG] [--batch_per_csx 64] [--global_batch 512]
                      [--micro_batch N] [--real 1,2,4] [--system cs2|cs3]

For four GPT shapes at sequence 2048 (GPT-3 XL 1.3B, GPT-J 6B, GPT-3 13B and GPT-NeoX 20B: hidden
size, layers, heads and vocabulary; this project's GPT-2 blocks stand in for their variants),
``wse_core.perf.step.walk_step`` gives the simulated step time on 1, 2, 4, 8, 16, 32, 64 and 192
systems of ``--system`` (default cs2: 1.2 Tb/s per CS-2, SwarmX fan-out 4; cs3: the CS-3's constants,
``wse_core.perf.hardware.SYSTEMS``), each model in mixed precision
as Cerebras trains them (fp16 on the wafer, from ``model.mixed_precision``): (a) with the batch per
CS-2 held fixed, as in Cerebras' linear-scaling results, and (b) with the global batch held fixed
(each CS-2 gets global / N, at least one micro-batch), where the weight stream, which every CS-2
receives whole whatever its share of the batch, takes over. The baseline of every speed-up is the
same model on one CS-2 in the same run.

Then ``--real``: the small GPT-2 of ``wse bench stream`` trains through ``wse fit`` on those CS-2
counts on this machine; the wall clock's speed-up (median step after the first steps) is printed
next to the simulated clock's (the ranks' own clocks, from metrics.jsonl), and the walk's step for
the same model and batch beside it.
"""
import statistics
import sys
import tempfile
from pathlib import Path

from bench.harness import machine, numbers, table
from wse_core.errors import ConfigError

SEQ = 2048
#: (hidden, layers, heads, vocabulary) of the published shapes.
SHAPES = {"GPT-3 XL 1.3B": (2048, 24, 16, 50257), "GPT-J 6B": (4096, 28, 16, 50400),
          "GPT-3 13B": (5120, 40, 40, 50257), "GPT-NeoX 20B": (6144, 44, 64, 50432)}
COUNTS = [1, 2, 4, 8, 16, 32, 64, 192]


def add_arguments(parser):
    parser.add_argument("--batch_per_csx", type=int, default=64,
                        help="(a) sequences per CS-2 per step, held fixed")
    parser.add_argument("--global_batch", type=int, default=512, help="(b) sequences per step, held fixed")
    parser.add_argument("--micro_batch", type=int, default=None,
                        help="sequences per micro-batch (default: as micro_batch_size: auto, the largest that fits)")
    parser.add_argument("--plot", metavar="PNG", help="also draw the speed-ups")
    parser.add_argument("--real", default="1,2,4", help="CS-2 counts of the real wse fit runs ('' for none)")
    parser.add_argument("--system", default="cs2", choices=("cs2", "cs3"), help="the simulated system (default cs2)")


def model_of(shape):
    from wse_core.models import build_model

    h, layers, heads, vocab = shape
    return build_model({"name": "gpt2", "vocab_size": vocab, "hidden_size": h, "num_hidden_layers": layers,
                        "num_heads": heads, "max_position_embeddings": SEQ, "mixed_precision": True})


def _walk(model, n, per_csx, micro, seq, system="cs2"):
    """The walk of ``per_csx`` samples on each of ``n`` systems in micro-batches of ``micro`` (None: as
    ``micro_batch_size: auto`` takes them, the largest that fits the wafer)."""
    from wse_core.microbatch import MicroBatches
    from wse_core.perf import Hardware
    from wse_core.perf.memory import largest_micro_batch
    from wse_core.perf.step import walk_step

    hw = Hardware.for_model(model, system)
    if micro is None:
        micro = largest_micro_batch(model, MicroBatches.even_sizes(per_csx), seq, hw)
    s = walk_step(model, num_csx=n, samples_per_csx=per_csx, micro_batch_size=min(micro, per_csx), seq_len=seq, hw=hw)
    return dict(s.to_dict(), micro_batch_size=min(micro, per_csx))


def _real_runs(counts, steps=8):
    """The small GPT-2 of `wse bench stream` through `wse fit`: median wall step and the walk's step."""
    from bench.stream import BATCH, MICRO, MODEL, SEQ as STREAM_SEQ, SKIP, _params
    from data_tools.preprocess import preprocess_text
    from mpi_launch.resolved import describe
    from pyapi.job import Job

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        preprocess_text(["stdlib"], data, STREAM_SEQ, samples_per_file=8192, processes=1, progress=False)
        for n in counts:
            print(f"wse fit with num_csx={n} ...", file=sys.stderr, flush=True)
            params = _params(data, Path(tmp) / f"csx{n}", n, steps)
            job = Job(params)
            with open(Path(tmp) / f"fit{n}.log", "w") as log:
                result = job.fit(stream=log)
            wall = statistics.median(m["step_seconds"] for m in result.metrics[SKIP:])
            clock = statistics.median(m["sim_step_s"] for m in result.metrics[SKIP:])
            walk = describe(job.resolved)["simulated"]  # the same params: the same tree, batch and hardware
            out[str(n)] = {"wall_step_s": wall, "sim_step_s": clock, "walk_step_s": walk["step_s"]}
    return {"model": MODEL, "batch_size": BATCH, "micro_batch_size": MICRO, "runs": out}


def run(args):
    if min(args.batch_per_csx, args.global_batch, args.micro_batch or 1) < 1:
        raise ConfigError("--batch_per_csx, --global_batch and --micro_batch must be >= 1")
    real = numbers(args.real, "--real")
    result = {"benchmark": "scaling", "machine": machine(), "seq": SEQ, "counts": COUNTS,
              "batch_per_csx": args.batch_per_csx, "global_batch": args.global_batch,
              "micro_batch": args.micro_batch, "models": {}}
    from wse_core.perf import Hardware

    models = {name: model_of(shape) for name, shape in SHAPES.items()}
    # The walk's hardware: the defaults at the models' precision (all four train in mixed precision).
    system = getattr(args, "system", "cs2")
    result["hardware"] = Hardware.for_model(models["GPT-3 XL 1.3B"], system).to_dict()
    for name, model in models.items():
        fixed = {str(n): _walk(model, n, args.batch_per_csx, args.micro_batch, SEQ, system) for n in COUNTS}
        strong = {str(n): _walk(model, n, max(1, args.global_batch // n), args.micro_batch, SEQ, system)
                  for n in COUNTS}
        result["models"][name] = {"parameters": model.num_params(), "per_csx_fixed": fixed, "global_fixed": strong}
    if real:
        result["real"] = _real_runs(real)
    if args.plot:
        plot(result, args.plot)
    return result


def _speedups(runs):
    base = runs["1"]["samples_per_s"]
    return {n: r["samples_per_s"] / base for n, r in runs.items()}


def figure(result):
    """The speed-ups of (a) and (b) against the CS-2 count, a series per model, and the linear line."""
    from matplotlib.figure import Figure

    hw = result["hardware"]
    csx = f"{hw['system'].upper()[:2]}-{hw['system'][2:]}"
    fig = Figure(figsize=(11, 4.6), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    # Open markers of falling size, each series its own line style: where the models give the same
    # speed-up (all of (a)), every one stays visible, drawn one inside the other.
    styles = [("o", "-", 12), ("s", "--", 9), ("^", "-.", 6.5), ("D", ":", 4)]
    for ax, key, title in ((axes[0], "per_csx_fixed", f"(a) {result['batch_per_csx']} sequences per {csx}"),
                           (axes[1], "global_fixed", f"(b) global batch {result['global_batch']}")):
        ax.plot(COUNTS, COUNTS, color="0.85", lw=7, label="linear", zorder=1)
        for (name, m), (marker, ls, size) in zip(result["models"].items(), styles):
            s = _speedups(m[key])
            ax.plot(COUNTS, [s[str(n)] for n in COUNTS], marker=marker, ls=ls, ms=size, mfc="none", mew=1.3,
                    label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(COUNTS, [str(n) for n in COUNTS])
        ax.set_xlabel(f"{csx}s")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    top = [_speedups(m["per_csx_fixed"])[str(COUNTS[-1])] for m in result["models"].values()]
    if max(top) / min(top) < 1.01:  # said, not left to a reader to guess from one visible line
        axes[0].text(0.03, 0.97, f"the {len(top)} models coincide: {min(top):.2f}-{max(top):.2f}x\n"
                                 f"at {COUNTS[-1]} {csx}s (linear: {COUNTS[-1]}x)",
                     transform=axes[0].transAxes, va="top", fontsize=9)
    axes[0].set_ylabel(f"simulated speed-up over one {csx}")
    axes[0].legend(fontsize=8, loc="lower right")
    fig.suptitle(f"wse-cluster simulated time (a model: wse_core.perf), sequence {result['seq']}, "
                 f"{hw['precision']}, {hw['io_gbps'] / 1000:g} Tb/s per {csx}")
    return fig


def plot(result, path):
    figure(result).savefig(path, dpi=110)
    result["plot"] = str(path)


def report(result):
    system = result.get("hardware", {}).get("system", "cs2")
    lines = [f"simulated time of weight streaming (wse_core.perf), {system} systems, sequence {result['seq']}; "
             "speed-up over one system"]
    for key, title in (("per_csx_fixed", f"(a) {result['batch_per_csx']} sequences per system (global batch grows)"),
                       ("global_fixed", f"(b) global batch {result['global_batch']} (split over the systems)")):
        rows = []
        for n in result["counts"]:
            row = [n]
            for m in result["models"].values():
                r = m[key][str(n)]
                row += [f"{r['samples_per_s']:.1f}", f"{_speedups(m[key])[str(n)]:.2f}"]
            rows.append(row)
        headers = [f"{system.upper()[:2]}-{system[2:]}s"]
        for name in result["models"]:
            headers += [f"{name} samples/s", "speed-up"]
        lines += ["", title, table(rows, headers)]
    lines.append("")
    rows = []
    for name, m in result["models"].items():
        one = m["per_csx_fixed"]["1"]
        rows.append([name, f"{m['parameters'] / 1e9:.2f}B", f"{one['step_s']:.3f}", f"{one['compute_s']:.3f}",
                     f"{one['stream_s']:.3f}", f"{one['exposed_stream_s']:.3f}", f"{one['reduce_tail_s'] * 1e3:.2f}",
                     f"{one['optimizer_s']:.3f}", f"{m['per_csx_fixed']['192']['reduce_tail_s'] * 1e3:.2f}"])
    lines += [f"one {system.upper()[:2]}-{system[2:]}, (a): where a step goes (seconds; tails in ms)",
              table(rows, ["model", "params", "step", "compute", "I/O-bound", "stream exposed", "reduce tail",
                           "optimizer", "reduce tail at 192"])]
    if "real" in result:
        real = result["real"]
        runs = real["runs"]
        first = next(iter(runs))
        rows = [[n, f"{r['wall_step_s'] * 1e3:.0f}", f"{runs[first]['wall_step_s'] / r['wall_step_s']:.2f}",
                 f"{r['sim_step_s'] * 1e3:.4f}", f"{runs[first]['sim_step_s'] / r['sim_step_s']:.2f}",
                 f"{r['walk_step_s'] * 1e3:.4f}"] for n, r in runs.items()]
        m = real["model"]
        lines += ["", f"real wse fit runs on this machine: GPT-2 {m['num_hidden_layers']} x {m['hidden_size']}, "
                      f"global batch {real['batch_size']}, micro-batch {real['micro_batch_size']}",
                  table(rows, ["CS-2s", "wall step ms", "wall speed-up", "simulated step ms (ranks' clocks)",
                               "simulated speed-up", "walk step ms"])]
    if "plot" in result:
        lines.append(f"plot: {result['plot']}")
    return "\n".join(lines)
