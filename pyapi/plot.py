"""Pictures of training: the loss curves of runs (the loss.png every `wse fit` leaves in its model_dir,
and `wse plot RUN...`), and the layout `wse compile --plot` draws (weight streaming's cluster and step, or
the pipelined placement on the wafer).

Figures are matplotlib ``Figure`` objects made directly, never through pyplot: pyplot keeps a global
backend and a list of open figures, and ``Job.fit()`` draws from a user's notebook, the appliance and
cstorch's job thread, whose own plotting it must leave alone. ``Figure.savefig`` renders with Agg
whatever backend the process has. matplotlib is imported inside the functions: ``wse --help`` stays quick.
"""
import math
from pathlib import Path

from data_tools.files import replacing
from mpi_launch.rundir import RunDir
from wse_core.checks import plural
from wse_core.errors import ConfigError, DataError
# matplotlib (heavy, and only for pictures) is imported inside the functions that draw.


def read_run(path):
    """(steps, evaluations): the records of the run directory ``path``'s metrics.jsonl with a ``loss``, and
    those with an ``eval_loss``. A ValueError naming the directory when it is not a run, or has no step yet."""
    run = RunDir(path)
    if not run.metrics.is_file():
        raise DataError(f"{path}: not a run directory (no {run.metrics.name} in it)")
    records = run.read_metrics()
    steps = [r for r in records if "loss" in r]
    if not steps:
        raise DataError(f"{run.metrics}: no training step in it yet")
    return steps, [r for r in records if "eval_loss" in r]


def _labels(paths):
    """Each run's name (its directory's), or the path as given where two runs share a name."""
    names = [Path(p).resolve().name for p in paths]
    return [n if names.count(n) == 1 else str(p) for n, p in zip(names, paths)]


def loss_figure(runs):
    """The loss against the step (training; evaluations as points) and, below, the simulated samples/s,
    one line per run directory of ``runs``, labelled by its name."""
    from matplotlib.figure import Figure

    read = [read_run(r) for r in runs]  # all of them first: a bad one is named before anything is drawn
    fig = Figure(figsize=(8, 6.5), layout="constrained")
    loss, speed = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    several = len(runs) > 1
    for k, (name, (steps, evals)) in enumerate(zip(_labels(runs), read)):
        color, x = f"C{k % 10}", [r["step"] for r in steps]
        loss.plot(x, [r["loss"] for r in steps], color=color, lw=1, label=f"{name}: training" if several else
                  "training (each step's global batch)")
        if evals:
            loss.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o", color=color, mec="black",
                      label=f"{name}: eval_input" if several else "evaluation on eval_input")
        # A record without the simulated clock (none today) leaves a gap rather than a made-up point.
        speed.plot(x, [r.get("sim_samples_per_s", math.nan) for r in steps], color=color, lw=1, label=name)
    loss.set_ylabel("loss")
    loss.legend(fontsize=8)
    loss.grid(alpha=0.3)
    loss.set_title("loss", fontsize=10)
    speed.set_ylim(0, 1.1 * speed.get_ylim()[1])  # from 0: a step's jitter of a few percent is not drawn as a cliff
    speed.set_xlabel("step")
    speed.set_ylabel("samples/s (simulated)")
    speed.set_title("samples/s of the emulated cluster, by its simulated clock (wse_core.perf), "
                    "not this machine's", fontsize=10)
    speed.grid(alpha=0.3)
    if several:
        speed.legend(fontsize=8)
    fig.suptitle(f"{len(runs)} runs" if several else f"{runs[0]}: {len(read[0][0])} steps")
    return fig


def save(fig, path):
    """Write ``fig`` to ``path`` (PNG, or the format its suffix names: .svg, .pdf), replaced whole, so a
    viewer that reloads it never reads half a picture; return ``path``."""
    path = Path(path)
    if not path.parent.is_dir():
        raise ConfigError(f"{path}: no directory {path.parent} to write it in")
    with replacing(path) as tmp:
        try:
            fig.savefig(tmp, format=path.suffix[1:] or "png", dpi=110)
        except ValueError as exc:  # matplotlib's "Format 'x' is not supported (supported formats: ...)"
            raise ConfigError(f"{path}: {exc}") from None
    return path


def compile_figure(d):
    """What `wse compile --plot` draws of ``d`` (``mpi_launch.resolved.describe``): the run as it will
    execute, the pipelined placement on one wafer or weight streaming's cluster and step."""
    if d["execution_strategy"] == "pipeline":
        return _pipelined(d)
    return _weight_streaming(d)


def _size(n):
    return f"{n / 1e9:.3g} GB" if n >= 1e9 else f"{n / 1e6:.3g} MB"


def _seconds(t):
    """A scale and unit for times up to ``t`` seconds: ms, or s from a second on."""
    return (1, "s") if t >= 1 else (1e3, "ms")


def _rate(x):
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _barh(ax, labels, values, colors=None, text=None):
    """Horizontal bars, the first on top, each with its value (or ``text``) at its end."""
    ax.barh(range(len(values)), values, color=colors or "C0")
    every = -(-len(values) // 20)  # about 20 names at most, the first and the last among them: they stay legible
    shown = sorted({*range(0, len(values), every), len(values) - 1})
    ax.set_yticks(shown, [labels[i] for i in shown], fontsize=7 if len(values) > 16 else 8)
    ax.invert_yaxis()
    if len(values) <= 24:  # beyond, the numbers overlap; the bars still say it
        for y, (v, t) in enumerate(zip(values, text or [f"{v:.3g}" for v in values])):
            ax.text(v, y, f" {t}", va="center", fontsize=7)
    ax.margins(x=0.25)


def _weight_streaming(d):
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    plan, m, sim, wafer = d["plan"], d["model"], d["simulated"], d["wafer_bytes"]
    fig = Figure(figsize=(13, 8), layout="constrained")
    ax = fig.subplot_mosaic([["cluster", "units"], ["step", "wafer"]])
    n_csx, n_mx, n_sx = len(plan["csx"]), len(plan["memoryx"]), len(plan["swarmx"])
    fig.suptitle(f"weight streaming: {m['name']}, {m['parameters']:,} parameters in {len(m['units'])} streaming units "
                 f"on {n_csx} CS-2{'s' if n_csx > 1 else ''}, {n_mx} MemoryX, {n_sx} SwarmX")
    _cluster(ax["cluster"], plan)
    owner = plan["unit_owner"]
    _barh(ax["units"], m["units"], [b / 1e6 for b in plan["unit_bytes"]],
          colors=[f"C{k % 10}" for k in owner])
    held = [[b for b, o in zip(plan["unit_bytes"], owner) if o == k] for k in range(n_mx)]
    ax["units"].legend(handles=[Patch(color=f"C{k % 10}", label=f"MemoryX rank {rank}: {len(held[k])} units, "
                                                                  f"{_size(sum(held[k]))}")
                                for k, rank in enumerate(plan["memoryx"])], fontsize=8)
    ax["units"].set_xlabel("MB of float32 weights at MemoryX")
    ax["units"].set_title("(b) the streaming units by MemoryX, in forward order:\n"
                          "each pass streams them one by one to every CS-2", fontsize=10)
    parts = [("step", sim["step_s"]), ("compute", sim["compute_s"]), ("waiting for weights", sim["exposed_stream_s"]),
             ("weights and gradients over the I/O", sim["stream_s"]), ("reduce tail", sim["reduce_tail_s"]),
             ("MemoryX update", sim["optimizer_s"])]
    scale, unit = _seconds(sim["step_s"])
    _barh(ax["step"], [p for p, _ in parts], [s * scale for _, s in parts], colors=["C3"] + ["C7"] * (len(parts) - 1))
    ax["step"].set_xlabel(f"{unit}, simulated (wse_core.perf)")
    ax["step"].set_title(f"(c) a step, simulated: {sim['step_s'] * scale:.3g} {unit}, {_rate(sim['samples_per_s'])} "
                         f"samples/s;\n{plural(sim['detail']['micro_batches'], 'micro-batch')} per CS-2; the parts overlap",
                         fontsize=10)
    need = [(f"activations: one unit's input kept every {wafer['interval']} units", wafer["checkpoints"]),
            ("activations: the segment recomputed", wafer["segment"]), ("weights in flight", wafer["weights"]),
            ("gradients in flight", wafer["gradients"]), ("all of it", wafer["need"])]
    _barh(ax["wafer"], [p for p, _ in need], [b for _, b in need], colors=["C7"] * 4 + ["C3"],
          text=[_size(b) for _, b in need])
    ax["wafer"].axvline(wafer["capacity"], color="black", ls="--", label=f"usable SRAM, {_size(wafer['capacity'])}")
    ax["wafer"].set_xscale("log")
    ax["wafer"].set_xlabel("bytes (log scale)")
    ax["wafer"].legend(fontsize=8, loc="lower right")
    ax["wafer"].set_title(f"(d) a CS-2's wafer memory, a micro-batch of {wafer['micro_batch_size']}:\n"
                          f"{100 * wafer['need'] / wafer['capacity']:.2g}% of its usable SRAM", fontsize=10)
    return fig


def _cluster(ax, plan):
    """MemoryX over the SwarmX tree over the CS-2s: the weights go down it, the gradients come up."""
    children = {int(k): v for k, v in plan["children"].items()}
    root = plan["swarmx"][0]
    depth, order = {root: 0}, [root]
    for r in order:  # the SwarmX nodes, breadth first from the root
        for c in children[r]:
            if c in children:
                depth[c] = depth[r] + 1
                order.append(c)
    rows = [plan["memoryx"], *([r for r in order if depth[r] == k] for k in range(max(depth.values()) + 1)),
            plan["csx"]]
    x = {r: (i + 0.5) / len(plan["csx"]) for i, r in enumerate(plan["csx"])}
    for r in reversed(order):  # each SwarmX node above the middle of its children
        x[r] = sum(x[c] for c in children[r]) / len(children[r])
    x.update({r: (i + 0.5) / len(rows[0]) for i, r in enumerate(rows[0])})
    y = {r: len(rows) - 1 - i for i, level in enumerate(rows) for r in level}
    edges = [(mx, root) for mx in rows[0]] + [(p, c) for p in children for c in children[p]]
    for a, b in edges:
        ax.plot([x[a], x[b]], [y[a], y[b]], color="0.6", lw=0.8, zorder=1)
    names = ["MemoryX"] + ["SwarmX"] * (len(rows) - 2) + ["CS-2"]
    # MemoryX in the colours of (b); the rest in greys.
    colors = [[f"C{k % 10}" for k in range(len(rows[0]))], *(["0.85"] * len(level) for level in rows[1:-1]),
              ["0.6"] * len(rows[-1])]
    for level, name, color, marker in zip(rows, names, colors, ["s"] + ["D"] * (len(rows) - 2) + ["s"]):
        ax.scatter([x[r] for r in level], [y[r] for r in level], s=300 if len(level) <= 16 else 40, c=color,
                   marker=marker, zorder=2, edgecolors="black")
        if len(level) <= 16:  # the ranks, where they can be read
            for r in level:
                ax.text(x[r], y[r], str(r), ha="center", va="center", fontsize=7, zorder=3)
    ax.set_yticks(range(len(rows)), [f"{n} ({len(level)})" for n, level in zip(names, rows)][::-1], fontsize=8)
    ax.set_xticks([])
    ax.set_xlim(0, 1)
    ax.set_ylim(-0.5, len(rows) - 0.5)
    for side in ("top", "right", "bottom"):
        ax.spines[side].set_visible(False)
    ax.set_title("(a) the cluster, by MPI rank: the weights go down the SwarmX tree\nto every CS-2, the gradients "
                 "are summed up it to MemoryX", fontsize=10)


def _pipelined(d):
    from matplotlib.figure import Figure
    from matplotlib.patches import Rectangle

    p, m = d["pipeline"], d["model"]
    regions = p["regions"]
    width = regions[-1]["columns"][1]
    height = regions[0]["pes"] / (regions[0]["columns"][1] - regions[0]["columns"][0])
    fig = Figure(figsize=(13, 7.5), layout="constrained")
    ax = fig.subplot_mosaic([["wafer", "stage"], ["wafer", "memory"]], width_ratios=(1.1, 1))
    fig.suptitle(f"pipelined on one CS-2: {m['name']}, {m['parameters']:,} parameters, {len(regions)} layers, each on "
                 f"a region of the wafer; a step {p['step_s'] * 1e3:.3g} ms (simulated)")
    wafer = ax["wafer"]
    for k, r in enumerate(regions):
        lo, hi = r["columns"]
        # A black edge: a region of a column or two (an embedding's, a small head's) is still a line to see.
        wafer.add_patch(Rectangle((lo, 0), hi - lo, height, color=f"C{k % 10}", ec="black", lw=0.4))
    # A margin: a region at the wafer's edge is not lost in the axis' own line.
    wafer.set_xlim(-0.015 * width, 1.015 * width)
    wafer.set_ylim(-0.015 * height, 1.015 * height)
    wafer.set_aspect("equal")
    wafer.set_xlabel("PE column (samples flow west to east)")
    wafer.set_ylabel("PE row")
    # Every region named along the top, however narrow: a label inside a stripe of 2 columns has no room.
    top = wafer.secondary_xaxis("top")
    top.set_xticks([(r["columns"][0] + r["columns"][1]) / 2 for r in regions], [r["name"] for r in regions],
                   rotation=90, fontsize=7)
    wafer.set_title(f"(a) the program rectangle, {width} x {height:.0f} PEs, a stripe of columns per layer",
                    fontsize=10)
    names = [r["name"] for r in regions]
    colors = [f"C{k % 10}" for k in range(len(regions))]
    _barh(ax["stage"], names, [r["stage_s"] * 1e3 for r in regions], colors=colors)
    ax["stage"].axvline(p["slowest_stage_s"] * 1e3, color="black", ls="--", lw=0.8)
    ax["stage"].set_xlabel("ms, simulated")
    ax["stage"].set_title(f"(b) forward and backward of a micro-batch, each layer on its region:\n"
                          f"{plural(p['micro_batches'], 'micro-batch')} of {p['micro_batch_size']} a step, paced by the "
                          "slowest (dashed)", fontsize=10)
    _barh(ax["memory"], names, [100 * r["need_bytes"] / r["capacity_bytes"] for r in regions], colors=colors,
          text=[f"{_size(r['need_bytes'])} of {_size(r['capacity_bytes'])}" for r in regions])
    ax["memory"].axvline(100, color="black", ls="--", lw=0.8)
    ax["memory"].set_xlabel("% of the region's usable SRAM")
    ax["memory"].set_title("(c) memory used of each region: the weights with their training state,\n"
                           "and the activations of the micro-batches in flight", fontsize=10)
    return fig
