"""`wse appliance start|stop|status` and the commands on its jobs: `wse submit`, `jobs`, `logs`, `cancel`."""
import json
import os
import sys
import time

from pyapi.client import JobState
from pyapi.cli.options import job_args, print_json_or_lines
# What a command runs (pyapi.job, pyapi.params, wse_core, data_tools, ...) is imported inside its function:
# `wse --help` imports every module here and must load no numerics (tests/test_cli.py).

SOCKET_HELP = ("the appliance's socket (default: $WSE_APPLIANCE_SOCKET, else this user's own appliance, else "
               "/var/lib/wse-appliance/appliance.sock)")


def _cmd_appliance_start(args):
    from pyapi.client import default_state_dir
    from wse_core.checks import plural

    state_dir = args.state_dir or default_state_dir()
    if args.foreground:
        from pyapi.appliance.service import Service

        service = Service(state_dir, args.socket, args.num_csx)
        print(f"appliance: pid {os.getpid()}, {plural(args.num_csx, 'CS-2')}, socket {service.socket_path}", flush=True)
        service.serve()
        return 0
    from pyapi.appliance.service import start_background

    pid, sock = start_background(state_dir, args.socket, args.num_csx)
    print(f"appliance started: pid {pid}, {plural(args.num_csx, 'CS-2')}, socket {sock}, state in {state_dir}")
    if args.socket or state_dir != default_state_dir():
        print(f"  (other commands find it with --socket {sock} or WSE_APPLIANCE_SOCKET={sock})")
    return 0


def _cmd_appliance_stop(args):
    from pyapi.client import ApplianceError, Client
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
    from pyapi.client import Client

    print_json_or_lines(Client(args.socket).status(), args.json)
    return 0


def _cmd_submit(args):
    from pyapi.job import Job
    from wse_core.errors import ConfigError

    job = Job.from_yaml(args.params, overrides=args.set, num_csx=args.num_csx,
                        execution_strategy=args.execution_strategy, model_dir=args.model_dir)
    if args.slurm:
        from pyapi.appliance import slurm

        for flag, given in (("--priority", args.priority), ("--follow", args.follow), ("--socket", args.socket)):
            if given:
                raise ConfigError(f"{flag}: not with --slurm (Slurm orders its queue by its own policy; "
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
    done = job["state"] == JobState.DONE
    print(f"job {job_id}: {job['state']}" + (f": {job['reason']}" if not done and job["reason"] else ""),
          file=sys.stderr)
    return 0 if done else 1


def _fmt(x, spec, empty="-"):
    return empty if x is None else format(x, spec)


def _cmd_jobs(args):
    if args.slurm:
        from pyapi.appliance import slurm

        jobs = slurm.jobs()
    else:
        from pyapi.client import Client

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
        trains = j.get("kind", "train") == "train"  # Slurm's jobs are training jobs, and carry no kind
        step = f"{j['step']}/{j['max_steps']}" if trains and j.get("max_steps") else _fmt(j.get("step"), "")
        print(f"{j['id']:>5}  {j['state']:<10} {j['user']:<10} {_fmt(j['num_csx'], '>4')} {step:>9} "
              f"{_fmt(j.get('loss'), '8.4f'):>8} {_fmt(j.get('sim_seconds') and j['sim_seconds'] * 1e3, '8.4g'):>8} "
              f"{_fmt(j.get('wall_seconds'), '8.1f'):>8} {_fmt(j.get('restarts'), '>8')}  {j['name']}")
        # The appliance's states, and Slurm's FAILED and CANCELLED too (`slurm.jobs()` lower-cases them to
        # the same words; its PENDING, TIMEOUT and the rest show no reason, as before).
        if j.get("reason") and j["state"] in (JobState.FAILED, JobState.CANCELLED, JobState.QUEUED):
            print(f"{'':>7}{j['reason']}")
    return 0


def _cmd_logs(args):
    if args.slurm:
        from pyapi.appliance import slurm

        sys.stdout.write(slurm.logs(args.job))
        return 0
    from pyapi.client import Client

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
    from pyapi.client import Client

    job = Client(args.socket).cancel(args.job)
    print(f"job {args.job}: " + ("cancelled" if job["state"] == JobState.CANCELLED else
                                 "cancelling (its ranks are being stopped)"))
    return 0


def add_appliance(sub, chosen):
    p = sub.add_parser("appliance", help="a service owning a pool of CS-2s that queues and runs users' jobs",
                       description="The appliance: a long-running service owning a pool of emulated CS-2s. Users "
                                   "queue jobs on it with `wse submit`, and list, follow and cancel them with "
                                   "`wse jobs`, `wse logs`, `wse cancel`; each sees only their own jobs.")
    ap_sub = p.add_subparsers(dest="appliance_command", metavar="ACTION", required=True,
                              help="`wse appliance ACTION --help` says more")
    ap = ap_sub.add_parser("start", help="start the service (in the background unless --foreground)",
                           description="Start the appliance with a pool of --num_csx emulated CS-2s, in the "
                                       "background (it prints its pid and socket and returns) or, with "
                                       "--foreground, in this process until it is stopped. The jobs its last stop "
                                       "interrupted resume.")
    ap.add_argument("--num_csx", type=int, default=4, metavar="N", help="CS-2s in the pool (default 4)")
    ap.add_argument("--socket", metavar="PATH", help="where it listens (default: STATE_DIR/appliance.sock)")
    ap.add_argument("--state_dir", metavar="DIR", help="its job records and logs (default: /var/lib/wse-appliance "
                                                       "for root, ~/.local/state/wse-appliance for others)")
    ap.add_argument("--foreground", action="store_true", help="run in this process (for systemd and the like)")
    ap.set_defaults(func=_cmd_appliance_start)
    for name, func, text, description in (
            ("stop", _cmd_appliance_stop, "stop the service; running jobs resume at its next start",
             "Stop the appliance (its owner or root): its running jobs are stopped, to resume from their latest "
             "checkpoint when it is started again. Returns once the service has exited."),
            ("status", _cmd_appliance_status, "the pool: CS-2s free, jobs queued and running",
             "Print the appliance's pool: its CS-2s, how many are free, and the jobs queued and running.")):
        ap = ap_sub.add_parser(name, help=text, description=description)
        ap.add_argument("--socket", metavar="PATH", help=SOCKET_HELP)
        if name == "status":
            ap.add_argument("--json", action="store_true", help="print JSON")
        ap.set_defaults(func=func)


def add_submit(sub, chosen):
    p = sub.add_parser("submit", help="queue a training job on the appliance (or on Slurm with --slurm)",
                       description="Validate PARAMS, check its data as you, and queue it on the appliance; print "
                                   "the job id at once. The job waits until its CS-2s are free, runs as you, "
                                   "resumes from MODEL_DIR/latest, and is restarted from its latest checkpoint "
                                   "after a fault up to --max_restarts times.")
    job_args(p)
    p.add_argument("--max_restarts", type=int, default=0, metavar="R", help="restarts after a fault (default 0)")
    p.add_argument("--priority", type=int, default=0, metavar="P",
                   help="higher runs first; first come, first served within a priority (default 0)")
    p.add_argument("--name", help="the job's name in `wse jobs` (default: model_dir's name)")
    p.add_argument("-f", "--follow", action="store_true", help="then follow its log until it ends")
    p.add_argument("--slurm", action="store_true", help="submit to Slurm with sbatch instead (one task per rank)")
    p.add_argument("--socket", metavar="PATH", help=SOCKET_HELP)
    p.set_defaults(func=_cmd_submit)


def add_jobs(sub, chosen):
    p = sub.add_parser("jobs", help="your jobs on the appliance: state, CS-2s, step, loss, simulated and wall time",
                       description="List your jobs on the appliance (or, with --slurm, your wse jobs on Slurm): "
                                   "each one's state, CS-2s, step, latest loss, simulated and wall time, restarts "
                                   "and name; a failed, cancelled or waiting job's reason below it.")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--slurm", action="store_true", help="your wse jobs on Slurm (squeue and sacct)")
    p.add_argument("--socket", metavar="PATH", help=SOCKET_HELP)
    p.set_defaults(func=_cmd_jobs)


def add_logs(sub, chosen):
    p = sub.add_parser("logs", help="a job's log; -f follows it until the job ends",
                       description="Print the output of one of your jobs so far (a training job's is what `wse "
                                   "fit` prints). With -f, follow it as it grows until the job ends; the exit "
                                   "status is then the job's: 0 if it finished, 1 otherwise.")
    p.add_argument("job", type=int, metavar="JOB", help="the job's id, as `wse submit` and `wse jobs` print it")
    p.add_argument("-f", "--follow", action="store_true", help="follow until the job ends")
    p.add_argument("--slurm", action="store_true", help="JOB is a Slurm job id")
    p.add_argument("--socket", metavar="PATH", help=SOCKET_HELP)
    p.set_defaults(func=_cmd_logs)


def add_cancel(sub, chosen):
    p = sub.add_parser("cancel", help="cancel a queued job, or stop a running one cleanly",
                       description="Cancel one of your jobs: a queued job leaves the queue; a running job's "
                                   "processes are stopped, and the checkpoints it wrote stay in its model_dir.")
    p.add_argument("job", type=int, metavar="JOB", help="the job's id, as `wse submit` and `wse jobs` print it")
    p.add_argument("--slurm", action="store_true", help="JOB is a Slurm job id (scancel)")
    p.add_argument("--socket", metavar="PATH", help=SOCKET_HELP)
    p.set_defaults(func=_cmd_cancel)
