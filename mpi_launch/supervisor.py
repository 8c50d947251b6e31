"""The rank side of the watchdog: a small parent process that watches one rank and reports to the launcher.

``python -m mpi_launch.run`` calls ``supervise()`` first thing, before any heavy import. When the
launcher asked for supervision (``WSE_CONTROL=host:port:token`` in the environment), the process
connects to the launcher's watchdog, forks, and from then on:

* the child is the rank: it returns from ``supervise()`` and runs its role; it dies with its
  supervisor (``PR_SET_PDEATHSIG``) and tells it how far it got through ``report()`` (a pipe:
  ready, done, or the one-line error it raised);
* the parent is the supervisor: it forwards those reports and what only a parent can see —
  the rank stopped (SIGSTOP, a debugger), continued, or exited, with its exit code or the signal
  that killed it — over one TCP connection to the launcher, each with a timestamp.

Why a parent: only a parent is told how its child died. The launcher cannot be the ranks' parent
(hydra's proxies are), and reading a zombie's status from /proc races with the proxy reaping it.
Why a TCP connection: it works the same across hosts, and its end is a signal both ways. When the
launcher dies or ends the job it closes the connection, and every supervisor kills its rank at
once; when a supervisor vanishes (killed, host lost) the launcher sees the connection end. If the
MPI proxy that started the supervisor dies, the supervisor learns it from its own
``PR_SET_PDEATHSIG``, says so and takes its rank down. See docs/design/faults.md "Supervisors".

The supervisor only sleeps in ``select``: it never spins (docs/design/ranks.md "Never spin while waiting").
"""
import json
import os
import select
import signal
import socket
import sys
import time

from mpi_launch.protocol import RankEvent

CONTROL_ENV = "WSE_CONTROL"
_PR_SET_PDEATHSIG = 1
# What the supervisor receives when its MPI proxy dies: a signal nobody else sends (hydra itself
# sends SIGUSR1 to its processes when one of them exits, for MPICH's fault notification).
_PARENT_GONE = signal.SIGRTMIN + 3
#: Passed on to the rank: termination requests, and hydra's SIGUSR1 (MPICH in the rank handles it).
_FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)
_CONNECT_SECONDS = 30.0
#: Reports longer than this are cut: a pipe write up to PIPE_BUF (4096) bytes is atomic.
_MAX_REPORT = 3000
#: The shared-memory segments MPICH's ranks of one host map (unlinked by MPI_Finalize only).
_SHM_PREFIX = "/dev/shm/mpich_shm_"
#: For tests of what only a moment of a job shows (a launcher killed between MPICH's segment and the
#: rank's report of it): a supervised rank about to report this event stops itself first (SIGSTOP);
#: its supervisor reports the stop as any other, and SIGCONT lets the rank go on.
HOLD_ENV = "WSE_TEST_HOLD"

_report_fd = None  # the child's end of the report pipe, once supervised


def die_with_parent(sig):
    """Ask the kernel to send ``sig`` to this process when its parent dies (Linux; elsewhere a no-op)."""
    import ctypes

    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def report(event, **fields):
    """From the rank: tell the launcher ``event`` (a ``RankEvent``: MPI_UP, READY, DONE, ERROR). A no-op
    when unsupervised. At MPI_UP the supervisor reads the rank's mappings (a rank that fails later,
    even importing its role, has its shared-memory segment) and sends them to the watchdog."""
    if _report_fd is None:
        return
    if os.environ.get(HOLD_ENV) == event:
        os.kill(os.getpid(), signal.SIGSTOP)
    line = json.dumps({"event": event, "time": time.time(), **fields})
    if len(line) > _MAX_REPORT:
        fields = {k: (v[:_MAX_REPORT // 2] + "..." if isinstance(v, str) else v) for k, v in fields.items()}
        line = json.dumps({"event": event, "time": time.time(), **fields})
    try:
        os.write(_report_fd, (line + "\n").encode())
    except OSError:
        pass  # the supervisor is gone: PR_SET_PDEATHSIG is about to end this process


def supervised():
    return _report_fd is not None


def supervise():
    """Fork a supervisor if the launcher asked for one; return in the rank (child) process only."""
    global _report_fd
    control = os.environ.pop(CONTROL_ENV, None)  # not inherited by anything the rank starts
    if not control:
        return
    host, port, token = control.rsplit(":", 2)
    rank = int(os.environ.get("PMI_RANK", "-1"))
    sock = _connect(host, int(port), rank)
    read_end, write_end = os.pipe()
    supervisor_pid = os.getpid()
    child = os.fork()
    if child == 0:
        sock.close()
        os.close(read_end)
        die_with_parent(signal.SIGKILL)
        if os.getppid() != supervisor_pid:  # the supervisor died before the line above took effect
            os._exit(1)
        _report_fd = write_end
        return
    os.close(write_end)
    # The rank talks to its MPI proxy through PMI_FD; the supervisor's copy would keep that
    # socket open after the rank died and delay the proxy's view of the death.
    pmi_fd = os.environ.get("PMI_FD")
    if pmi_fd and pmi_fd.isdigit():
        try:
            os.close(int(pmi_fd))
        except OSError:
            pass
    code = Supervisor(sock, token, rank, child, read_end).run()
    sys.stdout.flush()
    os._exit(code)


def _connect(host, port, rank):
    """Connect to the launcher's watchdog, retrying while it may still be starting to listen."""
    deadline = time.monotonic() + _CONNECT_SECONDS
    while True:
        try:
            return socket.create_connection((host, port), timeout=5)
        except OSError as exc:
            if time.monotonic() > deadline:
                sys.stderr.write(f"rank {rank}: cannot reach the launcher's watchdog at {host}:{port} "
                                 f"({exc.strerror or exc}); not starting\n")
                os._exit(1)
            time.sleep(0.2)


class Supervisor:
    """The parent's loop: one ``select`` over the launcher's connection, the rank's reports and signals."""

    def __init__(self, sock, token, rank, child, reports):
        self.sock, self.rank, self.child, self.reports = sock, rank, child, reports
        self.shm = set()  # MPICH's shared-memory files the rank mapped (read once MPI is up)
        self.sock.settimeout(None)
        self.buffer = b""
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        for sig in (signal.SIGCHLD, _PARENT_GONE, *_FORWARDED):
            signal.signal(sig, lambda *_: None)  # the wakeup fd carries the signal number
        self.parent = os.getppid()
        die_with_parent(_PARENT_GONE)
        self.send({"event": RankEvent.HELLO, "token": token, "pid": child, "supervisor": os.getpid(),
                   "proxy": self.parent, "host": socket.gethostname()})

    def send(self, message):
        message.setdefault("time", time.time())
        message["rank"] = self.rank
        try:
            self.sock.sendall((json.dumps(message) + "\n").encode())
        except OSError:
            pass  # the launcher is gone; its end of the connection already told us

    def forward_reports(self):
        """Send on what the rank wrote; return False at the end of the pipe (the rank has closed it)."""
        try:
            chunk = os.read(self.reports, 65536)
        except BlockingIOError:
            return True
        if not chunk:
            return False
        self.buffer += chunk
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if message.get("event") == RankEvent.MPI_UP:  # the host's segment is mapped: the launcher learns it too
                self.shm = _shm_files(self.child)
                message["shm"] = sorted(self.shm)
            self.send(message)
        return True

    def run(self):
        """Watch until the rank exits; return the exit code the supervisor should give its own parent."""
        status = self.poll_child()
        watched = [self.sock, self.reports, self.wake_r]
        while status is None:
            ready, _, _ = select.select(watched, [], [])
            if self.reports in ready and not self.forward_reports():
                watched.remove(self.reports)
            if self.sock in ready:
                try:
                    data = self.sock.recv(4096)
                except OSError:
                    data = b""
                if not data:  # the launcher ended the job or died: the rank goes too
                    self._kill(signal.SIGKILL)
                    watched.remove(self.sock)
            if self.wake_r in ready:
                for sig in os.read(self.wake_r, 512):
                    if sig in _FORWARDED:
                        self._kill(sig, resume=sig != signal.SIGUSR1)
                    elif sig == _PARENT_GONE and os.getppid() != self.parent:
                        self.send({"event": RankEvent.PROXY_LOST})
                        self._kill(signal.SIGKILL)
                status = self.poll_child()
        # The rank is gone: what it wrote last (its error line) goes out before its exit.
        os.set_blocking(self.reports, False)
        while self.forward_reports() and select.select([self.reports], [], [], 0)[0]:
            pass
        if not (os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0):
            _unlink(self.shm)
        if os.WIFSIGNALED(status):
            sig = os.WTERMSIG(status)
            self.send({"event": RankEvent.EXIT, "signal": sig})
            self.sock.close()
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass  # SIGKILL has no handler to reset
            os.kill(os.getpid(), sig)  # die the same way, so hydra sees what happened to the rank
            return 128 + sig
        code = os.WEXITSTATUS(status)
        self.send({"event": RankEvent.EXIT, "code": code})
        self.sock.close()
        return code

    def poll_child(self):
        """Report stops and continues; return the wait status once the rank has exited, else None."""
        while True:
            try:
                pid, status = os.waitpid(self.child, os.WNOHANG | os.WUNTRACED | os.WCONTINUED)
            except ChildProcessError:
                return 0
            if pid == 0:
                return None
            if os.WIFSTOPPED(status):
                self.send({"event": RankEvent.STOPPED, "signal": os.WSTOPSIG(status)})
            elif os.WIFCONTINUED(status):
                self.send({"event": RankEvent.CONTINUED})
            else:
                return status

    def _kill(self, sig, resume=True):
        # A rank killed before it reported MPI_UP has its segment all the same (the launcher killed
        # during start-up): what it maps is read while it still maps it, and removed once it is gone.
        self.shm |= _shm_files(self.child)
        try:
            os.kill(self.child, sig)
            if resume and sig != signal.SIGKILL:
                os.kill(self.child, signal.SIGCONT)  # a stopped rank would not act on SIGTERM
        except ProcessLookupError:
            pass


def _shm_files(pid):
    """The MPICH shared-memory files process ``pid`` maps (none if it is gone)."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            paths = {line.split(maxsplit=5)[-1].strip() for line in f}
    except OSError:
        return set()
    return {p for p in paths if p.startswith(_SHM_PREFIX) and not p.endswith("(deleted)")}


def _unlink(paths):
    """Remove the shared-memory files of a rank that did not finish: only MPI_Finalize unlinks them,
    so every killed or failed job left one per host in /dev/shm (7.4 MB each, 25 after one test
    suite, held in memory until reboot). The host's other ranks keep their mappings."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass  # another rank's supervisor was first, or the rank finalized after all
