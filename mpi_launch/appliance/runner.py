"""One attempt of an appliance job: ``python -m mpi_launch.appliance.runner``, started by the service.

It runs as the user who submitted the job, in the directory they submitted it from, and trains
exactly as ``wse fit`` does (``pyapi.Job.fit``: the launcher, its watchdog, resume from the
latest checkpoint in model_dir), on the cores the service gave the job. Its standard output is
the job's log; its exit code tells the service what happened (the codes below), and the last
line it prints says why. It reads its orders, one JSON object, from standard input.
"""
import json
import signal
import sys
import time

#: The job cannot run as given (params, data, permissions): restarting would fail the same way.
EXIT_BAD_INPUT = 2
#: A rank failed (the watchdog's one line was printed last): a restart from the checkpoint may succeed.
EXIT_JOB_FAILED = 3
#: Seconds to wait for model_dir's lock: the runner of an appliance that was killed may still be
#: ending its ranks (they go within the watchdog's teardown, a few seconds).
LOCK_WAIT_SECONDS = 60.0


def _wait_for_lock(model_dir):
    from mpi_launch.rundir import RunDir, RunDirBusy

    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            RunDir(model_dir).lock("appliance job").unlock()
            return
        except RunDirBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def attempt(params, *, cores=None, hostfile=None):
    """Train ``params`` (a validated flat dict) as ``wse fit`` does; print the outcome as the last
    line and return ``(exit code, that line)``: 0, EXIT_BAD_INPUT, EXIT_JOB_FAILED or 128 + signal."""
    from mpi_launch import MPILaunchError
    from mpi_launch.watchdog import JobInterrupted
    from pyapi.job import Job, JobError
    from pyapi.params import RunSpec

    job = Job(RunSpec.from_dict(params))
    try:
        _wait_for_lock(job.model_dir)
        result = job.fit(cores=cores, hostfile=hostfile, stream=sys.stdout)
        code, line = 0, f"done: trained steps {result.start_step + 1}..{result.end_step}; outputs in {result.model_dir}"
    except JobError as exc:
        code, line = EXIT_JOB_FAILED, str(exc)
    except JobInterrupted as exc:
        code, line = 128 + exc.signal, f"interrupted by {exc}: the job's ranks were stopped"
    except (ValueError, TypeError, OSError, MPILaunchError) as exc:
        code, line = EXIT_BAD_INPUT, f"error: {exc}"
    print(line, flush=True)
    return code, line


def main():
    from mpi_launch.supervisor import die_with_parent

    orders = json.load(sys.stdin)
    # The service owns the job: if it dies, the job stops (SIGTERM ends the ranks cleanly) and
    # the service, started again, resumes it from its checkpoint.
    die_with_parent(signal.SIGTERM)
    import os

    if os.getppid() != orders["appliance_pid"]:
        print("the appliance ended before this job started")
        return 128 + signal.SIGTERM
    try:  # again, as the user: the service entered the directory before it took the user's identity
        os.chdir(orders["cwd"])
    except OSError as exc:
        print(f"error: cannot enter {orders['cwd']}: {exc.strerror}")
        return EXIT_BAD_INPUT
    from wse_core import configure_process

    configure_process()
    return attempt(orders["params"], cores=orders["cores"])[0]  # validated by the service


if __name__ == "__main__":
    sys.exit(main())
