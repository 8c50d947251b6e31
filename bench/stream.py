"""Weight streaming end to end: step time and its breakdown for 1, 2 and 4 CS-2s, against the single-process step.

    wse bench stream [--json PATH] [--steps K] [--num_csx 1,2,4] [--reduce_mib 1,4,16,64]

The same GPT-2 (hidden 256, 4 layers, 4 heads, sequence 128, byte vocabulary; 3.3M parameters)
trains on the standard-library corpus with the same global batch (16) and micro-batch (4) through
``wse fit`` for each num_csx; the first steps (imports, first-touch allocation) are skipped and the
median of the rest reported. The baseline is ``reference_step`` in this process on the same model,
data and batch, timed before and after the cluster runs (median of both sets of steps, because a
shared machine drifts): the ratio num_csx=1 step / reference step is what the cluster machinery costs.

Breakdown of a step, from the ranks' ``logs/timing_rank_*.jsonl`` (monotonic clocks of one machine):
``broadcast`` the time a CS-2's compute waited for streamed weights (mean over CS-2s); ``compute`` the
CS-2's forward, loss and backward (mean); ``reduce`` from the last CS-2's end of backward until the
MemoryX has every gradient sum (the part of the reduce not hidden behind the backward pass);
``optimizer`` the part of the MemoryX update the step's first weights wait for (the rest runs behind the
CS-2s' compute, ``roles.memoryx``); ``waiting`` the rest of the step (input, losses and norms to the
coordinator, its control message). Every run's weights are also checked bit-identical across num_csx.
Beside the wall clock: the simulated step of the emulated hardware, from the ranks' own simulated
clocks in metrics.jsonl (wse_core.perf; docs/design.md section 6).

Then the SwarmX reduce alone (``messaging.Link.reduce`` at every node of the tree of the largest
num_csx) against MPI_Reduce and MPI_Allreduce on the same ranks and buffer sizes, in one mpiexec.
"""
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import machine, numbers, table
from wse_core.errors import ConfigError, JobError

MODEL = {"name": "gpt2", "vocab_size": 257, "hidden_size": 256, "num_hidden_layers": 4, "num_heads": 4,
         "max_position_embeddings": 128}
SEQ, BATCH, MICRO = 128, 16, 4
SKIP = 3  # first steps: imports and first-touch allocation on every rank


def _ints(text, flag="--num_csx"):
    return numbers(text, flag)


def add_arguments(parser):
    parser.add_argument("--steps", type=int, default=10, help=f"training steps per run (the first {SKIP} are skipped)")
    parser.add_argument("--num_csx", default="1,2,4", help="comma-separated CS-2 counts")
    parser.add_argument("--reduce_mib", default="1,4,16,64", help="buffer sizes of the reduce test (MiB)")
    parser.add_argument("--repeats", type=int, default=7, help="repetitions of each reduce (median reported)")


def _params(data, model_dir, num_csx, steps):
    from pyapi.params import validate

    return validate({
        "train_input": {"data_dir": str(data), "batch_size": BATCH, "micro_batch_size": MICRO, "shuffle": True,
                        "shuffle_seed": 1},
        "model": dict(MODEL),
        "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3, "weight_decay": 0.01,
                      "max_gradient_norm": 1.0},
        "runconfig": {"max_steps": steps, "num_csx": num_csx, "num_wgt_servers": 1, "num_workers_per_csx": 1,
                      "model_dir": str(model_dir), "log_steps": steps},
    })


def _reference(params, steps):
    """Median seconds of reference_step on the same model, data and batch (same first steps skipped)."""
    from data_tools.dataset import GlobalStream
    from wse_core.models import build_model
    from wse_core.nn import reference_step
    from wse_core.optim import make_optimizer

    model = build_model(params.model)
    weights = model.init_params(0)
    opt = make_optimizer("AdamW", lr=1e-3, weight_decay=0.01)
    state = {k: opt.init_state(v) for k, v in weights.items()}
    t = params.train_input
    stream = GlobalStream(t.data_dir, shuffle=True, seed=1)
    times = []
    try:
        for step in range(steps):
            t0 = time.perf_counter()
            ex = stream.read(step * BATCH, BATCH)  # the input read counts, as the cluster's does
            batch = model.batch_of(ex)
            reference_step(model, weights, state, opt, batch, micro_batch_size=MICRO, step=step + 1, lr=1e-3,
                           max_gradient_norm=1.0)
            times.append(time.perf_counter() - t0)
    finally:
        stream.close()
    return times[SKIP:], weights


def _read_jsonl(path):
    return [json.loads(x) for x in Path(path).read_text().splitlines() if x.strip()]


def _breakdown(model_dir, plan):
    """Median over the timed steps of each part of a step (seconds)."""
    from mpi_launch.rundir import RunDir

    run_dir = RunDir(model_dir)
    metrics = run_dir.read_metrics()
    csx = [{r["step"]: r for r in _read_jsonl(run_dir.timing_log(rank))} for rank in plan.csx]
    mx = [{r["step"]: r for r in _read_jsonl(run_dir.timing_log(rank))} for rank in plan.memoryx]
    parts = {k: [] for k in ("step", "broadcast", "compute", "reduce", "optimizer", "waiting")}
    for m in metrics[SKIP:]:
        s = m["step"]
        row = {
            "step": m["step_seconds"],
            "broadcast": statistics.fmean(c[s]["weight_wait"] for c in csx),
            "compute": statistics.fmean(c[s]["compute"] for c in csx),
            "reduce": max(0.0, max(x[s]["at_grads_in"] for x in mx) - max(c[s]["at_backward_end"] for c in csx)),
            "optimizer": max(x[s]["optimizer"] for x in mx),
        }
        row["waiting"] = max(0.0, row["step"] - sum(row[k] for k in ("broadcast", "compute", "reduce", "optimizer")))
        for k, v in row.items():
            parts[k].append(v)
    out = {k: statistics.median(v) for k, v in parts.items()}
    sim = statistics.median(m["sim_step_s"] for m in metrics[SKIP:])  # the ranks' simulated clocks
    out["simulated"] = {"step_s": sim, "samples_per_s": BATCH / sim}
    out["bytes_per_step"] = sum(x[metrics[-1]["step"]]["bytes_out"] + x[metrics[-1]["step"]]["bytes_in"] for x in mx)
    return out


def _reduce_bandwidth(num_csx, sizes, repeats):
    from mpi_launch.mpiexec import run_mpi
    from mpi_launch.plan import make_plan

    plan = make_plan(num_csx=num_csx, num_wgt_servers=1, num_workers_per_csx=1, swarmx_fanout=2, unit_bytes=[1])
    ranks = 1 + len(plan.swarmx) + num_csx
    proc = run_mpi(ranks, [sys.executable, "-m", "bench._swarmx_reduce", num_csx, 2, repeats, *sizes],
                   timeout=900, env={"OMP_WAIT_POLICY": "PASSIVE"})
    if proc.returncode != 0:
        raise JobError(f"the reduce benchmark failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(args):
    from data_tools.checkpoint import Checkpoint
    from data_tools.preprocess import preprocess_text
    from pyapi.job import Job

    counts, sizes = _ints(args.num_csx), numbers(args.reduce_mib, "--reduce_mib", float)
    if args.steps <= SKIP or not counts or min(counts) < 1 or args.repeats < 1:
        raise ConfigError(f"--steps must be > {SKIP}, --num_csx positive integers, --repeats >= 1")
    for n in counts:
        if (BATCH // n) % MICRO or BATCH % n:
            raise ConfigError(f"--num_csx {n}: the global batch {BATCH} must split into micro-batches of {MICRO}")
    result = {"benchmark": "stream", "machine": machine(), "model": MODEL, "seq": SEQ, "batch_size": BATCH,
              "micro_batch_size": MICRO, "steps": args.steps, "timed_steps": args.steps - SKIP, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "data"
        print("preprocessing the standard-library corpus ...", file=sys.stderr, flush=True)
        preprocess_text(["stdlib"], data, SEQ, samples_per_file=8192, processes=1, progress=False)
        print("reference step (single process) ...", file=sys.stderr, flush=True)
        ref_params = _params(data, Path(tmp) / "ref", 1, args.steps)
        ref_times, ref_weights = _reference(ref_params, args.steps)
        identical = True
        for n in counts:
            print(f"wse fit with num_csx={n} ...", file=sys.stderr, flush=True)
            model_dir = Path(tmp) / f"csx{n}"
            params = _params(data, model_dir, n, args.steps)
            job = Job(params)
            with open(Path(tmp) / f"fit{n}.log", "w") as out:
                job.fit(stream=out)
            plan = job.resolved.plan
            b = _breakdown(model_dir, plan)
            b.update(samples_per_s=BATCH / b["step"], ranks=plan.world_size)
            result["runs"][str(n)] = b
            got, _ = Checkpoint(model_dir).load()
            identical &= all(got[k].tobytes() == ref_weights[k].tobytes() for k in ref_weights)
        result["bit_identical_to_reference"] = identical
        print("reference step again ...", file=sys.stderr, flush=True)
        ref_seconds = statistics.median(ref_times + _reference(ref_params, args.steps)[0])
        result["reference_step_seconds"] = ref_seconds
        if 1 in counts:
            result["csx1_over_reference"] = result["runs"]["1"]["step"] / ref_seconds
        print(f"SwarmX reduce vs MPI on the ranks of num_csx={max(counts)} ...", file=sys.stderr, flush=True)
        red = _reduce_bandwidth(max(counts), sizes, args.repeats)
        result["reduce"] = {"num_csx": red["num_csx"], "fanout": red["fanout"], "ranks": red["ranks"],
                            "repeats": red["repeats"], "gb_per_s": {
                                mib: {k: float(mib) * 2**20 / v / 1e9 for k, v in t.items()}
                                for mib, t in red["seconds"].items()}, "seconds": red["seconds"]}
    return result


def report(result):
    rows = []
    for n, b in result["runs"].items():
        rows.append([n, b["ranks"], f"{b['step'] * 1e3:.0f}", f"{b['samples_per_s']:.1f}",
                     *(f"{b[k] * 1e3:.0f}" for k in ("broadcast", "compute", "reduce", "optimizer", "waiting")),
                     f"{b['bytes_per_step'] / 1e6:.1f}", f"{b['simulated']['step_s'] * 1e3:.3f}",
                     f"{b['simulated']['samples_per_s']:.0f}"])
    m = result["machine"]
    lines = [
        f"weight streaming, GPT-2 {MODEL['num_hidden_layers']} layers x {MODEL['hidden_size']}, seq {result['seq']}, "
        f"global batch {result['batch_size']}, micro-batch {result['micro_batch_size']}; median of "
        f"{result['timed_steps']} steps; {m['cpu']}, {m['cores']} cores",
        table(rows, ["num_csx", "ranks", "step ms", "samples/s", "broadcast", "compute", "reduce", "optimizer",
                     "waiting", "MB streamed", "simulated step ms", "simulated samples/s"]),
        f"single-process reference step (median of {2 * result['timed_steps']}, before and after): "
        f"{result['reference_step_seconds'] * 1e3:.0f} ms"
        + (f"; num_csx=1 / reference = {result['csx1_over_reference']:.2f} (goal <= 1.3)"
           if "csx1_over_reference" in result else ""),
        f"weights bit-identical to the reference for every num_csx: {result['bit_identical_to_reference']}",
        "",
    ]
    red = result["reduce"]
    names = ["swarmx", "mpi_reduce", "mpi_allreduce", "mpi_reduce_nb", "mpi_allreduce_nb"]
    rows = []
    for mib, g in red["gb_per_s"].items():
        rows.append([mib, *(f"{g[k]:.2f}" for k in names), f"{g['swarmx'] / g['mpi_reduce']:.2f}",
                     f"{g['swarmx'] / g['mpi_allreduce']:.2f}"])
    lines += [
        f"reduce of one buffer per CS-2 over {red['num_csx']} CS-2s ({red['ranks']} ranks, SwarmX fan-out "
        f"{red['fanout']}); GB/s of one buffer; median of {red['repeats']}; *_nb: non-blocking, waited with backoff",
        table(rows, ["MiB", "SwarmX", "MPI_Reduce", "MPI_Allreduce", "Ireduce", "Iallreduce", "vs Reduce",
                     "vs Allreduce"]),
    ]
    return "\n".join(lines)
