"""The appliance: a long-running service that owns a pool of emulated CS-2s and runs users' jobs on it.

``wse appliance start --num_csx N`` starts it (``python -m mpi_launch.appliance.service``). It
listens on a unix socket, keeps its jobs in SQLite (``store``), and runs each job as a runner
process (``runner``: ``Job.fit`` under the watchdog) with the job's share of the machine's
cores. One thread, one ``select``: requests, the runners' exits (SIGCHLD through the wakeup fd),
their progress reports (a pipe each), the children that check submitted params, and a
half-second tick while any connection is open or a runner is given its grace. It never spins
(docs/design.md section 3), and it never opens a path a user named: their files are read and
written by their own processes (the checker, the runner), never by the service.

Scheduling (docs/design.md section 11): a job waits until its CS-2s are free; queued jobs are
considered by priority, then in order of submission, and a later job that fits may start ahead of
one that does not. That overtaking is bounded: once ``MAX_OVERTAKES`` later jobs have started
ahead of a waiting job, nothing behind it starts until it has, so the CS-2s it needs come free
and a large job is never starved by a stream of small ones. Only root (or the owner of a
user's appliance) may raise a job's priority above 0.

Users: the caller of every request is the uid the kernel gives for the socket's peer
(``SO_PEERCRED``), never a name in the request. A user sees and controls only their own jobs;
root sees all. A service run by root runs each job as the user who submitted it (their uid,
groups, home, umask and directory), so a job reads and writes only where its user may; a service
run by an ordinary user serves only that user.
"""
import argparse
import codecs
import errno
import fcntl
import json
import math
import os
import pwd
import resource
import selectors
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from mpi_launch.appliance.client import MAX_LINE, SOCKET_ENV, SOCKET_NAME, ApplianceError, Client
from mpi_launch.appliance.runner import EXIT_BAD_INPUT, EXIT_JOB_FAILED
from mpi_launch.appliance.store import ACTIVE, ENDED, Store
from mpi_launch.supervisor import die_with_parent
from wse_core.numerics import ENV_NAMES, ENV_PREFIXES, is_numerics_variable

#: How many later jobs may start ahead of a waiting job before it holds the pool for itself.
MAX_OVERTAKES = 2
#: Seconds a cancelled or stopped job's runner gets to end its ranks before it is killed.
GRACE_SECONDS = 30.0
#: A connection that has not sent its request, or not taken its reply, within this many seconds is closed.
IDLE_SECONDS = 30.0
MAX_CONNECTIONS = 512
#: Connections one user may hold at once (a `wse logs -f` holds one): no user can lock the others out.
MAX_CONNECTIONS_PER_USER = 32
#: Seconds between looks at followed logs, waits and deadlines (only while there are any).
TICK_SECONDS = 0.5
#: The child that checks a submitted job's params: CPU seconds and bytes of address space it may use.
CHECK_SECONDS = 60
CHECK_MEMORY = 4 << 30
#: Params checks running at once: per user, and in all (each may use CHECK_MEMORY).
MAX_CHECKS_PER_USER = 2
MAX_CHECKS = max(2, os.cpu_count() or 1)
#: Errors of the machine, not of a job: a start that meets one is tried again this many seconds later.
_TRANSIENT = (errno.EMFILE, errno.ENFILE, errno.EAGAIN, errno.ENOMEM, errno.ENOSPC)
RETRY_SECONDS = 5.0
#: Longest path accepted for a job's directory or model_dir.
MAX_PATH = 4096
_LOG_CHUNK = 65536
_REQUIRED = object()
#: What of the service's environment a job of another user gets: locale, and how MPI is set up on
#: this machine; never the rest (root's tokens, PATH, TMPDIR). Its numerics variables (BLAS kernel,
#: thread counts) are the submitter's, sent with the job (``check_numerics``), for every job.
_ENV_KEEP = ("LANG", "LANGUAGE", "TZ")
_ENV_PREFIXES = ("LC_", "HYDRA_", "MPIR_", "MPICH_", "UCX_", "FI_")
#: A submission's numerics variables (wse_core.numerics): how many, and how long a value may be.
MAX_NUMERICS = 64
MAX_NUMERICS_VALUE = 1024


class RequestError(ValueError):
    """A request the service refuses; the message is the one line the caller sees."""


def _user(uid):
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _printable(text, limit=None):
    """``text`` without control characters (a user's line shown on root's terminal carries no escapes)."""
    out = "".join(c if c.isprintable() else " " for c in text)
    return out if limit is None else out[:limit]


def _path(value, what):
    if not os.path.isabs(value) or len(value) > MAX_PATH or not value.isprintable():
        raise RequestError(f"{what}: expected an absolute path of printable characters, got {value[:100]!r}")
    return os.path.normpath(value)


def check_numerics(variables):
    """A submission's ``numerics`` field: variables that steer numerics (``wse_core.numerics``) and nothing
    else of the submitter's environment (LD_PRELOAD, PATH, PYTHONPATH... would reach what the runner
    loads), with names of identifier characters and printable values of bounded length."""
    if len(variables) > MAX_NUMERICS:
        raise RequestError(f"numerics: at most {MAX_NUMERICS} variables, got {len(variables)}")
    for name, value in variables.items():
        if not (name.isascii() and name.isidentifier() and is_numerics_variable(name)):
            kinds = ", ".join([*(f"{p}*" for p in ENV_PREFIXES), *ENV_NAMES])
            raise RequestError(f"numerics: {_printable(name, 40)!r} is not a numerics variable ({kinds})")
        if not isinstance(value, str) or len(value) > MAX_NUMERICS_VALUE or not value.isprintable():
            raise RequestError(f"numerics.{name}: expected printable text of at most {MAX_NUMERICS_VALUE} "
                               f"characters, got {_printable(repr(value), 40)}")
    return variables


def _check_owned(state_dir, owner):
    """The state directory and what is in it are the service's user's: state another user could have
    written (a jobs table naming the uid a job runs as) is never adopted."""
    for path in [state_dir, *state_dir.iterdir()]:
        uid = path.lstat().st_uid
        if uid != owner:
            raise ApplianceError(f"{path}: owned by {_user(uid)}, not by {_user(owner)}, who starts this "
                                 "appliance; an appliance adopts only state of its own: chown it, or start with "
                                 "another --state_dir")


def _mapped_bytes():
    """This process's address space now (VmSize): what a child's RLIMIT_AS must allow beyond."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _umask_of(pid):
    """The umask of process ``pid`` (the submitting client): its job's files get the modes its own would."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    return 0o077


class _Conn:
    def __init__(self, sock):
        self.sock = sock
        self.pid, self.uid, self.gid = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                                         struct.calcsize("3i")))
        self.inbuf, self.outbuf = b"", b""
        self.opened = self.sent = time.monotonic()  # sent: when its reply last moved
        self.answered = False       # its request has been read (it may be following a log or waiting)
        self.close_after = False    # half-close once outbuf is sent
        self.closed_at = None       # when it was half-closed (it is closed when the peer closes, or idles)
        self.follow = None          # (job id, offset, decoder, follow) while sending a log
        self.wait = None            # (job id, deadline) while waiting for a job to end
        self.check = None           # the params check of its submit, while it runs
        self.eof = False            # the peer has shut its side (it may still read)
        self.watched = False        # registered with the selector


class _Check:
    """A child process checking a submitted job's params as its user, within CPU and memory limits."""

    def __init__(self, pid, fd, fields, account, umask):
        self.pid, self.fd, self.fields, self.account, self.umask = pid, fd, fields, account, umask
        self.buf, self.started = b"", time.monotonic()


class _Progress:
    """The pipe on which a job's runner reports its step, loss and simulated seconds."""

    def __init__(self, job_id, fd):
        self.job_id, self.fd, self.buf = job_id, fd, b""


class Service:
    """The appliance's state and its loop. ``serve()`` runs until ``wse appliance stop`` or SIGTERM."""

    def __init__(self, state_dir, socket_path=None, num_csx=4):
        if not isinstance(num_csx, int) or num_csx < 1:
            raise ValueError(f"--num_csx: expected a positive integer, got {num_csx!r}")
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
        self.listener = self._listen()
        self.conns = {}        # fd -> _Conn
        self.procs = {}        # job id -> the runner (Popen) of its current attempt
        self.progress = {}     # job id -> {"step", "loss", "sim_seconds"} its runner reported
        self.pipes = {}        # job id -> its runner's progress pipe (_Progress)
        self.zombies = []      # params-check children killed and not yet reaped
        self.retry_at = None   # monotonic time to try starting jobs again (after a transient error)
        self.cancelling = {}   # job id -> who cancelled it
        self.deadlines = {}    # job id -> monotonic time at which its runner is killed
        self.stopping = False
        self.accept_paused = None  # monotonic time to accept again after running out of descriptors
        self.sel = selectors.DefaultSelector()
        # The checker children fork from this process: they find these already imported.
        import mpi_launch.mpiexec  # noqa: F401
        import mpi_launch.plan  # noqa: F401
        import pyapi.params  # noqa: F401
        import wse_core.nn  # noqa: F401

        for job_id in self.store.requeue_running("the appliance stopped while it ran; resumed from its latest "
                                                 "checkpoint"):
            self.say(f"job {job_id}: was running when the appliance stopped; queued again")
        for job in self.store.queue():
            if job["num_csx"] > self.num_csx:
                self._end(job, "failed", f"asks {job['num_csx']} CS-2s; the appliance now has {self.num_csx}")

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

    def _listen(self):
        try:
            mode = self.socket_path.lstat().st_mode
        except FileNotFoundError:
            mode = None
        if mode is not None:
            if not stat.S_ISSOCK(mode):
                raise ApplianceError(f"{self.socket_path}: exists and is not a socket; choose another --socket")
            try:
                Client(self.socket_path).status()
                raise ApplianceError(f"{self.socket_path}: an appliance already answers there")
            except ApplianceError as exc:
                if "already answers" in str(exc):
                    raise
            self.socket_path.unlink()  # left by a service that was killed
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(self.socket_path))
        # Root's appliance serves every user (each is told apart by the kernel, not by the request).
        os.chmod(self.socket_path, 0o666 if self.owner == 0 else 0o600)
        s.listen(64)
        s.setblocking(False)
        return s

    def say(self, line):
        try:
            self.log.write(f"{time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")
        except OSError:
            pass  # a full disk must not end the service: its log is best effort

    def _guarded(self, what, fn, *args):
        """Run one piece of the loop's work; a failure is logged and does not end the service."""
        try:
            return fn(*args)
        except Exception:
            self.say(f"{what} failed: {traceback.format_exc()}")

    # -- the loop ------------------------------------------------------------------------------
    def serve(self):
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: None)  # the wakeup fd carries the signal number
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a client gone mid-reply is an OSError, not our end
        self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        self.sel.register(wake_r, selectors.EVENT_READ, "signal")
        self.say(f"appliance started: pid {os.getpid()}, {self.num_csx} CS-2s, {self.cores} cores, socket "
                 f"{self.socket_path}")
        self._guarded("scheduling", self.schedule)
        while not (self.stopping and not self.procs):
            busy = self.conns or self.deadlines or self.zombies or self.accept_paused is not None \
                or self.retry_at is not None
            for key, events in self.sel.select(TICK_SECONDS if busy else None):
                data = key.data
                if data == "accept":
                    self._accept()
                elif data == "signal":
                    for sig in os.read(wake_r, 512):
                        if sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                            self.begin_stop(f"signal {signal.Signals(sig).name}")
                elif isinstance(data, _Progress):
                    self._guarded(f"job {data.job_id}'s progress", self._read_progress, data)
                elif isinstance(data, _Conn) and data.check is not None and key.fd == data.check.fd:
                    self._guarded("a params check", self._read_check, data)
                elif isinstance(data, _Conn):
                    if events & selectors.EVENT_READ:
                        self._guarded("a request", self._read, data)
                    if events & selectors.EVENT_WRITE and data.sock.fileno() in self.conns:
                        self._guarded("a reply", self._flush, data)
            self.reap()
            self.tick()
        for conn in list(self.conns.values()):
            self._flush(conn)
            self._close(conn)
        self.say("appliance stopped")
        self.socket_path.unlink(missing_ok=True)
        self.store.close()
        os.close(self._lock_fd)

    def begin_stop(self, why):
        """Stop taking jobs; interrupt the running ones (they resume from their checkpoints at the next start)."""
        if self.stopping:
            return
        self.stopping = True
        self.say(f"stopping ({why}): {len(self.procs)} running job(s) interrupted")
        if self.accept_paused is None:
            self.sel.unregister(self.listener)
        self.listener.close()
        for job_id in self.procs:
            self._signal_runner(job_id, signal.SIGTERM)

    # -- connections ---------------------------------------------------------------------------
    def _accept(self):
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):  # out of descriptors: wait a second, don't spin
                self.sel.unregister(self.listener)
                self.accept_paused = time.monotonic() + 1.0
            return
        if len(self.conns) >= MAX_CONNECTIONS:
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock)
        self.conns[sock.fileno()] = conn
        self._watch(conn)
        if sum(c.uid == conn.uid for c in self.conns.values()) > MAX_CONNECTIONS_PER_USER:
            conn.answered = True
            self._reply(conn, {"error": f"user {_user(conn.uid)} has {MAX_CONNECTIONS_PER_USER} connections to "
                                        "the appliance open already"})

    def _read(self, conn):
        try:
            chunk = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            if conn.answered and conn.closed_at is None and (conn.check or conn.outbuf):
                conn.eof = True  # it has said all it will say; its reply is still to come
                self._watch(conn)
            else:
                self._close(conn)
            return
        if conn.answered:
            return  # one request per connection: anything more is read and dropped
        conn.inbuf += chunk
        if b"\n" not in conn.inbuf:
            if len(conn.inbuf) > MAX_LINE:
                conn.answered, conn.inbuf = True, b""
                self._reply(conn, {"error": f"request longer than {MAX_LINE} bytes"})
            return
        line = conn.inbuf.split(b"\n", 1)[0]
        conn.answered, conn.inbuf = True, b""
        self._handle(conn, line)

    def _send(self, conn, obj):
        if not conn.outbuf:
            conn.sent = time.monotonic()
        conn.outbuf += (json.dumps(obj) + "\n").encode()
        self._flush(conn)

    def _reply(self, conn, obj):
        """The last reply: once sent, the connection is half-closed (see ``_flush``)."""
        conn.close_after = True
        self._send(conn, obj)

    def _flush(self, conn):
        if conn.closed_at is not None or conn.sock.fileno() not in self.conns:
            return
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
                conn.outbuf = conn.outbuf[sent:]
                conn.sent = time.monotonic()
            except (BlockingIOError, InterruptedError):
                pass
            except OSError:
                self._close(conn)
                return
        if conn.close_after and not conn.outbuf:
            # Half-close, and drop what the peer still sends until it closes: closing with unread
            # input would reset the connection and could lose the reply (a request too long, say).
            try:
                conn.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self._close(conn)
                return
            if conn.eof:
                self._close(conn)
                return
            conn.closed_at = time.monotonic()
        self._watch(conn)

    def _watch(self, conn):
        """Select on what the connection may still do: send (unless it is at its end), take its reply."""
        events = (0 if conn.eof else selectors.EVENT_READ) | (selectors.EVENT_WRITE if conn.outbuf else 0)
        if events and conn.watched:
            self.sel.modify(conn.sock, events, conn)
        elif events:
            self.sel.register(conn.sock, events, conn)
        elif conn.watched:
            self.sel.unregister(conn.sock)
        conn.watched = bool(events)

    def _close(self, conn):
        fd = conn.sock.fileno()
        if fd in self.conns:
            del self.conns[fd]
            if conn.watched:
                self.sel.unregister(conn.sock)
                conn.watched = False
        conn.sock.close()
        if conn.check is not None:  # closed for a fault or a timeout: nothing is queued
            self._end_check(conn)

    # -- requests ------------------------------------------------------------------------------
    def _handle(self, conn, line):
        try:
            try:
                req = json.loads(line)
            except (ValueError, RecursionError):
                raise RequestError("a request is one line of JSON") from None
            if not isinstance(req, dict):
                raise RequestError("a request is a JSON object")
            op = req.pop("op", None)
            handler = getattr(self, f"op_{op}", None) if isinstance(op, str) and op.isidentifier() else None
            if handler is None:
                raise RequestError(f"unknown request {_printable(str(op), 40)!r}")
            handler(conn, req)
        except ValueError as exc:  # RequestError, ParamsError
            self._reply(conn, {"error": _printable(str(exc).splitlines()[0] if str(exc) else type(exc).__name__)})
        except Exception as exc:  # a request must never take the service down
            self.say(f"request from uid {conn.uid} failed: {traceback.format_exc()}")
            self._reply(conn, {"error": f"request refused: {type(exc).__name__}"})

    @staticmethod
    def _fields(req, spec):
        """``req``'s fields checked against ``spec`` {name: (type, default)}: unknown or mistyped ones refused."""
        unknown = set(req) - set(spec)
        if unknown:
            raise RequestError(f"unknown field {_printable(sorted(unknown)[0], 40)!r}")
        out = {}
        for name, (kind, default) in spec.items():
            value = req.get(name, default)
            if value is _REQUIRED:
                raise RequestError(f"{name}: required")
            if value is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
                kinds = kind if isinstance(kind, tuple) else (kind,)
                raise RequestError(f"{name}: expected {' or '.join(k.__name__ for k in kinds)}, "
                                   f"got {type(value).__name__}")
            out[name] = value
        return out

    def _job_of(self, conn, job_id):
        job = self.store.get(job_id) if -2**63 <= job_id < 2**63 else None
        if job is None or (conn.uid != 0 and job["uid"] != conn.uid):
            raise RequestError(f"no job {job_id} of yours (user {_user(conn.uid)})")
        return job

    def op_status(self, conn, req):
        self._fields(req, {})
        counts = {}
        for job in self.store.jobs(states=ACTIVE):
            counts[job["state"]] = counts.get(job["state"], 0) + 1
        self._reply(conn, {"pid": os.getpid(), "user": _user(self.owner), "num_csx": self.num_csx,
                           "free_csx": self.num_csx - self._busy(), "cores": self.cores,
                           "queued": counts.get("queued", 0), "running": counts.get("running", 0),
                           "socket": str(self.socket_path), "state_dir": str(self.state_dir),
                           "stopping": self.stopping})

    def op_submit(self, conn, req):
        """Check what can be checked here, then the params in a child as the caller (``_read_check``)."""
        f = self._fields(req, {"params": (dict, _REQUIRED), "cwd": (str, _REQUIRED), "max_restarts": (int, 0),
                               "priority": (int, 0), "name": (str, "job"), "numerics": (dict, None)})
        if self.stopping:
            raise RequestError("the appliance is stopping; submit again once it has been started")
        if self.owner != 0 and conn.uid != self.owner:
            raise RequestError(f"this appliance serves only user {_user(self.owner)}; start your own with "
                               "`wse appliance start`")
        try:
            account = pwd.getpwuid(conn.uid)
        except KeyError:
            raise RequestError(f"uid {conn.uid} has no account on this machine") from None
        if not 0 <= f["max_restarts"] <= 100:
            raise RequestError(f"max_restarts: expected 0..100, got {f['max_restarts']}")
        if not -1000 <= f["priority"] <= 1000:
            raise RequestError(f"priority: expected -1000..1000, got {f['priority']}")
        if f["priority"] > 0 and conn.uid not in (0, self.owner):
            raise RequestError("priority: above 0 only for root (you may lower a job's priority, not raise it)")
        f["name"] = _printable(f["name"], 64).strip() or "job"
        f["cwd"] = _path(f["cwd"], "cwd")
        if f["numerics"] is not None:  # None: a client of an earlier version, which sent none
            check_numerics(f["numerics"])
        self._start_check(conn, f, account)

    def _start_check(self, conn, fields, account):
        """Fork a child that validates the params and plans the job as the caller, limited in CPU and memory:
        no params, however built, can take the service's time or memory."""
        checks = [c.check for c in self.conns.values() if c.check is not None]
        if sum(c.account.pw_uid == account.pw_uid for c in checks) >= MAX_CHECKS_PER_USER or len(checks) >= MAX_CHECKS:
            raise RequestError("too many submissions being checked at once; submit again in a moment")
        r, w = os.pipe()
        service = os.getpid()
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            raise
        if pid == 0:  # the child: everything under the finally, which never returns
            out = {"error": "the params check failed"}
            try:
                signal.set_wakeup_fd(-1)  # the service's wakeup pipe, sockets and files are not the child's
                for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
                    signal.signal(sig, signal.SIG_DFL)
                os.closerange(3, w)
                os.closerange(w + 1, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
                die_with_parent(signal.SIGKILL)  # a service killed takes its checks along
                if os.getppid() != service:
                    raise RuntimeError("the appliance ended")
                if self.owner == 0 and account.pw_uid != 0:
                    os.setgroups(os.getgrouplist(account.pw_name, account.pw_gid))
                    os.setgid(account.pw_gid)
                    os.setuid(account.pw_uid)
                resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
                resource.setrlimit(resource.RLIMIT_CPU, (CHECK_SECONDS, CHECK_SECONDS))
                limit = _mapped_bytes() + CHECK_MEMORY  # beyond what the service had mapped already
                resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                out = self._check_params(fields["params"])
            except MemoryError:
                out = {"error": f"the params check needed more than its {CHECK_MEMORY >> 30} GiB of memory"}
            except BaseException as exc:
                out = {"error": (str(exc).splitlines() or [type(exc).__name__])[0] or type(exc).__name__}
            finally:
                try:
                    data = json.dumps(out).encode()
                    while data:
                        data = data[os.write(w, data):]
                finally:
                    os._exit(0)
        os.close(w)
        os.set_blocking(r, False)
        conn.check = _Check(pid, r, fields, account, _umask_of(conn.pid))
        self.sel.register(r, selectors.EVENT_READ, conn)

    def _check_params(self, raw):
        """In the checker child: the validated params and what the service needs of them, or the error."""
        import warnings

        from mpi_launch.mpiexec import check_capacity
        from mpi_launch.plan import plan_for
        from pyapi.params import validate

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the submitter's own check showed them
            spec = validate(raw)
        r = spec.runconfig
        if r.num_csx > self.num_csx:
            return {"error": f"runconfig.num_csx: {r.num_csx} CS-2s asked, the appliance has {self.num_csx}"}
        check_capacity(plan_for(spec)[0], cores=self._cores_for(r.num_csx))
        return {"params": spec.to_dict(), "num_csx": r.num_csx, "max_steps": r.max_steps,
                "model_dir": str(r.model_dir)}

    def _read_check(self, conn):
        check = conn.check
        try:
            chunk = os.read(check.fd, 65536)
        except BlockingIOError:
            return
        if chunk:
            check.buf += chunk
            if len(check.buf) <= 4 * MAX_LINE:
                return
        self._end_check(conn)
        try:
            out = json.loads(check.buf)
        except ValueError:
            out = {"error": "the params check ended without an answer (its CPU or memory limit?)"}
        try:
            if "error" in out:
                raise RequestError(str(out["error"]))
            self._queue(conn, check, out)
        except ValueError as exc:
            self._reply(conn, {"error": _printable(str(exc))})
        except Exception as exc:  # the submitter gets its line whatever went wrong here
            self.say(f"a submission of uid {conn.uid} failed: {traceback.format_exc()}")
            self._reply(conn, {"error": f"request refused: {type(exc).__name__}"})

    def _end_check(self, conn):
        check, conn.check = conn.check, None
        self.sel.unregister(check.fd)
        os.close(check.fd)
        try:
            os.kill(check.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.zombies.append(check.pid)  # reaped without waiting (a child in D state must not stop the loop)
        self._reap_zombies()

    def _reap_zombies(self):
        for pid in list(self.zombies):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == 0:
                    continue
            except ChildProcessError:
                pass
            self.zombies.remove(pid)

    def _queue(self, conn, check, checked):
        f, account = check.fields, check.account
        model_dir = _path(checked["model_dir"], "runconfig.model_dir")
        for other in self.store.jobs(uid=account.pw_uid, states=ACTIVE):
            if other["model_dir"] == model_dir:
                raise RequestError(f"runconfig.model_dir: {model_dir} is the model_dir of your job {other['id']} "
                                   f"({other['state']}); use another")
        job_id = self.store.add(uid=account.pw_uid, gid=account.pw_gid, user=account.pw_name, name=f["name"],
                                params=checked["params"], cwd=f["cwd"], umask=check.umask, model_dir=model_dir,
                                num_csx=checked["num_csx"], max_steps=checked["max_steps"], priority=f["priority"],
                                max_restarts=f["max_restarts"], numerics=f["numerics"])
        self.say(f"job {job_id}: submitted by {account.pw_name}: {checked['num_csx']} CS-2s, {model_dir}")
        self._guarded("scheduling", self.schedule)
        self._reply(conn, {"job": self._public(self.store.get(job_id))})

    def op_jobs(self, conn, req):
        self._fields(req, {})
        jobs = self.store.jobs(uid=None if conn.uid == 0 else conn.uid)
        self._reply(conn, {"jobs": [self._public(j) for j in jobs]})

    def op_job(self, conn, req):
        f = self._fields(req, {"id": (int, _REQUIRED)})
        self._reply(conn, {"job": self._public(self._job_of(conn, f["id"]))})

    def op_cancel(self, conn, req):
        f = self._fields(req, {"id": (int, _REQUIRED)})
        job = self._job_of(conn, f["id"])
        who = _user(conn.uid)
        if job["state"] in ENDED:
            raise RequestError(f"job {job['id']} has already ended ({job['state']})")
        if job["state"] == "queued":
            self._end(job, "cancelled", f"cancelled by {who} while queued")
            self._guarded("scheduling", self.schedule)  # it may have been holding the pool
        elif job["id"] not in self.cancelling:
            self.cancelling[job["id"]] = who
            self._signal_runner(job["id"], signal.SIGTERM)
            self.say(f"job {job['id']}: cancel asked by {who}; its ranks are being stopped")
        self._reply(conn, {"job": self._public(self.store.get(job["id"]))})

    def op_logs(self, conn, req):
        f = self._fields(req, {"id": (int, _REQUIRED), "follow": (bool, False)})
        job = self._job_of(conn, f["id"])
        conn.follow = (job["id"], 0, codecs.getincrementaldecoder("utf-8")("replace"), f["follow"])
        self._pump_log(conn)

    def op_wait(self, conn, req):
        f = self._fields(req, {"id": (int, _REQUIRED), "timeout": ((int, float), None)})
        job = self._job_of(conn, f["id"])
        deadline = None if f["timeout"] is None else time.monotonic() + f["timeout"]
        conn.wait = (job["id"], deadline)
        self._check_wait(conn)

    def op_stop(self, conn, req):
        self._fields(req, {})
        if conn.uid not in (0, self.owner):
            raise RequestError("only root may stop this appliance" if self.owner == 0 else
                               f"only {_user(self.owner)} or root may stop this appliance")
        self._reply(conn, {"stopping": True, "running": len(self.procs), "pid": os.getpid()})
        self.begin_stop(f"asked by {_user(conn.uid)}")

    # -- what a job record shows ---------------------------------------------------------------
    def _public(self, job):
        keys = ("id", "name", "user", "state", "num_csx", "priority", "max_restarts", "restarts", "max_steps",
                "model_dir", "submitted", "started", "ended", "reason", "step", "loss", "sim_seconds")
        out = {k: job[k] for k in keys}
        out.update(self.progress.get(job["id"], {}))
        out["step"] = out["step"] or 0
        out["wall_seconds"] = None if job["started"] is None else (job["ended"] or time.time()) - job["started"]
        return out

    def _read_progress(self, p):
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
            if p is None or self._read_progress(p):
                break
        self._close_progress(job_id)

    # -- scheduling ----------------------------------------------------------------------------
    def _busy(self):
        return sum(j["num_csx"] for j in self.store.jobs(states=("running",)))

    def _cores_for(self, num_csx):
        """A job's share of this machine's cores: as its share of the CS-2 pool."""
        return max(1, self.cores * num_csx // self.num_csx)

    def schedule(self):
        """Start what the queue and the free CS-2s allow (again if a job could not start: its CS-2s are free).

        An error of the machine (out of descriptors, processes, memory, disk) leaves the job queued
        and the next start RETRY_SECONDS later; only an error of the job's own fails it.
        """
        self.retry_at = None
        while not self.stopping:
            starts, overtaken = pick(self.store.queue(), self.num_csx - self._busy())
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
        attempt = job["restarts"] + 1
        cores = self._cores_for(job["num_csx"])
        orders = {"params": job["params"], "cores": cores, "cwd": job["cwd"], "appliance_pid": os.getpid()}
        progress_r, progress_w = os.pipe()  # EMFILE here is transient: schedule() tries again
        try:
            env = {"PATH": f"{Path(sys.executable).parent}:/usr/local/bin:/usr/bin:/bin"}
            as_user = {}
            if self.owner == 0 and job["uid"] != 0:
                account = pwd.getpwuid(job["uid"])
                env.update({k: v for k, v in os.environ.items() if k in _ENV_KEEP or k.startswith(_ENV_PREFIXES)})
                env.update(HOME=account.pw_dir, USER=account.pw_name, LOGNAME=account.pw_name,
                           SHELL=account.pw_shell)
                as_user = {"user": job["uid"], "group": job["gid"],
                           "extra_groups": os.getgrouplist(account.pw_name, job["gid"])}
            else:  # the service's own user: their environment, as they started the service
                env = {k: v for k, v in os.environ.items() if k != SOCKET_ENV}
            if job["numerics"] is not None:  # the submitting shell's numerics, not the service's: `wse fit`'s bits
                env = {k: v for k, v in env.items() if not is_numerics_variable(k)}
                env.update(job["numerics"])
            orders["progress_fd"] = progress_w
            with open(self.logs_dir / f"job_{job['id']}.log", "ab") as log, tempfile.TemporaryFile() as stdin:
                log.write(f"== {time.strftime('%Y-%m-%d %H:%M:%S')} job {job['id']} attempt {attempt}: "
                          f"{job['num_csx']} CS-2s, {cores} core(s), user {job['user']}, in {job['cwd']}\n".encode())
                log.flush()
                stdin.write(json.dumps(orders).encode())  # a file: writing it never waits on the runner
                stdin.seek(0)
                # cwd "/": the runner enters the job's directory itself, as the user, after Python has
                # set its import path (-P: nor is that directory put on it).
                proc = subprocess.Popen([sys.executable, *_SAFE_PATH, "-u", "-m", "mpi_launch.appliance.runner"],
                                        stdin=stdin, stdout=log, stderr=subprocess.STDOUT, cwd="/", env=env,
                                        umask=job["umask"], start_new_session=True, pass_fds=(progress_w,),
                                        **as_user)
        except (OSError, ValueError, KeyError, subprocess.SubprocessError) as exc:
            os.close(progress_r)
            os.close(progress_w)
            if isinstance(exc, OSError) and exc.errno in _TRANSIENT:
                raise
            self._end(job, "failed", f"cannot start as {job['user']}: {exc}")
            return False
        os.close(progress_w)
        os.set_blocking(progress_r, False)
        self.pipes[job["id"]] = _Progress(job["id"], progress_r)
        self.sel.register(progress_r, selectors.EVENT_READ, self.pipes[job["id"]])
        self.procs[job["id"]] = proc
        self.store.update(job["id"], state="running", pid=proc.pid, started=job["started"] or time.time())
        self.say(f"job {job['id']}: attempt {attempt} started (runner pid {proc.pid}, {cores} core(s))")
        return True

    def _end(self, job, state, reason):
        p = self.progress.pop(job["id"], {})
        self.store.update(job["id"], state=state, ended=time.time(), pid=None, reason=reason, **p)
        self.say(f"job {job['id']}: {state}" + (f": {reason}" if reason and state != "done" else ""))

    def _signal_runner(self, job_id, sig):
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
            self._guarded(f"job {job_id}'s progress", self._drain_progress, job_id)
            self._guarded(f"job {job_id}'s end", self._ended, job_id, proc.returncode)
        if changed:
            self._guarded("scheduling", self.schedule)

    def _ended(self, job_id, code):
        job = self.store.get(job_id)
        line = self._last_line(job_id)
        cancelled_by = self.cancelling.pop(job_id, None)
        interrupted = code in (-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM)
        if code == 0:
            self._end(job, "done", job["reason"])  # the last fault it survived, if any
        elif code == EXIT_BAD_INPUT:
            self._end(job, "failed", line)
        elif cancelled_by is not None:
            self._end(job, "cancelled", f"cancelled by {cancelled_by} while running")
        elif self.stopping and interrupted:
            p = self.progress.pop(job_id, {})
            self.store.update(job_id, state="queued", pid=None,
                              reason="interrupted when the appliance stopped; resumes from its latest checkpoint", **p)
        else:
            why = line if code == EXIT_JOB_FAILED else f"its runner ended with {_exit_name(code)}"
            if job["restarts"] >= job["max_restarts"]:
                self._end(job, "failed", why)
                return
            n = job["restarts"] + 1
            self._log(job_id, f"== restart {n} of {job['max_restarts']} from the latest checkpoint after: {why}\n")
            self.say(f"job {job_id}: failed ({why}); restart {n} of {job['max_restarts']}")
            if self.stopping:  # it restarts when the appliance is started again
                self.store.update(job_id, state="queued", pid=None, restarts=n, reason=why,
                                  **self.progress.pop(job_id, {}))
                return
            self.store.update(job_id, restarts=n, reason=why)
            self._start(self.store.get(job_id))

    # -- logs, waits and deadlines -------------------------------------------------------------
    def _log(self, job_id, text):
        with open(self.logs_dir / f"job_{job_id}.log", "a") as f:
            f.write(text)

    def _last_line(self, job_id):
        path = self.logs_dir / f"job_{job_id}.log"
        try:
            with open(path, "rb") as f:
                f.seek(max(0, path.stat().st_size - 4096))
                lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
        except OSError:
            return "its log is missing"
        return _printable(lines[-1].strip(), 1000) if lines else "it printed nothing"

    def _pump_log(self, conn):
        """Send what the log holds beyond what was sent; end the reply at its end, or, when following,
        once the job has ended. A slow reader is served at the next tick."""
        job_id, offset, decoder, follow = conn.follow
        path = self.logs_dir / f"job_{job_id}.log"
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
            self._send(conn, {"data": decoder.decode(data)})
            if conn.sock.fileno() not in self.conns:
                return
        job = self.store.get(job_id)
        if follow and job["state"] not in ENDED:
            return
        conn.follow = None
        self._reply(conn, {"end": self._public(job)})

    def _check_wait(self, conn):
        job_id, deadline = conn.wait
        job = self.store.get(job_id)
        if job["state"] in ENDED:
            conn.wait = None
            self._reply(conn, {"job": self._public(job)})
        elif deadline is not None and time.monotonic() > deadline:
            conn.wait = None
            self._reply(conn, {"error": f"job {job_id} is still {job['state']}"})

    def tick(self):
        now = time.monotonic()
        self._reap_zombies()
        if self.retry_at is not None and now > self.retry_at:
            self._guarded("scheduling", self.schedule)
        if self.accept_paused is not None and now > self.accept_paused and not self.stopping:
            self.accept_paused = None
            self.sel.register(self.listener, selectors.EVENT_READ, "accept")
        for conn in list(self.conns.values()):
            if conn.sock.fileno() not in self.conns:
                continue
            if conn.outbuf and now - conn.sent > IDLE_SECONDS:
                self._close(conn)  # it does not take its reply
            elif conn.check is not None:
                if now - conn.check.started > CHECK_SECONDS + IDLE_SECONDS:
                    self._end_check(conn)
                    self._reply(conn, {"error": f"the params check did not end within {CHECK_SECONDS} s"})
            elif conn.follow is not None:
                self._guarded("a log", self._pump_log, conn)
            elif conn.wait is not None:
                self._guarded("a wait", self._check_wait, conn)
            elif now - (conn.closed_at or conn.opened) > IDLE_SECONDS and (conn.closed_at or not conn.answered):
                self._close(conn)
            elif conn.answered and not conn.close_after and now - conn.opened > IDLE_SECONDS:
                self._close(conn)  # answered, nothing pending, no reply coming (a failure was logged)
        for job_id, deadline in list(self.deadlines.items()):
            if now > deadline and job_id in self.procs:
                # The runner's session: the runner itself. Its ranks end when its watchdog's
                # connections close, which its death does (docs/design.md section 3).
                self.say(f"job {job_id}: its runner did not end within {GRACE_SECONDS:g} s; killed")
                try:
                    os.killpg(self.procs[job_id].pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.deadlines[job_id] = float("inf")


#: Python's -P (3.11+): the runner's import path does not start with a directory anyone chose.
_SAFE_PATH = ("-P",) if sys.version_info >= (3, 11) else ()


def pick(queue, free, max_overtakes=MAX_OVERTAKES):
    """The jobs of ``queue`` (in its order) to start on ``free`` CS-2s, and the ids of the waiting jobs
    each start passes (one id per passing: a job passed twice is listed twice).

    A job that does not fit lets later ones that do start ahead of it, until ``max_overtakes`` have;
    from then on it holds the pool: nothing behind it starts before it does.
    """
    starts, overtaken, waiting = [], [], []
    for job in queue:
        if job["num_csx"] <= free:
            free -= job["num_csx"]
            starts.append(job)
            overtaken += [w["id"] for w in waiting]
        else:
            waiting.append(job)
            if job["overtaken"] + overtaken.count(job["id"]) >= max_overtakes:
                break
    return starts, overtaken


def _exit_name(code):
    if code < 0:
        try:
            return signal.Signals(-code).name
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


#: How the service, started in the background, says why it could not start (its last line in service.log).
_ERROR = "wse appliance: error: "


def start_background(state_dir, socket_path, num_csx, timeout=60.0):
    """Start the service as a daemon (its own session, output in STATE_DIR/service.log); return its pid."""
    state_dir = Path(state_dir).absolute()
    state_dir.mkdir(parents=True, exist_ok=True)
    socket_path = Path(socket_path).absolute() if socket_path else state_dir / SOCKET_NAME
    try:
        running = Client(socket_path).status()
        raise ApplianceError(f"{socket_path}: an appliance already answers there (pid {running['pid']}, "
                             f"{running['num_csx']} CS-2s)")
    except ApplianceError as exc:
        if "already answers" in str(exc):
            raise
    with open(os.open(state_dir / "service.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a") as out:
        proc = subprocess.Popen([sys.executable, *_SAFE_PATH, "-m", "mpi_launch.appliance.service", "--state_dir",
                                 str(state_dir), "--socket", str(socket_path), "--num_csx", str(num_csx)],
                                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True, cwd="/")
    from mpi_launch.appliance.client import wait_for_socket

    if not wait_for_socket(socket_path, proc, timeout):
        if proc.poll() is None:
            proc.kill()
        lines = (state_dir / "service.log").read_text(errors="replace").strip().splitlines()
        # The service's own line, without its prefix: the caller puts its own.
        raise ApplianceError(lines[-1].removeprefix(_ERROR) if lines else
                             f"the appliance did not start (see {state_dir}/service.log)")
    return proc.pid, socket_path


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m mpi_launch.appliance.service")
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
