"""The run directory (``model_dir``): its layout, its lock, and preparing it for a run.

Layout (docs/design/checkpoints.md "The run directory"); no other module spells these names:

    model_dir/
      .wse.lock               held (flock) by the launcher while a job runs; says which job
      run.json                what every rank reads: validated params, the resolved run (ResolvedRun.to_json:
                              rank plan, strategy, micro-batches), start step, checkpoint;
                              and the numerics environment the launcher saw (wse_core.numerics)
      params.yaml             the resolved params (loads again with `wse fit` / `wse validate`)
      plan.json               the rank plan and memory estimates (`wse compile --json`)
      metrics.jsonl           one JSON object per step
      loss.png                its loss and simulated samples/s against the step, drawn when a run ends (pyapi.plot)
      logs/rank_<r>.log       each rank's log (tracebacks of failures go here too)
      logs/timing_rank_<r>.jsonl  where each rank's step time went
      logs/pid_rank_<r>       each rank's pid (for people and tests that want to signal one)
      logs/mpiexec.log        hydra's own messages
      logs/watchdog.log       every report of the ranks' supervisors, as the watchdog received it
      logs/hwloc.xml          never written: named to hydra so it leaves no file in /tmp (mpiexec.hydra_env)
      logs/slurm-<id>.out     a Slurm job's output (pyapi.appliance.slurm)
      logs/hosts-<id>         hydra's hostfile of a Slurm allocation over several nodes
      slurm_job.yaml, slurm_job.sh   the params and the sbatch script of `wse submit --slurm`
      checkpoint_<step>/, latest   the checkpoint store (data_tools.checkpoint)
"""
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from data_tools.files import write_text
from mpi_launch.mpiexec import MPILaunchError

LOCK = ".wse.lock"


class LineLog:
    """An append-only, line-buffered text file whose write errors name it: a full disk says where."""

    def __init__(self, path):
        self.path = Path(path)
        self._file = open(self.path, "a", buffering=1)

    def write(self, line):
        try:
            self._file.write(line)
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None

    def close(self):
        try:
            self._file.close()
        except OSError as exc:
            raise OSError(exc.errno, exc.strerror, str(self.path)) from None


class RunDirBusy(MPILaunchError):
    """Another job holds the run directory's lock."""


class RunDir:
    """One run directory: paths of everything in it, the lock, metrics, and ``prepare``."""

    def __init__(self, model_dir):
        self.path = Path(model_dir)
        self._lock_fd = None

    # -- paths ---------------------------------------------------------------------------------
    @property
    def logs(self):
        return self.path / "logs"

    @property
    def run_json(self):
        return self.path / "run.json"

    @property
    def params_yaml(self):
        return self.path / "params.yaml"

    @property
    def plan_json(self):
        return self.path / "plan.json"

    @property
    def metrics(self):
        return self.path / "metrics.jsonl"

    @property
    def loss_png(self):
        return self.path / "loss.png"

    @property
    def mpiexec_log(self):
        return self.logs / "mpiexec.log"

    @property
    def watchdog_log(self):
        return self.logs / "watchdog.log"

    @property
    def hwloc_xml(self):
        return self.logs / "hwloc.xml"

    def rank_log(self, rank):
        return self.logs / f"rank_{rank}.log"

    def timing_log(self, rank):
        return self.logs / f"timing_rank_{rank}.jsonl"

    def pid_file(self, rank):
        return self.logs / f"pid_rank_{rank}"

    @property
    def slurm_job_yaml(self):
        return self.path / "slurm_job.yaml"

    @property
    def slurm_job_sh(self):
        return self.path / "slurm_job.sh"

    def slurm_output(self, job_id="%j"):
        """A Slurm job's output file (the default: sbatch's pattern for it)."""
        return self.logs / f"slurm-{job_id}.out"

    def hostfile(self, job_id):
        return self.logs / f"hosts-{job_id}"

    # -- the lock ------------------------------------------------------------------------------
    def lock(self, what="wse fit"):
        """Take the run directory for this process, or raise RunDirBusy naming the job that holds it.

        An flock: the kernel drops it when the holder dies, however it dies, so a crashed run
        never leaves it stuck. The file says who holds it, for the message the next job prints.
        """
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 4096).decode(errors="replace")
            os.close(fd)
            try:
                h = json.loads(holder)
                who = f"{h['what']} (pid {h['pid']} on {h['host']}, started {h['started']})"
            except (ValueError, KeyError, TypeError):
                who = "another job"
            raise RunDirBusy(f"{self.path}: in use by {who}; wait for it to end or use another "
                             "--model_dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"what": what, "pid": os.getpid(), "host": socket.gethostname(),
                                 "started": time.strftime("%Y-%m-%d %H:%M:%S")}).encode())
        self._lock_fd = fd
        return self

    def unlock(self):
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.unlock()

    # -- metrics -------------------------------------------------------------------------------
    def read_metrics(self):
        """The records of metrics.jsonl (a torn last line, from a killed writer, is skipped)."""
        if not self.metrics.exists():
            return []
        records = []
        for line in self.metrics.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records

    def truncate_metrics(self, step):
        """Keep only the records of steps <= ``step``: a resumed run rewrites what comes after."""
        kept = [r for r in self.read_metrics() if r.get("step", 0) <= step]
        write_text(self.metrics, "".join(json.dumps(r) + "\n" for r in kept))

    # -- preparing a run -----------------------------------------------------------------------
    def prepare(self, resolved, *, checkpoint=None):
        """Write ``run.json`` (the spec and the ``ResolvedRun`` the ranks obey), ``params.yaml`` and
        ``plan.json`` of a ``mpi_launch.resolved.ResolvedRun``; return the run dict.

        Resumes from ``checkpoint`` if given, else from ``latest`` if there is one; when ``latest`` is
        missing or unreadable beside checkpoints, from the newest complete one, ``latest`` written again
        and the run dict's ``recovered`` the line that says so (``data_tools.checkpoint.recover_latest``:
        a run never starts afresh over checkpoints). Metrics of
        steps after the start step are dropped (they are about to be trained again). A checkpoint
        written under another numerics environment is refused in one line, unless
        ``runconfig.allow_numerics_change``: then the run dict's ``numerics_changed`` says what differs.
        """
        import yaml

        from data_tools.checkpoint import Checkpoint, clean_up, recover_latest
        from mpi_launch.resolved import describe
        from wse_core.numerics import environment

        clean_up(self.path)  # what a killed or failed save left (this job holds the lock)
        self.logs.mkdir(parents=True, exist_ok=True)
        for stale in self.logs.glob("pid_rank_*"):
            stale.unlink()
        recovered = None
        if checkpoint is None:
            checkpoint, recovered = recover_latest(self.path)
        start, ckpt_dir, numerics, changed = 0, None, environment(), []
        if checkpoint is not None:
            ckpt = Checkpoint(checkpoint)
            start, ckpt_dir = ckpt.step, str(ckpt.dir.resolve())
            ckpt.check_model(resolved.model)
            changed = _check_numerics(ckpt, numerics, resolved.spec.runconfig.allow_numerics_change)
        self.truncate_metrics(start)
        params = resolved.spec
        run = {"kind": params.kind, "params": params.to_dict(), "resolved": resolved.to_json(), "start_step": start,
               "checkpoint": ckpt_dir, "numerics": numerics, "numerics_changed": changed, "recovered": recovered}
        # every rank, the appliance and `wse bench faults` read them while the job starts: whole files
        write_text(self.run_json, json.dumps(run, indent=1))
        write_text(self.params_yaml, yaml.safe_dump(params.to_dict(), sort_keys=False))
        write_text(self.plan_json, json.dumps(describe(resolved), indent=1))
        return run

    def read_run(self):
        return json.loads(self.run_json.read_text())


def _check_numerics(ckpt, numerics, allow):
    """What of the numerics environment changed since ``ckpt`` was written; refused unless ``allow``.

    Refused by default: same params, same bits is this project's promise, and a resume that breaks
    it silently is worse than one that stops to ask (a careful user learns it before a day of
    training, not after); one setting lets a user who knows go on.
    """
    from wse_core.numerics import differences

    changed = differences(ckpt.numerics or {}, numerics)
    if changed and not allow:
        raise MPILaunchError(f"{ckpt.dir}: written under another numerics environment ({'; '.join(changed)}): "
                             "resuming here would not give an uninterrupted run's bits; set "
                             "runconfig.allow_numerics_change: true (--set runconfig.allow_numerics_change=true) "
                             "to resume anyway")
    return changed
