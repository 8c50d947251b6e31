"""`wse fit`, `wse validate` and `wse compile`: a training job's params, trained, evaluated or laid out."""
import json
import sys
from pathlib import Path

from pyapi.cli.options import job_args, runconfig_values
# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).


def _cmd_compile(args):
    from pyapi import params
    from pyapi.job import Job
    from wse_core.errors import ConfigError

    if args.inference and args.plot:
        raise ConfigError("--plot: draws the training's layout, not with --inference")
    for flag in ("batch", "prompt_tokens", "new_tokens"):
        if not args.inference and getattr(args, flag) is not None:
            raise ConfigError(f"--{flag}: only with --inference")
    spec, keys = params.load(args.params, args.set, values=runconfig_values(args), compile_only=True,
                             with_report=True)
    job = Job(spec, model=keys.model)  # the model the validation built
    explore = not args.inference and keys.micro_batch_mode == "explore"  # the file asks for every size
    report = job.compile(explore=explore, inference=args.inference, batch=args.batch,
                         prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens)
    if args.plot:  # drawn before anything is printed: with --json as well, whose output is the JSON alone
        from pyapi import plot

        written = plot.save(plot.compile_figure(report.to_dict()), args.plot)
    print(json.dumps(report.to_dict(), indent=2) if args.json else report)
    if args.plot and not args.json:
        print(f"wrote {written}")
    return 0


def _cmd_fit(args):
    from mpi_launch.launcher import JobInterrupted
    from pyapi.job import Job, JobError

    job = Job.from_yaml(args.params, overrides=args.set, num_csx=args.num_csx,
                        execution_strategy=args.execution_strategy, model_dir=args.model_dir)
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
    p.add_argument("--checkpoint_path", metavar="PATH", help="resume from this checkpoint")
    p.add_argument("--dry_run", action="store_true", help="prepare MODEL_DIR and print the mpiexec command only")
    p.add_argument("--hostfile", metavar="FILE", help="hosts for mpiexec (one per line)")
    p.set_defaults(func=_cmd_fit)


def add_validate(sub, chosen):
    p = sub.add_parser("validate", help="eval loss of a checkpoint on eval_input (no mpiexec)",
                       description="Load a checkpoint (default: MODEL_DIR/latest) and compute the model's loss "
                                   "on every example of eval_input.data_dir, in order, in this process.")
    p.add_argument("params", metavar="PARAMS", help="params YAML file (with an eval_input section)")
    p.add_argument("--model_dir", metavar="DIR", help="override runconfig.model_dir")
    p.add_argument("--checkpoint_path", metavar="PATH", help="checkpoint to evaluate (default: MODEL_DIR/latest)")
    p.add_argument("--eval_steps", type=int, metavar="K", help="evaluate only the first K batches of eval_input")
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
    p.add_argument("--batch", type=int, metavar="B", help="with --inference: sequences decoding together (default 1)")
    p.add_argument("--prompt_tokens", type=int, metavar="P",
                   help="with --inference: tokens of each prompt (default 128, at most half the model's positions)")
    p.add_argument("--new_tokens", type=int, metavar="N",
                   help="with --inference: tokens generated a sequence (default 128, at most the positions left)")
    p.set_defaults(func=_cmd_compile)
