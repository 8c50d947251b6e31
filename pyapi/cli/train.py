"""`wse fit`, `wse validate` and `wse compile`: a training job's params, trained, evaluated or laid out."""
import sys

from pyapi.cli.options import job_args, opt, overrides


def _load_params(args):
    from pyapi import params

    return params.load(args.params, overrides(args), compile_only=True)  # laid out (for serving), not trained


def _cmd_compile(args):
    import json

    if args.inference:
        if args.plot:
            raise ValueError("--plot: draws the training's layout, not with --inference")
        return _print_inference(args)
    for flag in ("batch", "prompt_tokens", "new_tokens"):
        if getattr(args, flag) is not None:
            raise ValueError(f"--{flag}: only with --inference")
    from pyapi import params
    from pyapi.job import Job

    spec, report = params.check(params.read(args.params), str(args.params), overrides(args), compile_only=True)
    d = Job(spec).compile()
    explore = report.micro_batch_mode == "explore"
    if explore:
        from mpi_launch.plan import micro_batch_table, plan_for

        d["micro_batches"] = micro_batch_table(spec, plan_for(spec)[1])
    if args.plot:  # drawn before anything is printed: with --json as well, whose output is the JSON alone
        from pyapi import plot

        written = plot.save(plot.compile_figure(d), args.plot)
    if args.json:
        print(json.dumps(d, indent=2))
        return 0
    from wse_core.checks import plural

    plan, mem = d["plan"], d["memory_bytes"]
    m = d["model"]
    print(f"model {m['name']}: {m['parameters']:,} parameters in {plural(len(m['units']), 'streaming unit')}")
    print(f"cluster: {plural(plan['num_csx'], 'CS-2')}, {plan['num_wgt_servers']} MemoryX, {len(plan['swarmx'])} "
          f"SwarmX (fan-out {plan['swarmx_fanout']}), {plural(plan['num_workers_per_csx'], 'input worker')} per "
          f"CS-2: {plan['world_size']} MPI ranks")
    for rank, role in enumerate(plan["roles"]):
        detail = ""
        if role == "memoryx":
            k = plan["memoryx"].index(rank)
            units = [m["units"][u] for u, o in enumerate(plan["unit_owner"]) if o == k]
            detail = f"owns {units[0]}..{units[-1]} ({plural(len(units), 'unit')})"
        elif role == "swarmx":
            detail = f"children {plan['children'][str(rank)]}" + (" (root)" if rank == plan["swarmx"][0] else "")
        elif role == "csx":
            detail = f"{plural(d['micro_batches_per_csx'], 'micro-batch')} per step"
        print(f"  rank {rank:>3}  {role:<11} {mem[str(rank)] / 2**20:9.1f} MiB  {detail}")
    sim, wafer = d["simulated"], d["wafer_bytes"]
    print(f"simulated step, weight streaming (a model of the hardware, wse_core.perf; {sim['detail']['system']}, "
          f"{sim['detail']['precision']}, {sim['detail']['io_gbps']:g} Gb/s per system): {sim['step_s'] * 1e3:.3f} ms, "
          f"{sim['samples_per_s']:.1f} samples/s")
    print(f"  compute {sim['compute_s'] * 1e3:.3f} ms, waiting for weights {sim['exposed_stream_s'] * 1e3:.3f} ms "
          f"(their bytes alone, and the gradients', take {sim['stream_s'] * 1e3:.3f} ms of the CS-2's I/O), "
          f"reduce tail {sim['reduce_tail_s'] * 1e3:.3f} ms, MemoryX update {sim['optimizer_s'] * 1e3:.3f} ms")
    def size(n):
        return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"

    print(f"  wafer memory per CS-2, a micro-batch of {wafer['micro_batch_size']}: "
          f"{size(wafer['checkpoints'] + wafer['segment'])} of activations (one unit's input in {wafer['interval']} "
          f"kept, a segment recomputed), {size(wafer['weights'] + wafer['gradients'])} of weights and gradients in "
          f"flight: {size(wafer['need'])} of {wafer['capacity'] / 1e9:.1f} GB usable")
    if explore:
        print("  micro-batch sizes (micro_batch_size: explore):")
        print(f"    {'size':>6} {'wafer GB':>9} {'samples/s':>10}")
        for row in d["micro_batches"]:
            speed = f"{row['samples_per_s']:10.1f}" if row["fits"] else f"{'does not fit':>10}"
            print(f"    {row['micro_batch_size']:>6} {row['need_bytes'] / 1e9:9.2f} {speed}"
                  + ("  <- chosen" if row["chosen"] else ""))
    exact = "yes" if d["bit_identical_to_reference"] else (
        "no (the micro-batches per CS-2 must be a power of two, and num_csx at most swarmx_fanout or both powers of two)")
    print(f"bit-identical to the single-process reference: {exact}")
    pl = d["pipeline"]
    print(f"pipelined on one CS-2: {pl['why']}")
    if pl["fits"]:
        print(f"  step {pl['step_s'] * 1e3:.3f} ms for {plural(pl['micro_batches'], 'micro-batch')} of "
              f"{pl['micro_batch_size']} through {plural(len(pl['regions']), 'stage')} (slowest "
              f"{pl['slowest_stage_s'] * 1e3:.3f} ms), update "
              f"{pl['update_s'] * 1e3:.3f} ms")
        print(f"  {'layer':<12} {'columns':>9} {'PEs':>9} {'parameters':>13} {'need MiB':>10} {'usable MiB':>10} "
              f"{'stage ms':>9}")
        for r in pl["regions"]:
            cols = f"{r['columns'][0]}-{r['columns'][1] - 1}"
            print(f"  {r['name']:<12} {cols:>9} {r['pes']:>9,} {r['params']:>13,} {r['need_bytes'] / 2**20:>10.1f} "
                  f"{r['capacity_bytes'] / 2**20:>10.1f} {r['stage_s'] * 1e3:>9.3f}")
    print(f"execution strategy: {d['why']}")
    if args.plot:
        print(f"wrote {written}")
    return 0


def _print_inference(args):
    """What serving the params' model takes on the emulated hardware (wse_core.perf.inference)."""
    import json

    from wse_core.checks import plural
    from wse_core.nn import build_model
    from wse_core.perf import Hardware
    from wse_core.perf.inference import serve

    params = _load_params(args)
    model = build_model(params.model)
    most = model.config.get("max_position_embeddings", 2)
    prompt = args.prompt_tokens if args.prompt_tokens is not None else min(128, most // 2)
    new = args.new_tokens if args.new_tokens is not None else min(128, most - prompt)
    num_csx = params.runconfig.num_csx
    kwargs = dict(batch=1 if args.batch is None else args.batch, prompt_tokens=prompt, new_tokens=new,
                  num_csx=num_csx, hw=Hardware.for_model(model, params.runconfig.hardware))
    r = serve(model, **kwargs)
    if args.json:
        print(json.dumps(r.to_dict(), indent=2))
        return 0
    d = r.detail
    csx = plural(num_csx, "CS-2")
    print(f"inference (a model of the hardware, wse_core.perf; {d['precision']}): {r.why}")
    print(f"  batch {r.batch}, prompt {r.prompt_tokens} tokens, {r.new_tokens} new: time to first token "
          f"{r.ttft_s * 1e3:.3f} ms, time per output token {r.tpot_s * 1e3:.3f} ms "
          f"(a request {d['request_s'] * 1e3:.1f} ms)")
    print(f"  {r.tokens_per_s_user:.1f} tokens/s per user, {r.tokens_per_s_batch:.1f} tokens/s for the batch")
    print(f"  KV cache {r.kv_bytes_per_sequence / 1e6:.3g} MB a sequence of {r.prompt_tokens + r.new_tokens} "
          f"positions: up to {r.max_batch['resident']} sequences with the weights resident on {csx}, "
          f"{r.max_batch['streamed']} with them streamed")
    if r.placement == "resident":
        g, m = d["micro_batches"], d["micro_batch"]
        print(f"  pipelined over {plural(d['stages'], 'stage')}: {plural(g, 'micro-batch')} of "
              f"{plural(m, 'sequence')}, slowest stage {d['slowest_stage_s'] * 1e3:.4f} ms, a token through "
              f"them all {d['latency_s'] * 1e3:.3f} ms")
        if r.max_batch["streamed"] >= r.batch:
            s = serve(model, placement="streamed", **kwargs)
            print(f"  streamed from MemoryX instead: {s.tokens_per_s_user:.1f} tokens/s per user, "
                  f"{s.tokens_per_s_batch:.1f} for the batch")
    else:
        n = d["sequences_per_csx"]
        print(f"  a decode step: compute {d['compute_s'] * 1e3:.3f} ms, the weights' stream "
              f"{d['stream_s'] * 1e3:.3f} ms ({plural(n, 'sequence')} per CS-2)")
    return 0


def _cmd_fit(args):
    from pathlib import Path

    from mpi_launch.launcher import JobInterrupted
    from pyapi.job import Job, JobError

    job = Job.from_yaml(args.params, model_dir=args.model_dir, overrides=overrides(args))
    if args.dry_run:
        print(" ".join(job.command(checkpoint_path=args.checkpoint_path, hostfile=args.hostfile)))
        return 0
    try:
        result = job.fit(checkpoint_path=args.checkpoint_path, hostfile=args.hostfile)
    except JobError as exc:
        print(f"wse fit: {exc}", file=sys.stderr)
        return 1
    except JobInterrupted as exc:
        from data_tools.checkpoint import CheckpointError, resolve

        try:
            kept = f"; the latest checkpoint is {resolve(job.model_dir).name}"
        except CheckpointError:  # none yet (or a `latest` that names none: the next run says so)
            kept = ""
        print(f"wse fit: interrupted by {exc}: the job's ranks were stopped{kept}", file=sys.stderr)
        return 128 + exc.signal
    if result.steps_trained:
        from wse_core.checks import plural

        resumed = f" from {Path(result.checkpoint).name}" if result.checkpoint else ""
        print(f"done: trained steps {result.start_step + 1}..{result.end_step}{resumed} "
              f"({plural(result.steps_trained, 'step')}); outputs in {result.model_dir} "
              "(metrics.jsonl, plan.json, logs/, checkpoint_*/)")
    return 0


def _cmd_validate(args):
    import json

    from pyapi.job import Job

    job = Job.from_yaml(args.params, model_dir=args.model_dir, overrides=args.set)
    r = job.validate(checkpoint_path=args.checkpoint_path, batches=args.eval_steps, stream=sys.stderr)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        print(f"eval loss {r['eval_loss']:.4f} (perplexity {r['perplexity']:.2f}, accuracy {r['accuracy']:.4f}) on "
              f"{r['examples']:,} examples, {r['tokens']:,} tokens; checkpoint of step {r['step']}: {r['checkpoint']}")
    return 0


def add_fit(sub, chosen):
    p = sub.add_parser("fit", help="train on an emulated cluster, weight streaming or pipelined (starts mpiexec)",
                       description="Validate PARAMS, lay out the cluster (coordinator, MemoryX, SwarmX, CS-2s, "
                                   "input workers; or one pipelined CS-2) and train. Resumes from "
                                   "MODEL_DIR/latest if there is one.")
    job_args(p)
    opt(p, "--checkpoint_path", metavar="PATH", help="resume from this checkpoint")
    p.add_argument("--dry-run", "--dry_run", dest="dry_run", action="store_true", help="print the mpiexec command only")
    p.add_argument("--hostfile", metavar="FILE", help="hosts for mpiexec (one per line)")
    p.set_defaults(func=_cmd_fit)


def add_validate(sub, chosen):
    p = sub.add_parser("validate", help="eval loss of a checkpoint on eval_input (no mpiexec)",
                       description="Load a checkpoint (default: MODEL_DIR/latest) and compute the model's loss "
                                   "on every example of eval_input.data_dir, in order, in this process.")
    p.add_argument("params", metavar="PARAMS", help="params YAML file (with an eval_input section)")
    opt(p, "--model_dir", metavar="DIR", help="override runconfig.model_dir")
    opt(p, "--checkpoint_path", metavar="PATH", help="checkpoint to evaluate (default: MODEL_DIR/latest)")
    opt(p, "--eval_steps", type=int, metavar="K", help="evaluate only the first K batches of eval_input")
    p.add_argument("--set", action="append", metavar="KEY.PATH=VALUE", help="override a params value (repeatable)")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.set_defaults(func=_cmd_validate)


def add_compile(sub, chosen):
    p = sub.add_parser("compile", help="print the rank plan and per-rank memory of a params file (no training)",
                       description="Validate PARAMS (and its data, as wse fit does, where the data is there) and "
                                   "print the rank plan: roles, MemoryX layer ownership, the SwarmX tree and "
                                   "estimated memory per rank; with --inference, the simulated latency of serving "
                                   "the model instead. Nothing is launched.")
    job_args(p, model_dir=False)
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--plot", metavar="PNG", help="draw the run as it will execute: weight streaming's cluster, "
                                                 "units and step, or the pipelined placement on the wafer")
    p.add_argument("--inference", action="store_true",
                   help="print instead what serving the model takes: time to first token, per output token, tokens/s")
    opt(p, "--batch", type=int, metavar="B", help="with --inference: sequences decoding together (default 1)")
    opt(p, "--prompt_tokens", type=int, metavar="P",
        help="with --inference: tokens of each prompt (default 128, at most half the model's positions)")
    opt(p, "--new_tokens", type=int, metavar="N",
        help="with --inference: tokens generated a sequence (default 128, at most the positions left)")
    p.set_defaults(func=_cmd_compile)
