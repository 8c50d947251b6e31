"""The `wse` command line: one subcommand per task, each with its own --help."""
import argparse
import importlib
import importlib.metadata
import os
import sys

from data_tools import COMPRESSIONS, DEFAULT_COMPRESSION
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


class _Parser(argparse.ArgumentParser):
    """argparse's parser, answering a mistyped choice with the closest one (`wse fitt`: did you mean
    fit?) rather than the list of all. (Python 3.14's ``suggest_on_error`` does this; we support 3.10.)"""

    def _check_value(self, action, value):
        if action.choices is not None and value not in action.choices:
            from wse_core._checks import did_you_mean

            raise argparse.ArgumentError(action, f"invalid choice: {value!r} "
                                                 f"({did_you_mean(value, list(action.choices))})")


def _opt(parser, name, **kwargs):
    """Add an option under both spellings: --output_dir and --output-dir."""
    names = [name] + ([name.replace("_", "-")] if "_" in name else [])
    kwargs.setdefault("dest", name.lstrip("-"))
    parser.add_argument(*names, **kwargs)


def _job_args(parser, model_dir=True):
    """What every command that takes a training job takes: PARAMS and the overrides of its runconfig."""
    parser.add_argument("params", metavar="PARAMS", help="params YAML file")
    _opt(parser, "--num_csx", type=int, metavar="N", help="override runconfig.num_csx")
    _opt(parser, "--execution_strategy", choices=["weight_streaming", "pipeline", "auto"],
         help="override runconfig.execution_strategy")
    if model_dir:
        _opt(parser, "--model_dir", metavar="DIR", help="override runconfig.model_dir")
    parser.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a params value (repeatable)")


def _print_json_or_lines(obj, as_json):
    import json

    if as_json:
        print(json.dumps(obj, indent=2))
    else:
        width = max(map(len, obj), default=0) + 1
        for key, value in obj.items():
            print(f"{key:<{width}} {value}")


def _cmd_data_preprocess(args):
    from data_tools.preprocess import preprocess_arrays, preprocess_text

    if args.format == "arrays":
        if len(args.input) != 1:
            raise ValueError("--format arrays: expected one --input FILE.npz")
        params = preprocess_arrays(args.input[0], args.output_dir, samples_per_file=args.samples_per_file,
                                   compression=args.compression, overwrite=args.overwrite)
    else:
        if args.max_seq_length is None:
            raise ValueError("--max_seq_length: required for text inputs")
        params = preprocess_text(args.input, args.output_dir, args.max_seq_length, tokenizer=args.tokenizer,
                                 samples_per_file=args.samples_per_file, processes=args.processes,
                                 seed=args.seed, jsonl_key=args.jsonl_key, compression=args.compression,
                                 overwrite=args.overwrite)
    summary = f"wrote {params['n_examples']:,} examples in {len(params['files'])} files to {args.output_dir}"
    if params["format"] == "lm":
        summary += (f" ({params['n_tokens']:,} tokens, {params['input_bytes'] / 1e6:.1f} MB in "
                    f"{params['seconds']:.1f} s = {params['input_bytes'] / 1e6 / params['seconds']:.2f} MB/s)")
    print(summary)
    return 0


def _cmd_data_inspect(args):
    from data_tools.dataset import inspect_dataset

    _print_json_or_lines(inspect_dataset(args.dir), args.json)
    return 0


def _cmd_data_verify(args):
    from data_tools.lmdata import verify_dataset

    s = verify_dataset(args.dir)
    print(f"{args.dir}: ok ({s['format']}, {s['files']} files, {s['n_examples']:,} examples)")
    return 0


def _cmd_checkpoint_info(args):
    from data_tools.checkpoint import Checkpoint

    info = Checkpoint(args.path).info()
    if not args.json:
        info["shards"] = ", ".join(f"{s['name']} ({s['parameters']:,} params, {s['bytes']:,} B)"
                                   for s in info["shards"])
        info["params_yaml"] = f"{len(info['params_yaml'].splitlines())} lines"
        if info["numerics"]:
            from wse_core.numerics import describe

            info["numerics"] = describe(info["numerics"])
    _print_json_or_lines(info, args.json)
    return 0


def _cmd_checkpoint_verify(args):
    from data_tools.checkpoint import Checkpoint

    ckpt = Checkpoint(args.path)
    ckpt.verify()
    print(f"{ckpt.dir}: ok (step {ckpt.step}, {ckpt.num_shards} shards, {len(ckpt.tensors)} tensors)")
    return 0


def _cmd_checkpoint_convert(args):
    from data_tools.checkpoint import Checkpoint

    out = Checkpoint(args.path).convert(args.to, args.output)
    print(f"wrote {out}")
    return 0


def _cmd_params_convert(args):
    import yaml

    from pyapi import modelzoo
    from pyapi.params import read

    raw = read(args.params)
    if modelzoo.is_trainer_layout(raw):
        out, dropped = modelzoo.flatten(raw)
        if dropped:
            raise ValueError(f"{args.params}: keys with no place in the flat layout: {', '.join(dropped)}")
        layout = "flat (train_input, model, optimizer, runconfig)"
    else:
        out, dropped = modelzoo.to_trainer(raw)
        if dropped:
            print(f"wse params convert: dropped (no place in the trainer layout): {', '.join(dropped)}",
                  file=sys.stderr)
        layout = "trainer (trainer.init, trainer.fit)"
    text = yaml.safe_dump(out, sort_keys=False)
    if args.output:
        from pathlib import Path

        Path(args.output).write_text(text)
        print(f"wrote {args.output} ({layout} layout)")
    else:
        sys.stdout.write(text)
    return 0


def _cmd_params_keys(args):
    import json
    import warnings

    from pyapi.params import ParamsError, check, read

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            _, report = check(read(args.params), args.params, args.set)
            error = None
        except ParamsError as exc:
            if exc.report is None:
                raise
            report, error = exc.report, exc
    if args.json:
        print(json.dumps({"fates": report.fates, "notes": report.notes}, indent=2))
    else:
        width = max(map(len, report.fates), default=0) + 1
        for path, fate in report.fates.items():
            print(f"{path:<{width}} {fate}")
        for note in report.notes:
            print(f"note: {note}")
        counts = {}
        for fate in report.fates.values():
            kind = fate.split(":")[0].split(" (")[0].split(" of ")[0]
            counts[kind] = counts.get(kind, 0) + 1
        print("; ".join(f"{n} {kind}" for kind, n in counts.items()))
    return 1 if error else 0


def _cmd_checkpoint_from_hf(args):
    import yaml

    from data_tools.checkpoint import from_hf

    path, model = from_hf(args.path, args.output)
    print(f"wrote {path} (step 0, weights only: the optimizer starts fresh)")
    print("a run starts from it with `wse fit PARAMS --checkpoint_path " f"{path}` and this model section in PARAMS:")
    print(yaml.safe_dump({"model": model}, sort_keys=False), end="")
    return 0


def _load_params(args):
    from pyapi import params

    return params.load(args.params, _overrides(args))


def _overrides(args):
    """--set, plus the options that are shorthands for a runconfig key."""
    overrides = list(args.set or [])
    for key in ("num_csx", "execution_strategy"):
        if getattr(args, key, None) is not None:
            overrides.append(f"runconfig.{key}={getattr(args, key)}")
    return overrides


def _cmd_compile(args):
    import json

    from mpi_launch.plan import describe

    d = describe(_load_params(args))
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    plan, mem = d["plan"], d["memory_bytes"]
    m = d["model"]
    print(f"model {m['name']}: {m['parameters']:,} parameters in {len(m['units'])} streaming units")
    print(f"cluster: {plan['num_csx']} CS-2, {plan['num_wgt_servers']} MemoryX, {len(plan['swarmx'])} SwarmX "
          f"(fan-out {plan['swarmx_fanout']}), {plan['num_workers_per_csx']} input worker(s) per CS-2: "
          f"{plan['world_size']} MPI ranks")
    for rank, role in enumerate(plan["roles"]):
        detail = ""
        if role == "memoryx":
            k = plan["memoryx"].index(rank)
            units = [m["units"][u] for u, o in enumerate(plan["unit_owner"]) if o == k]
            detail = f"owns {units[0]}..{units[-1]} ({len(units)} units)"
        elif role == "swarmx":
            detail = f"children {plan['children'][str(rank)]}" + (" (root)" if rank == plan["swarmx"][0] else "")
        elif role == "csx":
            detail = f"{d['micro_batches_per_csx']} micro-batches per step"
        print(f"  rank {rank:>3}  {role:<11} {mem[str(rank)] / 2**20:9.1f} MiB  {detail}")
    sim, wafer = d["simulated"], d["wafer_bytes"]
    print(f"simulated step, weight streaming (a model of the hardware, wse_core.perf; {sim['detail']['precision']}, "
          f"{sim['detail']['io_gbps']:g} Gb/s per CS-2): {sim['step_s'] * 1e3:.3f} ms, "
          f"{sim['samples_per_s']:.1f} samples/s")
    print(f"  compute {sim['compute_s'] * 1e3:.3f} ms, waiting for weights {sim['exposed_stream_s'] * 1e3:.3f} ms "
          f"(their bytes alone, and the gradients', take {sim['stream_s'] * 1e3:.3f} ms of the CS-2's I/O), "
          f"reduce tail {sim['reduce_tail_s'] * 1e3:.3f} ms, MemoryX update {sim['optimizer_s'] * 1e3:.3f} ms")
    print(f"  wafer memory per CS-2: activations {wafer['activations'] / 2**20:.1f} MiB, weights in flight "
          f"{wafer['weights_in_flight'] / 2**20:.1f} MiB, of {wafer['capacity'] / 2**30:.1f} GiB of SRAM")
    exact = "yes" if d["bit_identical_to_reference"] else "no (num_csx and swarmx_fanout must be powers of two)"
    print(f"bit-identical to the single-process reference: {exact}")
    pl = d["pipeline"]
    print(f"pipelined on one CS-2: {pl['why']}")
    if pl["fits"]:
        print(f"  step {pl['step_s'] * 1e3:.3f} ms for {pl['micro_batches']} micro-batches of {pl['micro_batch_size']} "
              f"through {len(pl['regions'])} stages (slowest {pl['slowest_stage_s'] * 1e3:.3f} ms), update "
              f"{pl['update_s'] * 1e3:.3f} ms")
        print(f"  {'layer':<12} {'columns':>9} {'PEs':>9} {'parameters':>13} {'need MiB':>10} {'usable MiB':>10} "
              f"{'stage ms':>9}")
        for r in pl["regions"]:
            cols = f"{r['columns'][0]}-{r['columns'][1] - 1}"
            print(f"  {r['name']:<12} {cols:>9} {r['pes']:>9,} {r['params']:>13,} {r['need_bytes'] / 2**20:>10.1f} "
                  f"{r['capacity_bytes'] / 2**20:>10.1f} {r['stage_s'] * 1e3:>9.3f}")
    print(f"execution strategy: {d['why']}")
    if args.plot:
        from wse_core.perf.pipeline import plot_placement

        plot_placement(pl, args.plot)
        print(f"wrote {args.plot}")
    return 0


def _cmd_fit(args):
    from pathlib import Path

    from mpi_launch.watchdog import JobInterrupted
    from pyapi.job import Job, JobError

    job = Job.from_yaml(args.params, model_dir=args.model_dir, overrides=_overrides(args))
    if args.dry_run:
        print(" ".join(job.command(checkpoint_path=args.checkpoint_path, hostfile=args.hostfile)))
        return 0
    try:
        result = job.fit(checkpoint_path=args.checkpoint_path, hostfile=args.hostfile)
    except JobError as exc:
        print(f"wse fit: {exc}", file=sys.stderr)
        return 1
    except JobInterrupted as exc:
        from data_tools.checkpoint import LATEST

        latest = job.model_dir / LATEST
        kept = f"; the latest checkpoint is {latest.read_text().strip()}" if latest.is_file() else ""
        print(f"wse fit: interrupted by {exc}: the job's ranks were stopped{kept}", file=sys.stderr)
        return 128 + exc.signal
    if result.steps_trained:
        resumed = f" from {Path(result.checkpoint).name}" if result.checkpoint else ""
        print(f"done: trained steps {result.start_step + 1}..{result.end_step}{resumed} "
              f"({result.steps_trained} steps); outputs in {result.model_dir} "
              "(metrics.jsonl, plan.json, logs/, checkpoint_*/)")
    return 0


def _cmd_appliance_start(args):
    from pyapi.appliance.client import default_state_dir

    state_dir = args.state_dir or default_state_dir()
    if args.foreground:
        from pyapi.appliance.service import Service

        service = Service(state_dir, args.socket, args.num_csx)
        print(f"appliance: pid {os.getpid()}, {args.num_csx} CS-2s, socket {service.socket_path}", flush=True)
        service.serve()
        return 0
    from pyapi.appliance.service import start_background

    pid, sock = start_background(state_dir, args.socket, args.num_csx)
    print(f"appliance started: pid {pid}, {args.num_csx} CS-2s, socket {sock}, state in {state_dir}")
    if args.socket or state_dir != default_state_dir():
        print(f"  (other commands find it with --socket {sock} or WSE_APPLIANCE_SOCKET={sock})")
    return 0


def _cmd_appliance_stop(args):
    import time

    from pyapi.appliance.client import ApplianceError, Client
    from pyapi.appliance.manager import GRACE_SECONDS

    client = Client(args.socket)
    reply = client.stop()
    deadline = time.monotonic() + GRACE_SECONDS + 30
    while time.monotonic() < deadline:  # until the service has ended its jobs' ranks and exited
        try:
            if open(f"/proc/{reply['pid']}/stat").read().rsplit(")", 1)[1].split()[0] in "ZX":
                break  # exited, not yet reaped by its parent
        except OSError:
            break
        time.sleep(0.2)
    else:
        raise ApplianceError(f"the appliance (pid {reply['pid']}) is still stopping after "
                             f"{GRACE_SECONDS + 30:g} s")
    kept = f"; {reply['running']} running job(s) interrupted, resumed at its next start" if reply["running"] else ""
    print(f"appliance stopped (pid {reply['pid']}){kept}")
    return 0


def _cmd_appliance_status(args):
    from pyapi.appliance.client import Client

    _print_json_or_lines(Client(args.socket).status(), args.json)
    return 0


def _cmd_submit(args):
    from pyapi.job import Job

    job = Job.from_yaml(args.params, model_dir=args.model_dir, overrides=_overrides(args))
    if args.slurm:
        from pyapi.appliance import slurm

        for flag, given in (("--priority", args.priority), ("--follow", args.follow), ("--socket", args.socket)):
            if given:
                raise ValueError(f"{flag}: not with --slurm (Slurm orders its queue by its own policy; "
                                 "`wse logs --slurm JOB` prints the output)")
        job_id, script = slurm.submit(job, max_restarts=args.max_restarts, name=args.name)
        print(f"submitted Slurm job {job_id} ({job.params.runconfig.num_csx} CS-2s, model_dir {job.model_dir}); "
              f"script {script}")
        return 0
    handle = job.submit(max_restarts=args.max_restarts, priority=args.priority, name=args.name, socket=args.socket)
    st = handle.status()
    print(f"job {handle.id}: {st['state']} ({st['num_csx']} CS-2s, model_dir {handle.model_dir}); "
          f"follow it with `wse logs {handle.id} -f`")
    if args.follow:
        return _follow(handle.client, handle.id)
    return 0


#: A job's log is its user's text: shown without the control characters that could drive a terminal.
_UNPRINTABLE = {c: None for c in range(32) if chr(c) not in "\n\t"} | {0x7f: None}


def _follow(client, job_id):
    for piece in client.logs(job_id, follow=True):
        sys.stdout.write(piece.translate(_UNPRINTABLE))
        sys.stdout.flush()
    job = client.job(job_id)
    print(f"job {job_id}: {job['state']}" + (f": {job['reason']}" if job["state"] != "done" and job["reason"] else ""),
          file=sys.stderr)
    return 0 if job["state"] == "done" else 1


def _fmt(x, spec, empty="-"):
    return empty if x is None else format(x, spec)


def _cmd_jobs(args):
    import json

    if args.slurm:
        from pyapi.appliance import slurm

        jobs = slurm.jobs()
    else:
        from pyapi.appliance.client import Client

        jobs = Client(args.socket).jobs()
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    if not jobs:
        print("no jobs")
        return 0
    print(f"{'ID':>5}  {'STATE':<10} {'USER':<10} {'CS-2':>4} {'STEP':>9} {'LOSS':>8} {'SIM ms':>8} {'WALL s':>8} "
          f"{'RESTARTS':>8}  NAME")
    for j in jobs:
        step = f"{j['step']}/{j['max_steps']}" if j.get("max_steps") else _fmt(j.get("step"), "")
        print(f"{j['id']:>5}  {j['state']:<10} {j['user']:<10} {_fmt(j['num_csx'], '>4')} {step:>9} "
              f"{_fmt(j.get('loss'), '8.4f'):>8} {_fmt(j.get('sim_seconds') and j['sim_seconds'] * 1e3, '8.4g'):>8} "
              f"{_fmt(j.get('wall_seconds'), '8.1f'):>8} {_fmt(j.get('restarts'), '>8')}  {j['name']}")
        if j.get("reason") and j["state"] in ("failed", "cancelled", "queued"):
            print(f"{'':>7}{j['reason']}")
    return 0


def _cmd_logs(args):
    if args.slurm:
        from pyapi.appliance import slurm

        sys.stdout.write(slurm.logs(args.job))
        return 0
    from pyapi.appliance.client import Client

    client = Client(args.socket)
    if args.follow:
        return _follow(client, args.job)
    for piece in client.logs(args.job):
        sys.stdout.write(piece.translate(_UNPRINTABLE))
    return 0


def _cmd_cancel(args):
    if args.slurm:
        from pyapi.appliance import slurm

        slurm.cancel(args.job)
        print(f"Slurm job {args.job}: cancel sent (scancel)")
        return 0
    from pyapi.appliance.client import Client

    job = Client(args.socket).cancel(args.job)
    print(f"job {args.job}: " + ("cancelled" if job["state"] == "cancelled" else
                                 "cancelling (its ranks are being stopped)"))
    return 0


def _cmd_validate(args):
    import json

    from pyapi.job import Job

    job = Job.from_yaml(args.params, model_dir=args.model_dir, overrides=args.set)
    r = job.validate(checkpoint_path=args.checkpoint_path, batches=args.eval_steps)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"eval loss {r['eval_loss']:.4f} (perplexity {r['perplexity']:.2f}, accuracy {r['accuracy']:.4f}) on "
              f"{r['examples']:,} examples, {r['tokens']:,} tokens; checkpoint of step {r['step']}: {r['checkpoint']}")
    return 0


def _cmd_fabric_run(args):
    import json
    import time

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
        _print_json_or_lines(report, False)
    return 0


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


def build_parser(argv=()):
    """The argument parser for ``argv``: the modules behind long help texts and benchmark options are
    imported only for the subcommand ``argv`` names, so ``wse --help`` stays quick."""
    chosen = tuple(argv[:2])
    from bench import BENCHMARKS

    parser = _Parser(
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

    p = sub.add_parser("fit", help="train on an emulated cluster, weight streaming or pipelined (starts mpiexec)",
                       description="Validate PARAMS, lay out the cluster (coordinator, MemoryX, SwarmX, CS-2s, "
                                   "input workers; or one pipelined CS-2) and train. Resumes from "
                                   "MODEL_DIR/latest if there is one.")
    _job_args(p)
    _opt(p, "--checkpoint_path", metavar="PATH", help="resume from this checkpoint")
    p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true", help="print the mpiexec command only")
    p.add_argument("--hostfile", metavar="FILE", help="hosts for mpiexec (one per line)")
    p.set_defaults(func=_cmd_fit)

    p = sub.add_parser("appliance", help="a service owning a pool of CS-2s that queues and runs users' jobs",
                       description="The appliance: a long-running service owning a pool of emulated CS-2s. Users "
                                   "queue jobs on it with `wse submit`, and list, follow and cancel them with "
                                   "`wse jobs`, `wse logs`, `wse cancel`; each sees only their own jobs.")
    ap_sub = p.add_subparsers(dest="appliance_command", metavar="ACTION", required=True)
    socket_help = ("the appliance's socket (default: $WSE_APPLIANCE_SOCKET, else this user's own appliance, else "
                   "/var/lib/wse-appliance/appliance.sock)")
    ap = ap_sub.add_parser("start", help="start the service (in the background unless --foreground)")
    _opt(ap, "--num_csx", type=int, default=4, metavar="N", help="CS-2s in the pool (default 4)")
    ap.add_argument("--socket", metavar="PATH", help="where it listens (default: STATE_DIR/appliance.sock)")
    _opt(ap, "--state_dir", metavar="DIR", help="its job records and logs (default: /var/lib/wse-appliance "
                                                "for root, ~/.local/state/wse-appliance for others)")
    ap.add_argument("--foreground", action="store_true", help="run in this process (for systemd and the like)")
    ap.set_defaults(func=_cmd_appliance_start)
    for name, func, text in (("stop", _cmd_appliance_stop, "stop the service; running jobs resume at its next "
                                                           "start"),
                             ("status", _cmd_appliance_status, "the pool: CS-2s free, jobs queued and running")):
        ap = ap_sub.add_parser(name, help=text)
        ap.add_argument("--socket", metavar="PATH", help=socket_help)
        if name == "status":
            ap.add_argument("--json", action="store_true", help="print JSON")
        ap.set_defaults(func=func)

    p = sub.add_parser("submit", help="queue a training job on the appliance (or on Slurm with --slurm)",
                       description="Validate PARAMS, check its data as you, and queue it on the appliance; print "
                                   "the job id at once. The job waits until its CS-2s are free, runs as you, "
                                   "resumes from MODEL_DIR/latest, and is restarted from its latest checkpoint "
                                   "after a fault up to --max_restarts times.")
    _job_args(p)
    _opt(p, "--max_restarts", type=int, default=0, metavar="R", help="restarts after a fault (default 0)")
    p.add_argument("--priority", type=int, default=0, metavar="P",
                   help="higher runs first; first come, first served within a priority (default 0)")
    p.add_argument("--name", help="the job's name in `wse jobs` (default: model_dir's name)")
    p.add_argument("-f", "--follow", action="store_true", help="then follow its log until it ends")
    p.add_argument("--slurm", action="store_true", help="submit to Slurm with sbatch instead (one task per rank)")
    p.add_argument("--socket", metavar="PATH", help=socket_help)
    p.set_defaults(func=_cmd_submit)

    p = sub.add_parser("jobs", help="your jobs on the appliance: state, CS-2s, step, loss, simulated and wall time")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--slurm", action="store_true", help="your wse jobs on Slurm (squeue and sacct)")
    p.add_argument("--socket", metavar="PATH", help=socket_help)
    p.set_defaults(func=_cmd_jobs)
    p = sub.add_parser("logs", help="a job's log; -f follows it until the job ends")
    p.add_argument("job", type=int, metavar="JOB")
    p.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    p.add_argument("--slurm", action="store_true", help="JOB is a Slurm job id")
    p.add_argument("--socket", metavar="PATH", help=socket_help)
    p.set_defaults(func=_cmd_logs)
    p = sub.add_parser("cancel", help="cancel a queued job, or stop a running one cleanly")
    p.add_argument("job", type=int, metavar="JOB")
    p.add_argument("--slurm", action="store_true", help="JOB is a Slurm job id (scancel)")
    p.add_argument("--socket", metavar="PATH", help=socket_help)
    p.set_defaults(func=_cmd_cancel)

    p = sub.add_parser("validate", help="eval loss of a checkpoint on eval_input (no mpiexec)",
                       description="Load a checkpoint (default: MODEL_DIR/latest) and compute the model's loss "
                                   "on every example of eval_input.data_dir, in order, in this process.")
    p.add_argument("params", metavar="PARAMS", help="params YAML file (with an eval_input section)")
    _opt(p, "--model_dir", metavar="DIR", help="override runconfig.model_dir")
    _opt(p, "--checkpoint_path", metavar="PATH", help="checkpoint to evaluate (default: MODEL_DIR/latest)")
    _opt(p, "--eval_steps", type=int, metavar="K", help="evaluate only the first K batches of eval_input")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a params value (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_validate)

    p = sub.add_parser("params", help="read Model Zoo params files: each key's fate, and the other layout",
                       description="Model Zoo's two params layouts (flat: train_input/model/optimizer/runconfig; "
                                   "trainer: trainer.init/trainer.fit) and what wse-cluster does with each key.")
    pa_sub = p.add_subparsers(dest="params_command", metavar="ACTION", required=True)
    pp = pa_sub.add_parser("convert", help="write PARAMS in the other layout (flat <-> trainer)")
    pp.add_argument("params", metavar="PARAMS", help="params YAML file")
    pp.add_argument("-o", "--output", metavar="FILE", help="write here (default: standard output)")
    pp.set_defaults(func=_cmd_params_convert)
    pp = pa_sub.add_parser("keys", help="the fate of every key: honoured, tuning (warned) or refused",
                           description="Print each key of PARAMS with its fate; exit 1 if any is refused.")
    pp.add_argument("params", metavar="PARAMS", help="params YAML file")
    pp.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a params value (repeatable)")
    pp.add_argument("--json", action="store_true", help="print JSON")
    pp.set_defaults(func=_cmd_params_keys)

    p = sub.add_parser("compile", help="print the rank plan and per-rank memory of a params file (no training)",
                       description="Validate PARAMS and print the rank plan: roles, MemoryX layer ownership, "
                                   "the SwarmX tree and estimated memory per rank. Nothing is launched.")
    _job_args(p, model_dir=False)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", metavar="PNG", help="draw the pipelined placement on the wafer (needs matplotlib)")
    p.set_defaults(func=_cmd_compile)

    p = sub.add_parser("data", help="prepare, inspect and verify HDF5 datasets",
                       description="Prepare, inspect and verify HDF5 datasets (Model Zoo LMData layout).")
    data_sub = p.add_subparsers(dest="data_command", metavar="ACTION", required=True)
    dp = data_sub.add_parser("preprocess", help="tokenize text (or arrays) into HDF5 shards",
                             description=(importlib.import_module("data_tools.preprocess").__doc__
                                          if chosen == ("data", "preprocess") else None),
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    dp.add_argument("--input", nargs="+", required=True, metavar="PATH",
                    help="files (.txt, .jsonl), directories, globs, or 'stdlib'; with --format arrays one .npz")
    _opt(dp, "--output_dir", required=True, metavar="DIR", help="where the .h5 files and data_params.json go")
    _opt(dp, "--max_seq_length", type=int, metavar="S", help="tokens per example (text inputs)")
    dp.add_argument("--tokenizer", default="byte", help="'byte' (default) or a Hugging Face tokenizer.json")
    _opt(dp, "--samples_per_file", type=int, metavar="K",
         help="examples per .h5 file (default: about 64 MiB of examples per file)")
    dp.add_argument("--processes", type=int, default=1, metavar="P", help="tokenize with P processes")
    dp.add_argument("--seed", type=int, help="shuffle the examples with this seed (default: keep order)")
    _opt(dp, "--jsonl_key", default="text", help="field of the .jsonl records holding the text")
    dp.add_argument("--compression", default=DEFAULT_COMPRESSION, choices=list(COMPRESSIONS),
                    help=f"HDF5 compression of the examples (default {DEFAULT_COMPRESSION}: fastest to write and read, "
                    "see `wse bench input`)")
    dp.add_argument("--format", default="text", choices=["text", "arrays"])
    dp.add_argument("--overwrite", action="store_true", help="replace a dataset already in --output_dir")
    dp.set_defaults(func=_cmd_data_preprocess)
    dp = data_sub.add_parser("inspect", help="files, examples, tokens, vocabulary, one decoded example")
    dp.add_argument("dir", metavar="DIR")
    dp.add_argument("--json", action="store_true", help="print JSON")
    dp.set_defaults(func=_cmd_data_inspect)
    dp = data_sub.add_parser("verify", help="check every file; exit 1 naming the first fault")
    dp.add_argument("dir", metavar="DIR")
    dp.set_defaults(func=_cmd_data_verify)

    p = sub.add_parser("checkpoint", help="inspect, verify and convert checkpoints",
                       description="Inspect, verify and convert checkpoints (a model_dir, a checkpoint "
                                   "directory or its index.h5).")
    ck_sub = p.add_subparsers(dest="checkpoint_command", metavar="ACTION", required=True)
    cp = ck_sub.add_parser("info", help="step, shards, tensors, loader position")
    cp.add_argument("path", metavar="PATH")
    cp.add_argument("--json", action="store_true", help="print JSON")
    cp.set_defaults(func=_cmd_checkpoint_info)
    cp = ck_sub.add_parser("verify", help="check SHA-256 of every shard; exit 1 naming the damaged tensor")
    cp.add_argument("path", metavar="PATH")
    cp.set_defaults(func=_cmd_checkpoint_verify)
    cp = ck_sub.add_parser("convert", help="write the weights as npz, h5, a torch state_dict or a Hugging Face "
                                           "directory")
    cp.add_argument("path", metavar="PATH")
    cp.add_argument("--to", required=True, choices=["npz", "h5", "torch", "hf"],
                    help="hf: a directory with config.json and model.safetensors (GPT2LMHeadModel, LlamaForCausalLM) "
                         "and the training data's tokenizer (AutoTokenizer)")
    cp.add_argument("--output", required=True, metavar="FILE")
    cp.set_defaults(func=_cmd_checkpoint_convert)
    cp = ck_sub.add_parser("from-hf", help="a checkpoint a run can start from, from a Hugging Face model directory",
                           description="Read DIR (config.json, *.safetensors of a GPT2LMHeadModel or "
                                       "LlamaForCausalLM) and write a step-0, weights-only checkpoint into "
                                       "--output (a model_dir); print the model section a run on it needs.")
    cp.add_argument("path", metavar="DIR")
    cp.add_argument("--output", required=True, metavar="MODEL_DIR")
    cp.set_defaults(func=_cmd_checkpoint_from_hf)

    p = sub.add_parser("fabric", help="run a reference program on the simulated PE mesh",
                       description="Dataflow PE-mesh simulator: run a reference program, check it against numpy, "
                                   "report cycles and per-PE activity.")
    fab_sub = p.add_subparsers(dest="fabric_command", metavar="ACTION", required=True)
    if chosen[:1] == ("fabric",):  # the programs' registry loads numpy: only for the command that uses it
        # As for a benchmark below, the process is set up before the registry loads numpy.
        from wse_core import configure_process
        from wse_core.fabric.programs import PROGRAMS, options

        configure_process()
        fp = fab_sub.add_parser("run", help=f"run KERNEL ({', '.join(PROGRAMS)}); report its error and cycles")
        fp.add_argument("kernel", metavar="KERNEL", choices=list(PROGRAMS))
        fp.add_argument("--width", type=int, default=16, help="PEs along x")
        fp.add_argument("--height", type=int, default=16, help="PEs along y")
        for flag, (kind, default, text) in options().items():
            fp.add_argument(f"--{flag}", type=kind, default=default, help=text)
        fp.add_argument("--seed", type=int, default=0, help="seed of the random input")
        fp.add_argument("--json", action="store_true", help="print JSON")
        fp.add_argument("--heatmap", metavar="FILE", help="write a PNG of per-PE activity (needs matplotlib)")
        fp.set_defaults(func=_cmd_fabric_run)

    p = sub.add_parser("bench", help="run a benchmark against a baseline measured in the same run",
                       description="Run a benchmark; print its table and optionally write JSON.")
    bench_sub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for name, (module_name, summary) in BENCHMARKS.items():
        if chosen != ("bench", name):  # only the chosen benchmark is imported, for its own options
            bench_sub.add_parser(name, help=summary, description=summary)
            continue
        # A benchmark module loads the kernels as it is imported (here, for its options), so the process
        # is set up first; _main's call, which every other subcommand gets before it runs, is then a no-op.
        from wse_core import configure_process

        configure_process()
        module = importlib.import_module(module_name)
        bp = bench_sub.add_parser(name, help=summary, description=module.__doc__,
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
        bp.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH ('-' for stdout)")
        module.add_arguments(bp)
        bp.set_defaults(func=_cmd_bench, bench_module=module_name)
    return parser


def main(argv=None):
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


def _stdout_gone():
    """Whether standard output's reader has gone: a pipe's reader closed it (POLLERR), a socket's
    peer shut it (POLLHUP)."""
    import select

    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), 0)
        return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))
    except (OSError, ValueError, AttributeError):  # no fileno, or no poll on this platform
        return False


def _main(argv):
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    import warnings

    from data_tools.errors import DataWarning
    from pyapi.modelzoo import ParamsWarning

    default_show = warnings.showwarning

    def show(message, category, *rest, **kwargs):  # our warnings are one line, as errors are
        if issubclass(category, (ParamsWarning, DataWarning)):
            print(f"wse {args.command}: warning: {message}", file=sys.stderr)
        else:
            default_show(message, category, *rest, **kwargs)

    warnings.showwarning = show
    from pyapi.appliance.client import ApplianceError
    from pyapi.job import JobError

    try:
        from wse_core import configure_process

        configure_process()
        return args.func(args)
    except (ValueError, TypeError, OSError, MPILaunchError, ApplianceError, JobError) as exc:
        # User-facing failures are one line; WSE_DEBUG=1 shows the traceback behind it.
        if os.environ.get("WSE_DEBUG") or (isinstance(exc, BrokenPipeError) and _stdout_gone()):
            raise  # main() ends quietly when the reader of our output left
        print(f"wse {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"wse {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
