"""The job manager: jobs' transitions, their runners, restarts and progress
(docs/design/appliance.md "A job's attempt").

Every transition is written to the store before the service acts on it. A job's attempt is a
runner process (``runner``; started by ``launch``) whose exit code is the verdict: 0 done;
``EXIT_BAD_INPUT`` failed, never retried; ``EXIT_JOB_FAILED`` (or a runner that died) restarted at
once on the same CS-2s while ``restarts < max_restarts``, from the latest checkpoint; interrupted
by a stop, queued again for the next start. Each runner reports step, loss and simulated seconds on
a pipe; every value is checked (the runner runs as the job's user).
"""
import json
import math
import os
import selectors
import signal
import subprocess
import time

from pyapi.client import MAX_LINE
from pyapi.client import ACTIVE, JobState
from pyapi.appliance.launch import TRANSIENT, exit_name, start_runner
from pyapi.appliance.requests import printable
from pyapi.appliance.runner import EXIT_BAD_INPUT, EXIT_JOB_FAILED
from pyapi.appliance.scheduler import cores_for, pick
from wse_core.checks import plural

#: Seconds a cancelled or stopped job's runner gets to end its ranks before it is killed.
GRACE_SECONDS = 30.0
#: A start that meets an error of the machine (``launch.TRANSIENT``) is tried again this many seconds later.
RETRY_SECONDS = 5.0


class Progress:
    """The pipe on which a job's runner reports its step, loss and simulated seconds."""

    def __init__(self, job_id, fd):
        self.job_id, self.fd, self.buf = job_id, fd, b""


class Manager:
    """The jobs of one service: the store's records, the runners of running jobs, their progress."""

    def __init__(self, store, *, pool_csx, cores, owner, logs_dir, sel, say, guarded):
        self.store, self.pool_csx, self.cores, self.owner = store, pool_csx, cores, owner
        self.logs_dir, self.sel, self.say, self.guarded = logs_dir, sel, say, guarded
        self.procs = {}        # job id -> the runner (Popen) of its current attempt
        self.progress = {}     # job id -> {"step", "loss", "sim_seconds"} its runner reported
        self.pipes = {}        # job id -> its runner's progress pipe (Progress)
        self.retry_at = None   # monotonic time to try starting jobs again (after a transient error)
        self.cancelling = {}   # job id -> who cancelled it
        self.deadlines = {}    # job id -> monotonic time at which its runner is killed
        self.stopping = False

    def recover(self):
        """At start-up: jobs a killed service was running wait again; those too large for this pool fail."""
        for job_id in self.store.requeue_running("the appliance stopped while it ran; resumed from its latest "
                                                 "checkpoint"):
            self.say(f"job {job_id}: was running when the appliance stopped; queued again")
        for job in self.store.queue():
            if job["num_csx"] > self.pool_csx:
                self.end(job, JobState.FAILED, f"asks {job['num_csx']} CS-2s; the appliance now has {self.pool_csx}")

    # -- what a job record shows ---------------------------------------------------------------
    def public(self, job):
        keys = ("id", "name", "kind", "user", "state", "num_csx", "priority", "max_restarts", "restarts", "max_steps",
                "model_dir", "submitted", "started", "ended", "reason", "step", "loss", "sim_seconds")
        out = {k: job[k] for k in keys}
        out.update(self.progress.get(job["id"], {}))
        out["step"] = out["step"] or 0
        out["wall_seconds"] = None if job["started"] is None else (job["ended"] or time.time()) - job["started"]
        return out

    def counts(self):
        """How many jobs are in each active state."""
        counts = {state: 0 for state in ACTIVE}
        for job in self.store.jobs(states=ACTIVE):
            counts[job["state"]] += 1
        return counts

    def busy(self):
        """CS-2s held by running jobs."""
        return sum(j["num_csx"] for j in self.store.jobs(states=(JobState.RUNNING,)))

    def cores_for(self, num_csx):
        return cores_for(num_csx, self.pool_csx, self.cores)

    # -- transitions ---------------------------------------------------------------------------
    def end(self, job, state, reason):
        p = self.progress.pop(job["id"], {})
        self.store.update(job["id"], state=state, ended=time.time(), pid=None, reason=reason, **p)
        self.say(f"job {job['id']}: {state}" + (f": {reason}" if reason and state != JobState.DONE else ""))

    def requeue(self, job_id, reason, **fields):
        """A running job back in the queue (the service stops): its progress so far kept in its record."""
        self.store.update(job_id, state=JobState.QUEUED, pid=None, reason=reason, **fields,
                          **self.progress.pop(job_id, {}))

    def cancel(self, job, who):
        """A queued job ends at once; a running one's ranks are stopped (it ends when its runner exits)."""
        if job["state"] == JobState.QUEUED:
            self.end(job, JobState.CANCELLED, f"cancelled by {who} while queued")
            self.guarded("scheduling", self.schedule)  # it may have been holding the pool
        elif job["id"] not in self.cancelling:
            self.cancelling[job["id"]] = who
            self.signal_runner(job["id"], signal.SIGTERM)
            self.say(f"job {job['id']}: cancel asked by {who}; its ranks are being stopped")

    def stop(self):
        """Interrupt every running job (they resume from their checkpoints at the next start)."""
        self.stopping = True
        for job_id in self.procs:
            self.signal_runner(job_id, signal.SIGTERM)

    def schedule(self):
        """Start what the queue and the free CS-2s allow (again if a job could not start: its CS-2s are free).

        An error of the machine (out of descriptors, processes, memory, disk) leaves the job queued
        and the next start RETRY_SECONDS later; only an error of the job's own fails it.
        """
        self.retry_at = None
        while not self.stopping:
            starts, overtaken = pick(self.store.queue(), self.pool_csx - self.busy())
            for job_id in overtaken:
                self.store.update(job_id, overtaken=self.store.get(job_id)["overtaken"] + 1)
            try:
                if all([self._start(job) for job in starts]):
                    return
            except OSError as exc:  # transient (``_start``)
                self.say(f"cannot start a job now ({exc}); trying again in {RETRY_SECONDS:g} s")
                self.retry_at = time.monotonic() + RETRY_SECONDS
                return

    def _start(self, job):
        """Start an attempt of ``job``: its runner, as its user, writing its log. False if it could not start."""
        # Counted apart from restarts: a job the appliance's stop (or death) interrupted starts
        # again too, and its log numbers every runner.
        attempt = job["attempts"] + 1
        cores = self.cores_for(job["num_csx"])
        progress_r, progress_w = os.pipe()  # EMFILE here is transient: schedule() tries again
        self.store.update(job["id"], attempts=attempt)  # its log names it from here on
        try:
            proc = start_runner(job, attempt=attempt, cores=cores, owner=self.owner,
                                log_path=self.log_path(job["id"]), progress_fd=progress_w)
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            os.close(progress_r)
            os.close(progress_w)
            if isinstance(exc, OSError) and exc.errno in TRANSIENT:
                raise
            self.end(job, JobState.FAILED, f"cannot start as {job['user']}: {exc}")
            return False
        os.close(progress_w)
        os.set_blocking(progress_r, False)
        self.pipes[job["id"]] = Progress(job["id"], progress_r)
        self.sel.register(progress_r, selectors.EVENT_READ, self.pipes[job["id"]])
        self.procs[job["id"]] = proc
        self.store.update(job["id"], state=JobState.RUNNING, pid=proc.pid, started=job["started"] or time.time())
        self.say(f"job {job['id']}: attempt {attempt} started (runner pid {proc.pid}, {plural(cores, 'core')})")
        return True

    def signal_runner(self, job_id, sig):
        proc = self.procs.get(job_id)
        if proc is None:
            return
        try:
            proc.send_signal(sig)  # the runner ends its ranks (JobInterrupted) and exits
        except ProcessLookupError:
            pass
        self.deadlines.setdefault(job_id, time.monotonic() + GRACE_SECONDS)

    def reap(self):
        """Act on every runner that has exited: done, failed, restarted, cancelled or left to resume."""
        changed = False
        for job_id, proc in list(self.procs.items()):
            if proc.poll() is None:
                continue
            changed = True
            del self.procs[job_id]
            self.deadlines.pop(job_id, None)
            self.guarded(f"job {job_id}'s progress", self._drain_progress, job_id)
            self.guarded(f"job {job_id}'s end", self._ended, job_id, proc.returncode)
        if changed:
            self.guarded("scheduling", self.schedule)

    def _ended(self, job_id, code):
        job = self.store.get(job_id)
        line = self.last_line(job_id)
        cancelled_by = self.cancelling.pop(job_id, None)
        interrupted = code in (-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM)
        if code == 0:
            self.end(job, JobState.DONE, job["reason"])  # the last fault it survived, if any
        elif code == EXIT_BAD_INPUT:
            self.end(job, JobState.FAILED, line)
        elif cancelled_by is not None:
            self.end(job, JobState.CANCELLED, f"cancelled by {cancelled_by} while running")
        elif self.stopping and interrupted:
            self.requeue(job_id, "interrupted when the appliance stopped; " +
                         ("serves again at its next start" if job["kind"] == "serve" else "resumes from its latest checkpoint"))
        else:
            why = line if code == EXIT_JOB_FAILED else f"its runner ended with {exit_name(code)}"
            if job["restarts"] >= job["max_restarts"]:
                self.end(job, JobState.FAILED, why)
                return
            n = job["restarts"] + 1
            resume = "" if job["kind"] == "serve" else " from the latest checkpoint"  # a serve job has none
            self.log(job_id, f"== restart {n} of {job['max_restarts']}{resume} after: {why}\n")
            self.say(f"job {job_id}: failed ({why}); restart {n} of {job['max_restarts']}")
            if self.stopping:  # it restarts when the appliance is started again
                self.requeue(job_id, why, restarts=n)
                return
            self.store.update(job_id, restarts=n, reason=why)
            self._start(self.store.get(job_id))

    def tick(self, now):
        """Start jobs again after a transient error; kill runners that outlived their grace."""
        if self.retry_at is not None and now > self.retry_at:
            self.guarded("scheduling", self.schedule)
        for job_id, deadline in list(self.deadlines.items()):
            if now > deadline and job_id in self.procs:
                # The runner's session: the runner itself. Its ranks end when its watchdog's
                # connections close, which its death does (docs/design/faults.md "Supervisors").
                self.say(f"job {job_id}: its runner did not end within {GRACE_SECONDS:g} s; killed")
                try:
                    os.killpg(self.procs[job_id].pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.deadlines[job_id] = float("inf")

    # -- logs ----------------------------------------------------------------------------------
    def log_path(self, job_id):
        return self.logs_dir / f"job_{job_id}.log"

    def log(self, job_id, text):
        with open(self.log_path(job_id), "a") as f:
            f.write(text)

    def last_line(self, job_id):
        path = self.log_path(job_id)
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 4096))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "its log is missing"
        return printable(lines[-1].strip(), 1000) if lines else "it printed nothing"

    # -- progress ------------------------------------------------------------------------------
    def read_progress(self, p):
        """A runner's progress lines (it runs as the job's user: every value is checked). True at the pipe's end."""
        try:
            chunk = os.read(p.fd, 65536)
        except BlockingIOError:
            return False
        if not chunk:
            self._close_progress(p.job_id)
            return True
        p.buf = (p.buf + chunk)[-MAX_LINE:]
        *lines, p.buf = p.buf.split(b"\n")
        for line in lines:
            try:
                r = json.loads(line)
                step, loss, sim = int(r["step"]), r["loss"], float(r["sim_seconds"])
                loss = None if loss is None else float(loss)
            except (ValueError, TypeError, KeyError, RecursionError, OverflowError):
                continue
            if 0 <= step < 2**62 and math.isfinite(sim) and (loss is None or math.isfinite(loss)):
                self.progress[p.job_id] = {"step": step, "loss": loss, "sim_seconds": sim}
        return False

    def _close_progress(self, job_id):
        p = self.pipes.pop(job_id, None)
        if p is not None:
            self.sel.unregister(p.fd)
            os.close(p.fd)

    def _drain_progress(self, job_id):
        """At the runner's end: what it wrote last, then the pipe closed (whatever of its children still holds it)."""
        p = self.pipes.get(job_id)
        for _ in range(64):  # bounded: a descendant could keep writing
            if p is None or self.read_progress(p):
                break
        self._close_progress(job_id)
