"""The appliance: a long-running service that owns a pool of emulated CS-2s and runs users' jobs on it.

``wse appliance start --num_csx N`` starts it (``python -m pyapi.appliance.service``). This module
holds its state directory (its lock, modes and ownership) and answers the requests; the rest is
split by what it does: ``server`` (the socket, connections, the select loop), ``requests`` (what a
request may hold), ``checker`` (a submission's params checked as its user), ``manager`` (jobs'
transitions, runners, restarts), ``scheduler`` (``pick``), ``launch`` (a runner as its user),
``store`` (the jobs table). It never opens a path a user named: their files are read and written
by their own processes (the checker, the runner), never by the service.

Users: the caller of every request is the uid the kernel gives for the socket's peer
(``SO_PEERCRED``), never a name in the request. A user sees and controls only their own jobs;
root sees all. A service run by root runs each job as the user who submitted it (their uid,
groups, home, umask and directory), so a job reads and writes only where its user may; a service
run by an ordinary user serves only that user. docs/design/appliance.md "Who is asking".
"""
import argparse
import codecs
import fcntl
import os
import pwd
import selectors
import subprocess
import sys
import time
import traceback
from pathlib import Path

from pyapi.appliance import requests
from pyapi.appliance.checker import CHECK_SECONDS, Checker
from pyapi.client import SOCKET_NAME, wait_for_socket
from pyapi.errors import ApplianceError, ApplianceRunning, RequestError
from pyapi.client import ACTIVE, JobState
from pyapi.appliance.launch import SAFE_PATH
from pyapi.appliance.manager import Manager
from pyapi.appliance.requests import check_path, printable
from pyapi.appliance.server import IDLE_SECONDS, Server, answering, listen, user_name
from pyapi.appliance.store import Store
from wse_core.checks import plural
from wse_core.errors import ConfigError

_LOG_CHUNK = 65536


def _check_owned(state_dir, owner):
    """The state directory and what is in it are the service's user's: state another user could have
    written (a jobs table naming the uid a job runs as) is never adopted."""
    for path in [state_dir, *state_dir.iterdir()]:
        uid = path.lstat().st_uid
        if uid != owner:
            raise ApplianceError(f"{path}: owned by {user_name(uid)}, not by {user_name(owner)}, who starts this "
                                 "appliance; an appliance adopts only state of its own: chown it, or start with "
                                 "another --state_dir")


class Service:
    """The appliance's state and its answers. ``serve()`` runs until ``wse appliance stop`` or SIGTERM."""

    def __init__(self, state_dir, socket_path=None, num_csx=4):
        if not isinstance(num_csx, int) or num_csx < 1:
            raise ConfigError(f"--num_csx: expected a positive integer, got {num_csx!r}")
        os.umask(0o077)  # the job records, logs and service log are the service's alone
        self.state_dir = Path(state_dir).absolute()
        self.socket_path = Path(socket_path).absolute() if socket_path else self.state_dir / SOCKET_NAME
        self.num_csx, self.cores = num_csx, os.cpu_count() or 1
        self.owner = os.geteuid()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        _check_owned(self.state_dir, self.owner)
        # Root's: others may reach the socket inside it, and read nothing else.
        os.chmod(self.state_dir, 0o711 if self.owner == 0 else 0o700)
        self._lock_fd = self._lock()
        self.logs_dir = self.state_dir / "logs"
        self.logs_dir.mkdir(exist_ok=True)
        for path in [self.logs_dir, *self.state_dir.iterdir()]:  # also what an older service left readable
            if path != self.socket_path and not path.is_symlink():
                os.chmod(path, 0o700 if path.is_dir() else 0o600)
        self.log = open(self.state_dir / "service.log", "a", buffering=1)
        self.store = Store(self.state_dir / "jobs.sqlite")
        self.server = Server(listen(self.socket_path, self.owner), self)
        self.checker = Checker(owner=self.owner, pool_csx=self.num_csx, cores=self.cores)
        self.jobs = Manager(self.store, pool_csx=num_csx, cores=self.cores, owner=self.owner, logs_dir=self.logs_dir,
                            sel=self.server.sel, say=self.say, guarded=self.guarded)
        # The checker children fork from this process: they find these already imported.
        import mpi_launch.resolved  # noqa: F401  (the checker imports it only inside its check)
        import wse_core.nn  # noqa: F401

        self.jobs.recover()

    @property
    def stopping(self):
        return self.jobs.stopping

    # -- start-up ------------------------------------------------------------------------------
    def _lock(self):
        """One service per state directory: an flock the kernel drops when the service dies."""
        fd = os.open(self.state_dir / "service.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 100).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ApplianceError(f"{self.state_dir}: in use by the appliance of pid {holder}") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        return fd

    def say(self, line):
        try:
            self.log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        except OSError:
            pass  # a full disk must not end the service: its log is best effort

    def guarded(self, what, fn, *args):
        """Run one piece of the loop's work; a failure is logged and does not end the service."""
        try:
            return fn(*args)
        except Exception:
            self.say(f"{what} failed: {traceback.format_exc()}")

    # -- the loop (``server.Server`` runs it and calls these) ----------------------------------
    def serve(self):
        self.server.serve()
        self.say("appliance stopped")
        self.socket_path.unlink(missing_ok=True)
        self.store.close()
        os.close(self._lock_fd)

    def started(self):
        self.say(f"appliance started: pid {os.getpid()}, {plural(self.num_csx, 'CS-2')}, "
                 f"{plural(self.cores, 'core')}, socket {self.socket_path}")
        self.guarded("scheduling", self.jobs.schedule)

    def done(self):
        return self.stopping and not self.jobs.procs

    def busy(self):
        """Anything the loop must look at again within a tick (besides connections)."""
        return bool(self.jobs.deadlines or self.checker.zombies or self.jobs.retry_at is not None)

    def ready(self, progress):
        self.guarded(f"job {progress.job_id}'s progress", self.jobs.read_progress, progress)

    def reap(self):
        self.jobs.reap()

    def tick(self, now):
        self.checker.reap()
        self.jobs.tick(now)

    def tick_conn(self, conn, now):
        if conn.check is not None:
            if conn.check.timed_out(now, IDLE_SECONDS):
                self.end_check(conn)
                self.server.reply(conn, {"error": f"the params check did not end within {CHECK_SECONDS} s"})
        elif conn.follow is not None:
            self.guarded("a log", self._pump_log, conn)
        elif conn.wait is not None:
            self.guarded("a wait", self._check_wait, conn)

    def schedule(self):
        self.jobs.schedule()

    def begin_stop(self, why):
        """Stop taking jobs; interrupt the running ones (they resume from their checkpoints at the next start)."""
        if self.stopping:
            return
        self.say(f"stopping ({why}): {len(self.jobs.procs)} running job(s) interrupted")
        self.server.stop_listening()
        self.jobs.stop()

    # -- requests ------------------------------------------------------------------------------
    def handle(self, conn, line):
        try:
            req = requests.parse(line)
            handlers = {requests.Status: self.op_status, requests.Submit: self.op_submit, requests.Jobs: self.op_jobs,
                        requests.Job: self.op_job, requests.Cancel: self.op_cancel, requests.Logs: self.op_logs,
                        requests.Wait: self.op_wait, requests.Stop: self.op_stop}
            handlers[type(req)](conn, req)
        except ValueError as exc:  # RequestError, ParamsError
            self.server.reply(conn, {"error": printable(str(exc).splitlines()[0] if str(exc) else
                                                        type(exc).__name__)})
        except Exception as exc:  # a request must never take the service down
            self.say(f"request from uid {conn.uid} failed: {traceback.format_exc()}")
            self.server.reply(conn, {"error": f"request refused: {type(exc).__name__}"})

    def _job_of(self, conn, job_id):
        job = self.store.get(job_id) if -2**63 <= job_id < 2**63 else None
        if job is None or (conn.uid != 0 and job["uid"] != conn.uid):
            raise RequestError(f"no job {job_id} of yours (user {user_name(conn.uid)})")
        return job

    def op_status(self, conn, req):
        counts = self.jobs.counts()
        self.server.reply(conn, {"pid": os.getpid(), "user": user_name(self.owner), "num_csx": self.num_csx,
                                 "free_csx": self.num_csx - self.jobs.busy(), "cores": self.cores,
                                 "queued": counts[JobState.QUEUED], "running": counts[JobState.RUNNING],
                                 "socket": str(self.socket_path), "state_dir": str(self.state_dir),
                                 "stopping": self.stopping})

    def op_submit(self, conn, req):
        """Check what can be checked here, then the params in a child as the caller (``read_check``)."""
        if self.stopping:
            raise RequestError("the appliance is stopping; submit again once it has been started")
        if self.owner != 0 and conn.uid != self.owner:
            raise RequestError(f"this appliance serves only user {user_name(self.owner)}; start your own with "
                               "`wse appliance start`")
        try:
            account = pwd.getpwuid(conn.uid)
        except KeyError:
            raise RequestError(f"uid {conn.uid} has no account on this machine") from None
        if req.priority > 0 and conn.uid not in (0, self.owner):
            raise RequestError("priority: above 0 only for root (you may lower a job's priority, not raise it)")
        conn.check = self.checker.start(req, account, conn.pid)
        self.server.sel.register(conn.check.fd, selectors.EVENT_READ, conn)

    def read_check(self, conn):
        check = conn.check
        out = check.read()
        if out is None:
            return
        self.end_check(conn)
        try:
            if "error" in out:
                raise RequestError(str(out["error"]))
            self._queue(conn, check, out)
        except ValueError as exc:
            self.server.reply(conn, {"error": printable(str(exc))})
        except Exception as exc:  # the submitter gets its line whatever went wrong here
            self.say(f"a submission of uid {conn.uid} failed: {traceback.format_exc()}")
            self.server.reply(conn, {"error": f"request refused: {type(exc).__name__}"})

    def end_check(self, conn):
        check, conn.check = conn.check, None
        self.server.sel.unregister(check.fd)
        self.checker.end(check)

    def _queue(self, conn, check, checked):
        req, account = check.request, check.account
        model_dir = check_path(checked["model_dir"], "runconfig.model_dir")
        for other in self.store.jobs(uid=account.pw_uid, states=ACTIVE):
            if other["model_dir"] == model_dir:
                raise RequestError(f"runconfig.model_dir: {model_dir} is the model_dir of your job {other['id']} "
                                   f"({other['state']}); use another")
        job_id = self.store.add(uid=account.pw_uid, gid=account.pw_gid, user=account.pw_name, name=req.name,
                                kind=checked["kind"], params=checked["params"], cwd=req.cwd, umask=check.umask, model_dir=model_dir,
                                num_csx=checked["num_csx"], max_steps=checked["max_steps"], priority=req.priority,
                                max_restarts=req.max_restarts, numerics=req.numerics)
        self.say(f"job {job_id}: submitted by {account.pw_name}: {checked['num_csx']} CS-2s, {model_dir}")
        self.guarded("scheduling", self.jobs.schedule)
        self.server.reply(conn, {"job": self.jobs.public(self.store.get(job_id))})

    def op_jobs(self, conn, req):
        jobs = self.store.jobs(uid=None if conn.uid == 0 else conn.uid)
        self.server.reply(conn, {"jobs": [self.jobs.public(j) for j in jobs]})

    def op_job(self, conn, req):
        self.server.reply(conn, {"job": self.jobs.public(self._job_of(conn, req.id))})

    def op_cancel(self, conn, req):
        job = self._job_of(conn, req.id)
        if job["state"].is_terminal():
            raise RequestError(f"job {job['id']} has already ended ({job['state']})")
        self.jobs.cancel(job, user_name(conn.uid))
        self.server.reply(conn, {"job": self.jobs.public(self.store.get(job["id"]))})

    def op_logs(self, conn, req):
        job = self._job_of(conn, req.id)
        conn.follow = (job["id"], 0, codecs.getincrementaldecoder("utf-8")("replace"), req.follow)
        self._pump_log(conn)

    def op_wait(self, conn, req):
        job = self._job_of(conn, req.id)
        deadline = None if req.timeout is None else time.monotonic() + req.timeout
        conn.wait = (job["id"], deadline)
        self._check_wait(conn)

    def op_stop(self, conn, req):
        if conn.uid not in (0, self.owner):
            raise RequestError("only root may stop this appliance" if self.owner == 0 else
                               f"only {user_name(self.owner)} or root may stop this appliance")
        self.server.reply(conn, {"stopping": True, "running": len(self.jobs.procs), "pid": os.getpid()})
        self.begin_stop(f"asked by {user_name(conn.uid)}")

    # -- logs and waits ------------------------------------------------------------------------
    def _pump_log(self, conn):
        """Send what the log holds beyond what was sent; end the reply at its end, or, when following,
        once the job has ended. A slow reader is served at the next tick."""
        job_id, offset, decoder, follow = conn.follow
        path = self.jobs.log_path(job_id)
        while True:
            if len(conn.outbuf) > _LOG_CHUNK:
                return
            try:
                with open(path, "rb") as f:
                    f.seek(offset)
                    data = f.read(_LOG_CHUNK)
            except FileNotFoundError:
                data = b""
            if not data:
                break
            offset += len(data)
            conn.follow = (job_id, offset, decoder, follow)
            self.server.send(conn, {"data": decoder.decode(data)})
            if not self.server.is_open(conn):
                return
        job = self.store.get(job_id)
        if follow and not job["state"].is_terminal():
            return
        conn.follow = None
        self.server.reply(conn, {"end": self.jobs.public(job)})

    def _check_wait(self, conn):
        job_id, deadline = conn.wait
        job = self.store.get(job_id)
        if job["state"].is_terminal():
            conn.wait = None
            self.server.reply(conn, {"job": self.jobs.public(job)})
        elif deadline is not None and time.monotonic() > deadline:
            conn.wait = None
            self.server.reply(conn, {"error": f"job {job_id} is still {job['state']}"})


#: How the service, started in the background, says why it could not start (its last line in service.log).
_ERROR = "wse appliance: error: "


def start_background(state_dir, socket_path, num_csx, timeout=60.0):
    """Start the service as a daemon (its own session, output in STATE_DIR/service.log); return its pid."""
    state_dir = Path(state_dir).absolute()
    state_dir.mkdir(parents=True, exist_ok=True)
    socket_path = Path(socket_path).absolute() if socket_path else state_dir / SOCKET_NAME
    running = answering(socket_path)
    if running is not None:
        raise ApplianceRunning(f"{socket_path}: an appliance already answers there (pid {running['pid']}, "
                               f"{running['num_csx']} CS-2s)")
    with open(os.open(state_dir / "service.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as out:
        proc = subprocess.Popen([sys.executable, *SAFE_PATH, "-m", "pyapi.appliance.service", "--state_dir",
                                 str(state_dir), "--socket", str(socket_path), "--num_csx", str(num_csx)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd="/")
    if not wait_for_socket(socket_path, proc, timeout):
        if proc.poll() is None:
            proc.kill()
        lines = (state_dir / "service.log").read_text(errors="replace").strip().splitlines()
        # The service's own line, without its prefix: the caller puts its own.
        raise ApplianceError(lines[-1].removeprefix(_ERROR) if lines else
                             f"the appliance did not start (see {state_dir}/service.log)")
    return proc.pid, socket_path


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m pyapi.appliance.service")
    p.add_argument("--state_dir", required=True)
    p.add_argument("--socket")
    p.add_argument("--num_csx", type=int, default=4)
    args = p.parse_args(argv)
    try:
        service = Service(args.state_dir, args.socket, args.num_csx)
    except (ApplianceError, ValueError, OSError) as exc:
        print(f"{_ERROR}{exc}", flush=True)
        return 1
    service.serve()
    return 0


if __name__ == "__main__":
    sys.exit(main())
