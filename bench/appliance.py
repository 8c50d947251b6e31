"""The appliance against `wse fit`: the same jobs queued on a CS-2 pool, and run one after another directly.

    wse bench appliance [--json PATH] [--jobs 4] [--num_csx 2] [--pool 4] [--steps 60]

``--jobs`` small GPT-2 jobs of ``--num_csx`` CS-2s each (identical params, each its own model_dir).
Baseline, in the same run: the jobs one after another with ``wse fit``. Then an appliance with
``--pool`` CS-2s is started, every job submitted with ``wse submit`` at once, and the service is
waited on until all have ended. Reported: the makespan of each way and their ratio, with how busy
one job at a time keeps the cores (what it leaves idle is what jobs side by side can use); each
job's time from its start to its end under both (side by side, each takes longer, while the
makespan is what a user waits for); how long ``wse submit`` and ``Job.submit()`` take to return;
the queue waits; and whether every job's weights equal the direct run's bit for bit.
"""
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.harness import machine, table
from wse_core.errors import JobError


def add_arguments(parser):
    parser.add_argument("--jobs", type=int, default=4, help="jobs to run (default 4)")
    parser.add_argument("--num_csx", type=int, default=2, help="CS-2s per job (default 2)")
    parser.add_argument("--pool", type=int, default=4, help="CS-2s of the appliance (default 4)")
    parser.add_argument("--steps", type=int, default=60, help="training steps of each job (default 60)")


def _params(path, data, model_dir, args):
    import yaml

    p = {"train_input": {"data_dir": str(data), "batch_size": 16, "micro_batch_size": 4, "shuffle": True},
         "model": {"name": "gpt2", "vocab_size": 257, "hidden_size": 64, "num_hidden_layers": 2, "num_heads": 4,
                   "max_position_embeddings": 64},
         "optimizer": {"optimizer_type": "AdamW", "learning_rate": 1e-3},
         "runconfig": {"max_steps": args.steps, "num_csx": args.num_csx, "num_wgt_servers": 1,
                       "checkpoint_steps": args.steps, "log_steps": args.steps, "model_dir": str(model_dir)}}
    path.write_text(yaml.safe_dump(p))
    return path


def _wse(*argv):
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pyapi.cli", *map(str, argv)], capture_output=True, text=True)
    if r.returncode != 0:
        raise JobError(f"wse {' '.join(map(str, argv))}: {(r.stderr.strip().splitlines() or ['failed'])[-1]}")
    return r.stdout, time.perf_counter() - t0


def _children_cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _weights(model_dir):
    from data_tools.checkpoint import Checkpoint

    return {n: a.tobytes() for n, a in Checkpoint(model_dir).load()[0].items()}


def run(args):
    from data_tools.preprocess import preprocess_text
    from pyapi.client import Client
    from pyapi.job import Job

    with tempfile.TemporaryDirectory(prefix="wse-bench-appliance-") as work:
        work = Path(work)
        data = work / "data"
        preprocess_text(["stdlib"], data, 64, samples_per_file=4000, progress=False)

        direct, t0 = [], time.perf_counter()
        cpu0 = _children_cpu()
        for i in range(args.jobs):
            _, seconds = _wse("fit", _params(work / f"d{i}.yaml", data, work / f"d{i}", args))
            direct.append(seconds)
        direct_makespan = time.perf_counter() - t0
        # CPU time of `wse fit` and all it waited for (mpiexec, its proxies, the ranks): how busy the
        # cores were while one job ran at a time.
        busy = (_children_cpu() - cpu0) / (direct_makespan * (os.cpu_count() or 1))
        reference = _weights(work / "d0")

        sock = work / "appliance.sock"
        _wse("appliance", "start", "--num_csx", args.pool, "--state_dir", work / "state", "--socket", sock)
        client = Client(sock)
        try:
            t0 = time.perf_counter()
            ids, submit_s = [], []
            for i in range(args.jobs - 1):
                out, seconds = _wse("submit", _params(work / f"a{i}.yaml", data, work / f"a{i}", args),
                                    "--socket", sock)
                ids.append(int(out.split(":")[0].split()[1]))
                submit_s.append(seconds)
            t1 = time.perf_counter()  # and one from Python, in this process
            handle = Job.from_yaml(_params(work / "py.yaml", data, work / f"a{args.jobs - 1}", args)).submit(
                socket=sock)
            api_submit_s = time.perf_counter() - t1
            ids.append(handle.id)
            records = [client.wait(i) for i in ids]
            appliance_makespan = time.perf_counter() - t0
        finally:
            client.stop()
        identical = all(_weights(work / f"a{i}") == reference for i in range(args.jobs))
        identical &= all(_weights(work / f"d{i}") == reference for i in range(args.jobs))
    return {
        "machine": machine(), "jobs": args.jobs, "num_csx": args.num_csx, "pool": args.pool, "steps": args.steps,
        "direct_job_seconds": direct, "direct_makespan_s": direct_makespan, "direct_cores_busy": busy,
        "appliance_makespan_s": appliance_makespan, "makespan_ratio": direct_makespan / appliance_makespan,
        "appliance_job_seconds": [r["ended"] - r["started"] for r in records],
        "queue_wait_seconds": [r["started"] - r["submitted"] for r in records],
        "states": [r["state"] for r in records],
        "wse_submit_seconds_median": statistics.median(submit_s) if submit_s else None,
        "job_submit_seconds": api_submit_s, "bit_identical": identical,
    }


def report(r):
    med = statistics.median
    rows = [["one after another (wse fit)", f"{r['direct_makespan_s']:.1f}", f"{med(r['direct_job_seconds']):.1f}",
             "-"],
            [f"appliance, pool of {r['pool']}", f"{r['appliance_makespan_s']:.1f}",
             f"{med(r['appliance_job_seconds']):.1f}", f"{med(r['queue_wait_seconds']):.1f}"]]
    submit = r["wse_submit_seconds_median"]
    return "\n".join([
        f"{r['jobs']} jobs of {r['num_csx']} CS-2s, {r['steps']} steps each, on {r['machine']['cores']} cores",
        table(rows, ["", "all done after s", "a job's run s (median)", "queue wait s (median)"]),
        f"makespan, direct / appliance: {r['makespan_ratio']:.2f}x (one job at a time kept the cores "
        f"{r['direct_cores_busy']:.0%} busy)",
        f"`wse submit` returns in {submit:.2f} s (median; a new Python process), Job.submit() in "
        f"{r['job_submit_seconds']:.2f} s" if submit is not None else
        f"Job.submit() returns in {r['job_submit_seconds']:.2f} s",
        f"states: {', '.join(r['states'])}; weights bit-identical to the direct runs: "
        f"{'yes' if r['bit_identical'] else 'NO'}"])
