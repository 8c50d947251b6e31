"""Jobs on Slurm: beyond one machine, queueing, partitioning and node allocation are Slurm's.

``wse submit --slurm PARAMS`` checks the job as ``wse submit`` does, freezes its params into
``MODEL_DIR/slurm_job.yaml``, writes ``MODEL_DIR/slurm_job.sh`` (one Slurm task per rank of the
plan) and hands it to ``sbatch``. Inside the allocation the script runs this module, which trains
as ``wse fit`` does (the launcher, the watchdog, hydra's mpiexec taking the allocation's nodes)
and restarts from the latest checkpoint after a fault, up to ``--max_restarts`` times.
``wse jobs --slurm`` reads the state back with ``squeue`` (and ``sacct`` where Slurm keeps
accounting); ``wse logs --slurm`` prints the job's output file; ``wse cancel --slurm`` is ``scancel``.
Which user sees which job is Slurm's business. docs/design/appliance.md "Beyond one machine: Slurm".

    python -m pyapi.appliance.slurm MODEL_DIR/slurm_job.yaml --max_restarts R   (inside sbatch)
"""
import argparse
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from mpi_launch.rundir import RunDir
from pyapi.appliance.runner import EXIT_JOB_FAILED, attempt
from pyapi.errors import ApplianceError
from pyapi.params import load
from wse_core import configure_process
from wse_core.errors import ConfigError
from wse_core.numerics import numerics_variables

NAME_PREFIX = "wse-"
_FIELDS = ("id", "name", "state", "user", "elapsed", "comment")
_COMMENT = re.compile(r"num_csx=(\d+),max_steps=(\d+),model_dir=(.*)")


def _run(cmd):
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    except FileNotFoundError:
        raise ApplianceError(f"{cmd[0]}: not found; is this a Slurm login node?") from None
    except subprocess.TimeoutExpired:
        raise ApplianceError(f"`{' '.join(cmd)}` did not answer within 60 s") from None
    return out


def script(job, *, world_size, max_restarts, name, numerics=None):
    """The sbatch script of ``job`` (a ``pyapi.Job``): one task per rank, output in model_dir/logs.

    ``numerics``: the submitter's numerics variables (``wse_core.numerics``), exported by the script.
    sbatch hands the whole submitting environment on by default, but not where a site sets
    ``SBATCH_EXPORT=NONE`` (or ``--export``): these decide the job's bits, so they travel in any case.
    """
    model_dir = job.model_dir.absolute()
    run_dir = RunDir(model_dir)
    r = job.params.runconfig
    # What `wse jobs --slurm` shows beside Slurm's state (sbatch drops quotes: no JSON here).
    comment = f"num_csx={r.num_csx},max_steps={r.max_steps},model_dir={model_dir}"
    return "\n".join([
        "#!/bin/bash",
        "# A wse-cluster job, written by `wse submit --slurm`: one task per MPI rank of its plan.",
        f"#SBATCH --job-name={NAME_PREFIX}{name}",
        f"#SBATCH --ntasks={world_size}",
        f"#SBATCH --output={run_dir.slurm_output()}",
        f"#SBATCH --chdir={Path.cwd()}",
        f"#SBATCH --comment={comment}",
        *(f"export {k}={shlex.quote(v)}" for k, v in (numerics or {}).items() if k.isidentifier()),
        f"exec {shlex.quote(sys.executable)} -u -m pyapi.appliance.slurm "
        f"{shlex.quote(str(run_dir.slurm_job_yaml))} --max_restarts {int(max_restarts)}",
        ""])


def submit(job, *, max_restarts=0, name=None):
    """Check ``job``, write its params and script into model_dir, ``sbatch`` it; return (Slurm id, script path)."""
    if not 0 <= max_restarts <= 100:
        raise ConfigError(f"--max_restarts: expected 0..100, got {max_restarts}")
    job._check_inputs()
    model_dir = job.model_dir.absolute()
    for what, path in (("model_dir", model_dir), ("the current directory", Path.cwd())):
        if not str(path).isprintable() or any(c.isspace() for c in str(path)):
            raise ConfigError(f"{what}: {str(path)!r} has spaces or control characters, which #SBATCH lines "
                              "cannot carry; use another")
    name = re.sub(r"[^\w.-]", "_", name or model_dir.name)[:64]
    run_dir = RunDir(model_dir)
    run_dir.logs.mkdir(parents=True, exist_ok=True)
    frozen = run_dir.slurm_job_yaml
    d = job.params.to_dict()
    d["runconfig"]["model_dir"] = str(model_dir)
    frozen.write_text(yaml.safe_dump(d, sort_keys=False))
    path = run_dir.slurm_job_sh
    path.write_text(script(job, world_size=job.resolved.plan.world_size, max_restarts=max_restarts, name=name,
                           numerics=numerics_variables()))
    out = _run(["sbatch", "--parsable", str(path)])
    if out.returncode != 0:
        raise ApplianceError(f"sbatch {path}: {(out.stderr.strip().splitlines() or ['failed'])[-1]}")
    return int(out.stdout.strip().split(";")[0]), path


def _seconds(elapsed):
    """Slurm's [D-]HH:MM:SS (or MM:SS) as seconds."""
    days, _, hms = elapsed.rpartition("-")
    parts = [int(p) for p in hms.split(":") if p.isdigit()]
    secs = 0
    for p in parts:
        secs = secs * 60 + p
    return secs + 86400 * int(days or 0)


def _record(fields):
    """A job's record in the shape of the appliance's (``wse jobs``), from Slurm's fields."""
    f = dict(zip(_FIELDS, fields))
    m = _COMMENT.fullmatch(f["comment"])
    num_csx, max_steps, model_dir = (int(m[1]), int(m[2]), m[3]) if m else (None, None, None)
    steps = [r for r in RunDir(model_dir).read_metrics() if "sim_step_s" in r] if model_dir else []
    last = steps[-1] if steps else {}
    return {"id": int(f["id"]), "name": f["name"][len(NAME_PREFIX):], "state": f["state"].split()[0].lower(),
            "user": f["user"], "num_csx": num_csx, "max_steps": max_steps, "model_dir": model_dir, "step": last.get("step", 0), "loss": last.get("loss"),
            "sim_seconds": sum(m["sim_step_s"] for m in steps), "wall_seconds": _seconds(f["elapsed"]),
            "restarts": None, "reason": None}


def jobs():
    """This user's wse jobs that Slurm knows: squeue (queued, running, recently ended), then sacct."""
    out = _run(["squeue", "--me", "--noheader", "--states=all", "--format=%i|%j|%T|%u|%M|%k"])
    if out.returncode != 0:
        raise ApplianceError(f"squeue: {(out.stderr.strip().splitlines() or ['failed'])[-1]}")
    found = {}
    for line in out.stdout.splitlines():
        fields = line.split("|", len(_FIELDS) - 1)
        if len(fields) == len(_FIELDS) and fields[1].startswith(NAME_PREFIX):
            found[int(fields[0])] = _record(fields)
    # Older jobs are in Slurm's accounting, where it keeps one (sacct says so and fails where it does not).
    acct = _run(["sacct", "--noheader", "--parsable2", "--allocations", "--starttime=now-7days",
                 "--format=JobID,JobName,State,User,Elapsed,Comment"])
    if acct.returncode == 0:
        for line in acct.stdout.splitlines():
            fields = line.split("|", len(_FIELDS) - 1)
            if len(fields) == len(_FIELDS) and fields[1].startswith(NAME_PREFIX) and fields[0].isdigit():
                found.setdefault(int(fields[0]), _record(fields))
    return [found[k] for k in sorted(found)]


def _show(job_id):
    out = _run(["scontrol", "--oneliner", "show", "job", str(job_id)])
    if out.returncode != 0:
        raise ApplianceError(f"Slurm job {job_id}: {(out.stderr.strip().splitlines() or ['unknown'])[-1]}")
    return dict(kv.split("=", 1) for kv in out.stdout.split() if "=" in kv)


def logs(job_id):
    path = _show(job_id).get("StdOut")
    try:
        return Path(path).read_text(errors="replace")
    except (OSError, TypeError) as exc:
        raise ApplianceError(f"Slurm job {job_id}: cannot read its output {path}: {exc}") from None


def cancel(job_id):
    out = _run(["scancel", str(job_id)])
    if out.returncode != 0:
        raise ApplianceError(f"scancel {job_id}: {(out.stderr.strip().splitlines() or ['failed'])[-1]}")


def _hostfile(model_dir):
    """hydra's hostfile (host:tasks per line) of this allocation, when it spans several nodes."""
    hosts = _run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]]).stdout.split()
    counts = []
    for part in os.environ["SLURM_TASKS_PER_NODE"].split(","):  # e.g. 2(x3),1
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    path = RunDir(model_dir).hostfile(os.environ["SLURM_JOB_ID"])
    path.write_text("".join(f"{h}:{n}\n" for h, n in zip(hosts, counts)))
    return path


def main(argv=None):
    """Inside the allocation: train, restarting from the latest checkpoint after a fault."""
    p = argparse.ArgumentParser(prog="python -m pyapi.appliance.slurm")
    p.add_argument("params")
    p.add_argument("--max_restarts", type=int, default=0)
    args = p.parse_args(argv)
    configure_process()
    params = load(args.params)
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1"))
    hostfile = _hostfile(params.runconfig.model_dir) if nodes > 1 else None
    for n in range(args.max_restarts + 1):
        code, line = attempt(params.to_dict(), hostfile=hostfile)
        if code != EXIT_JOB_FAILED or n == args.max_restarts:
            return code
        print(f"== restart {n + 1} of {args.max_restarts} from the latest checkpoint after: {line}", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
