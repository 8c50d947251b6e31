"""One attempt of an appliance job: ``python -m pyapi.appliance.runner``, started by the service.

It runs as the user who submitted the job, in the directory they submitted it from, with the
numerics variables of their shell (BLAS kernel, thread counts: sent with the job), and trains
exactly as ``wse fit`` does (``pyapi.Job.fit``: the launcher, its watchdog, resume from the
latest checkpoint in model_dir), on the cores the service gave the job; a serve job serves as
``wse serve --num_csx`` does (``serve``). Its standard output is
the job's log; its exit code tells the service what happened (the codes below), and the last
line it prints says why. It reads its orders, one JSON object, from standard input.
"""
import json
import os
import signal
import sys
import threading
import time

from mpi_launch.launcher import JobInterrupted
from mpi_launch.rundir import RunDir, RunDirBusy
from mpi_launch.supervisor import die_with_parent
from pyapi.job import Job, JobError
from pyapi.params import RunSpec
from wse_core import configure_process
from wse_core.errors import WseError
# pyapi.serve is imported in serve(): it loads the kernels (and aiohttp), after main()'s configure_process().

#: The job cannot run as given (params, data, permissions): restarting would fail the same way.
EXIT_BAD_INPUT = 2
#: A rank failed (the watchdog's one line was printed last): a restart from the checkpoint may succeed.
EXIT_JOB_FAILED = 3
#: Seconds to wait for model_dir's lock: the runner of an appliance that was killed may still be
#: ending its ranks (they go within the watchdog's teardown, a few seconds).
LOCK_WAIT_SECONDS = 60.0


def _wait_for_lock(model_dir):
    deadline = time.monotonic() + LOCK_WAIT_SECONDS
    while True:
        try:
            RunDir(model_dir).lock("appliance job").unlock()
            return
        except RunDirBusy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


class _Progress(threading.Thread):
    """Reports the job's step, loss and simulated seconds to the service, once a second, from
    model_dir's metrics.jsonl: read here, as the job's user, so the service never opens a user's path."""

    def __init__(self, metrics, fd):
        super().__init__(name="wse-progress", daemon=True)
        self.metrics, self.fd = metrics, fd
        self.inode, self.offset, self.state, self.sent = None, 0, None, None
        self.stopped = threading.Event()

    def run(self):
        while not self.stopped.wait(1.0):
            self.report()

    def report(self):
        try:
            with open(self.metrics, "rb") as f:
                st = os.fstat(f.fileno())
                if (st.st_ino, st.st_dev) != self.inode or st.st_size < self.offset:  # rewritten by a resume
                    self.inode, self.offset, self.state = (st.st_ino, st.st_dev), 0, None
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return
        done = data.rfind(b"\n") + 1  # whole lines only: the last may be being written
        self.offset += done
        for line in data[:done].splitlines():
            try:
                r = json.loads(line)
            except ValueError:
                continue
            try:
                sim = (self.state or {}).get("sim_seconds", 0.0) + float(r["sim_step_s"])
                self.state = {"step": int(r["step"]), "loss": r.get("loss"), "sim_seconds": sim}
            except (TypeError, KeyError, ValueError):
                continue  # not a step's record
        if self.state is not None and self.state != self.sent:
            try:
                os.write(self.fd, (json.dumps(self.state) + "\n").encode())
                self.sent = dict(self.state)
            except OSError:
                pass

    def stop(self):
        self.stopped.set()
        self.join()
        self.report()


def serve(orders, *, cores=None):
    """Serve as ``wse serve --num_csx`` does (``pyapi.serve.Server`` over an inference job on the
    job's CS-2s and cores) until SIGTERM (a cancel, or the appliance stopping); print the outcome as
    the last line and return ``(exit code, that line)``: 128 + SIGTERM once stopped (a serve job
    has no end of its own), EXIT_BAD_INPUT when it cannot start as given, EXIT_JOB_FAILED when its
    inference job cannot start."""
    from pyapi.serve import Limits, Server

    try:
        server = Server.load(orders["model"], orders.get("checkpoint_path"), limits=Limits.given(orders),
                             cluster={"num_csx": orders["num_csx"], "placement": orders.get("placement"),
                                      "peer_timeout": orders.get("peer_timeout"), "log_dir": orders.get("log_dir"),
                                      "cores": cores, "stream": sys.stdout})
        server.run(orders["host"], orders["port"], on_ready=lambda url: print(
            f"serving {server.name} on {url} ({server.describe()})", flush=True))
        code, line = 128 + signal.SIGTERM, f"stopped serving {server.name}"
    except JobError as exc:  # its inference job (InferenceJobError), or its launch
        code, line = EXIT_JOB_FAILED, str(exc)
    except (WseError, OSError) as exc:  # as the command line: a bug's ValueError keeps its traceback
        code, line = EXIT_BAD_INPUT, f"error: {exc}"
    print(line, flush=True)
    return code, line


def attempt(params, *, cores=None, hostfile=None, progress_fd=None):
    """Train ``params`` (a validated flat dict) as ``wse fit`` does; print the outcome as the last
    line and return ``(exit code, that line)``: 0, EXIT_BAD_INPUT, EXIT_JOB_FAILED or 128 + signal.
    With ``progress_fd``, report progress on it as the job goes (``_Progress``)."""
    job = Job(RunSpec.from_dict(params))
    progress = None if progress_fd is None else _Progress(RunDir(job.model_dir).metrics, progress_fd)
    try:
        _wait_for_lock(job.model_dir)
        if progress is not None:
            progress.start()
        result = job.fit(cores=cores, hostfile=hostfile, stream=sys.stdout)
        code, line = 0, f"done: trained steps {result.start_step + 1}..{result.end_step}; outputs in {result.model_dir}"
    except JobError as exc:
        code, line = EXIT_JOB_FAILED, str(exc)
    except JobInterrupted as exc:
        code, line = 128 + exc.signal, f"interrupted by {exc}: the job's ranks were stopped"
    except (WseError, OSError) as exc:  # as the command line: a bug's ValueError keeps its traceback
        code, line = EXIT_BAD_INPUT, f"error: {exc}"
    finally:
        if progress is not None and progress.is_alive():
            progress.stop()
    print(line, flush=True)
    return code, line


def main():
    orders = json.load(sys.stdin)
    # The service owns the job: if it dies, the job stops (SIGTERM ends the ranks cleanly) and
    # the service, started again, resumes it from its checkpoint.
    die_with_parent(signal.SIGTERM)
    if os.getppid() != orders["appliance_pid"]:
        print("the appliance ended before this job started")
        return 128 + signal.SIGTERM
    try:  # as the user: the service starts the runner in "/" (docs/design/appliance.md "Who is asking")
        os.chdir(orders["cwd"])
    except OSError as exc:
        print(f"error: cannot enter {orders['cwd']}: {exc.strerror}")
        return EXIT_BAD_INPUT
    configure_process()
    if orders["kind"] == "serve":
        return serve(orders["params"], cores=orders["cores"])[0]
    return attempt(orders["params"], cores=orders["cores"], progress_fd=orders["progress_fd"])[0]


if __name__ == "__main__":
    sys.exit(main())
