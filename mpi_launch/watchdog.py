"""The launcher side of fault handling: watch a job's ranks, end the job on the first fault, name that fault.

Every rank runs under a supervisor (mpi_launch.supervisor) that holds a TCP connection to the
``Watchdog`` here and reports, with a timestamp: hello (the rank's pid and host), ready, done, an
error the rank raised, the rank stopped or continued, and how it exited. The watchdog turns them
into incidents and ends the job on the first fault:

* a rank that raised an error, exited without finishing, or was killed (with its signal) —
  also after it finished its work, and on any host;
* a rank stopped (SIGSTOP, a debugger) for ``peer_timeout`` seconds, or stopped while a peer
  timed out waiting;
* a rank that lost its supervisor or its MPI proxy (``hydra_pmi_proxy`` killed, a host lost);
  ``mpiexec`` killed, which takes every proxy and supervisor with it, is named instead;
* start-up: a rank not ready within ``startup_timeout`` of the launch;
* shutdown: a rank still running ``peer_timeout`` seconds after the coordinator finished;
* a peer timeout (a rank waited too long for a peer) when nothing above explains it.

When several incidents come close together, the cause is the earliest that came from outside the
job (a signal another process sent: SIGKILL, SIGTERM, ..., a stop, a lost proxy), else the earliest
by the supervisors' clocks: a rank can crash (SIGSEGV, SIGABRT, an error) because a peer died, and
on a loaded machine its supervisor may report first, but nothing in the job sends a SIGKILL.
Errors that only report a lost peer (``PeerLost``/``PeerTimeout``) are echoes.
Ending the job closes every supervisor's connection (each kills its rank) and kills mpiexec's
process group; a launcher that dies closes them just the same, so no rank outlives it.
``launch`` (mpi_launch.launcher) runs mpiexec under a Watchdog. See docs/design/faults.md "The watchdog".
"""
import json
import os
import secrets
import selectors
import signal
import socket
import threading
import time
from dataclasses import dataclass, field

from mpi_launch.protocol import RankEvent
from mpi_launch.supervisor import CONTROL_ENV

#: Seconds to wait after an incident for others from the same moment, so the earliest is named.
SETTLE_SECONDS = 0.3
#: Seconds to wait after a peer's timeout or lost peer for the incident it echoes.
ECHO_SECONDS = 2.0
#: Signals only another process sends (a user, a scheduler, the OOM killer): never a consequence of
#: a peer's death, unlike SIGSEGV, SIGBUS, SIGABRT or SIGPIPE, which a lost connection can cause.
EXTERNAL_SIGNALS = {signal.SIGKILL, signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT,
                    signal.SIGUSR2, signal.SIGALRM}


def signame(sig):
    """A signal's name (``SIGKILL``), or ``signal N`` for a number with none."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _alive(pid):
    """Whether process ``pid`` is running (a zombie has exited: only its parent's wait is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


@dataclass
class RankState:
    pid: int = None
    host: str = None
    processes: tuple = ()         # the rank's, its supervisor's and hydra's proxy's pids on its host
    ready: bool = False
    done: bool = False
    stopped_at: float = None      # supervisor time of the stop, while stopped
    stop_signal: int = None
    exited: bool = False
    connected: bool = False
    reported: bool = False        # an incident about this rank's silence is on record
    shm: tuple = ()               # MPICH's shared-memory files the rank mapped on its host


@dataclass(order=True)
class Incident:
    time: float
    primary: bool = field(compare=False)  # a cause; False for an echo (a peer's timeout or lost peer)
    rank: int = field(compare=False)
    line: str = field(compare=False)
    external: bool = field(compare=False, default=False)  # came from outside the job (see EXTERNAL_SIGNALS)


class Watchdog:
    """Listens for the ranks' supervisors, keeps what they report, and ends the job at the first fault."""

    def __init__(self, plan, *, peer_timeout, startup_timeout, hostfile=None, log=None, on_ready=None):
        self.plan, self.log = plan, log
        self.log_error = None        # the OSError, naming the log, that stopped the record (a full disk)
        self.on_ready = on_ready     # called once, with the seconds since start, when every rank is ready
        self.peer_timeout, self.startup_timeout = float(peer_timeout), float(startup_timeout)
        self.token = secrets.token_hex(16)
        self.host = "127.0.0.1" if hostfile is None else _reachable_address(hostfile)
        self.listener = socket.create_server(("127.0.0.1" if hostfile is None else "", 0), backlog=1024)
        self.port = self.listener.getsockname()[1]
        self.ranks = {r: RankState() for r in range(plan.world_size)}
        self._roles = plan.roles()   # (role, index) of each rank, made once: a fault names its rank from it
        self.incidents = []
        self.verdict = None          # the one line, once the job has been ended for a fault
        self.ended_at = None         # time.time() when the job was ended (faults after it are casualties)
        self.proc = None
        self._lock = threading.Lock()
        self._conns = {}             # socket -> rank (None until its hello)
        self._buffers = {}
        self._wake_r, self._wake_w = os.pipe()
        self._started = None
        self._coordinator_done = None
        self._thread = None

    # -- what the launcher calls ---------------------------------------------------------------
    def env(self):
        return {CONTROL_ENV: f"{self.host}:{self.port}:{self.token}"}

    def start(self, proc):
        self.proc, self._started = proc, time.time()
        self._thread = threading.Thread(target=self._loop, name="wse-watchdog", daemon=True)
        self._thread.start()

    def end(self, line=None):
        """End the job now: every supervisor kills its rank, and mpiexec's process group is killed."""
        with self._lock:
            if self.ended_at is None:
                self.ended_at = time.time()
                if line is not None and self.verdict is None:
                    self.verdict = line
        os.write(self._wake_w, b"e")  # the watching thread closes the connections: each supervisor kills its rank
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def conclude(self):
        """mpiexec has exited: let reports still on their way arrive, and name the fault if there was one."""
        deadline = time.time() + ECHO_SECONDS
        while time.time() < deadline:
            with self._lock:
                if self.verdict is not None or (not self.incidents and all(s.exited or not s.connected
                                                                           for s in self.ranks.values())):
                    break
                if self._decide_at is not None and time.time() >= self._decide_at:
                    break
            time.sleep(0.05)
        with self._lock:
            cause = self._cause()
            if self.verdict is None and cause is not None:
                self.verdict = cause.line
        return self.verdict

    def _cause(self):
        """The incident that explains the others (None if nothing happened)."""
        killed = self._mpiexec_killed()
        if killed is not None:
            return killed
        if not self.incidents:
            return None
        primaries = sorted((i for i in self.incidents if i.primary), key=lambda i: (not i.external, i.time))
        return primaries[0] if primaries else min(self.incidents)

    def _mpiexec_killed(self):
        """mpiexec killed by a signal from outside (the watchdog ends a job by killing it too, but
        after ``ended_at`` is set): its proxies then kill every process they started, and the
        supervisors' lost connections that follow are the echo, not the cause. Their incidents come
        after mpiexec has died, so by the time one is decided its exit status is there."""
        code = self.proc.poll() if self.proc is not None and self.ended_at is None else None
        if code is None or code >= 0:
            return None
        return Incident(time.time(), True, None, f"mpiexec (pid {self.proc.pid}) was killed by signal {-code} "
                                                 f"({signame(-code)}); its MPI proxies ended every rank", external=True)

    def remove_shared_memory(self):
        """The job is over: remove the MPICH shared-memory files its ranks on this host mapped. Only
        MPI_Finalize removes them, so a job ended by a fault (the ranks and their supervisors killed
        together) left 7.4 MB of memory per host in /dev/shm until a reboot. Other hosts' supervisors
        remove theirs when their rank dies before them."""
        here = socket.gethostname()
        for path in {p for s in self.ranks.values() if s.host == here for p in s.shm}:
            try:
                os.unlink(path)
            except OSError:
                pass  # removed by MPI_Finalize or by a supervisor

    def wait_gone(self, timeout):
        """The job is over and its connections closed: wait (at most ``timeout`` s, in sleeps) until
        the processes of its ranks on this host have exited, so that a caller who looks finds nothing
        of the job running. A supervisor kills its rank when its connection closes; a loaded machine
        takes a moment to carry that out after mpiexec has gone."""
        here = socket.gethostname()
        pids = {p for s in self.ranks.values() if s.host == here for p in s.processes}
        deadline = time.monotonic() + timeout
        while pids and time.monotonic() < deadline:
            pids = {p for p in pids if _alive(p)}
            if pids:
                time.sleep(0.02)

    def stop(self):
        """The job is over: stop the watching thread and release the port."""
        os.write(self._wake_w, b"q")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for conn in list(self._conns):
            self._close(conn)
        self.listener.close()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def hosts(self):
        return sorted({s.host for s in self.ranks.values() if s.host})

    # -- the watching thread -------------------------------------------------------------------
    def _loop(self):
        sel = selectors.DefaultSelector()
        sel.register(self.listener, selectors.EVENT_READ)
        sel.register(self._wake_r, selectors.EVENT_READ)
        while True:
            timeout = self._next_deadline()
            events = sel.select(None if timeout is None else max(0.0, timeout - time.time()))
            for key, _ in events:
                if key.fileobj is self._wake_r:
                    wake = os.read(self._wake_r, 64)
                    if b"e" in wake:
                        for conn in list(self._conns):
                            sel.unregister(conn)
                            self._close(conn)
                    if b"q" in wake:
                        sel.close()
                        return
                    continue
                if key.fileobj is self.listener:
                    try:
                        conn, _ = self.listener.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self._conns[conn], self._buffers[conn] = None, b""
                    sel.register(conn, selectors.EVENT_READ)
                else:
                    self._receive(key.fileobj, sel)
            self._check_timers()

    def _receive(self, conn, sel):
        if conn not in self._conns:  # closed while this event was pending
            return
        try:
            data = conn.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        rank = self._conns.get(conn)
        if not data:
            sel.unregister(conn)
            self._close(conn)
            if rank is not None and not self.ranks[rank].exited:
                self._incident(time.time(), True, rank, "lost its supervisor process (killed, or its host is "
                                                      "unreachable)", external=True)
            return
        self._buffers[conn] += data
        *lines, self._buffers[conn] = self._buffers[conn].split(b"\n")
        for line in lines:
            try:
                msg = json.loads(line)
            except ValueError:
                continue
            if rank is None:  # the first message says who this is, with the job's token
                if (msg.get("event") != RankEvent.HELLO or msg.get("token") != self.token
                        or msg.get("rank") not in self.ranks):
                    sel.unregister(conn)
                    self._close(conn)
                    return
                rank = self._conns[conn] = msg["rank"]
            self._event(rank, msg)

    def _close(self, conn):
        self._conns.pop(conn, None)
        self._buffers.pop(conn, None)
        try:
            conn.close()
        except OSError:
            pass

    def _event(self, rank, msg):
        s, kind, t = self.ranks[rank], msg.get("event"), float(msg.get("time", time.time()))
        if self.log is not None:
            try:
                self.log.write(json.dumps({k: v for k, v in msg.items() if k != "token"}) + "\n")
                self.log.flush()
            except OSError as exc:  # the record stops there; the watching must not (a full disk ended it)
                self.log_error, self.log = OSError(exc.errno, exc.strerror, getattr(self.log, "name", "")), None
        if kind == RankEvent.HELLO:
            s.pid, s.host, s.connected = msg.get("pid"), msg.get("host"), True
            s.processes = tuple(p for p in (msg.get("pid"), msg.get("supervisor"), msg.get("proxy")) if p)
        elif kind == RankEvent.MPI_UP:
            s.shm = tuple(msg.get("shm", ()))
        elif kind == RankEvent.READY:
            s.ready = True
            if self.on_ready is not None and all(x.ready for x in self.ranks.values()):
                on_ready, self.on_ready = self.on_ready, None
                on_ready(time.time() - self._started)
        elif kind == RankEvent.DONE:
            s.done = True
            if rank == self.plan.coordinator:
                self._coordinator_done = time.time()
        elif kind == RankEvent.ERROR:
            primary = msg.get("kind") != "peer"
            self._incident(t, primary, rank, msg.get("line", "failed"), named=True)
            if not primary:  # a peer gave up waiting: a stopped rank is the reason
                for r, other in self.ranks.items():
                    if other.stopped_at is not None and not other.done:
                        self._stopped_incident(r, t)
        elif kind == RankEvent.STOPPED:
            s.stopped_at, s.stop_signal = t, msg.get("signal")
        elif kind == RankEvent.CONTINUED:
            s.stopped_at = None
        elif kind == RankEvent.PROXY_LOST:
            self._incident(t, True, rank, f"its MPI process manager (hydra_pmi_proxy) on {s.host} died",
                           external=True)
        elif kind == RankEvent.EXIT:
            s.exited = True
            if "signal" in msg:
                sig = msg["signal"]
                after = " after finishing its work" if s.done else ""
                self._incident(t, True, rank, f"the process died (killed by signal {sig} ({signame(sig)})){after}",
                               external=sig in EXTERNAL_SIGNALS)
            elif msg.get("code") != 0:
                self._incident(t, True, rank, f"the process exited with code {msg.get('code')}", quiet=True)
            elif not s.done:
                self._incident(t, True, rank, "the process exited (code 0) before finishing its work")

    def _stopped_incident(self, rank, t):
        s = self.ranks[rank]
        if s.reported:
            return
        s.reported = True
        self._incident(t, True, rank, f"stopped answering: its process has been stopped ({self._stop_name(s)}) "
                                      f"for {max(0.0, t - s.stopped_at):.0f} s", stamp=s.stopped_at, external=True)

    @staticmethod
    def _stop_name(s):
        return signame(s.stop_signal) if s.stop_signal else "a signal"

    def _incident(self, t, primary, rank, text, named=False, quiet=False, stamp=None, external=False):
        """Record a fault. ``named``: ``text`` already starts with the rank; ``quiet``: only a cause
        if the rank reported no error of its own (its exit code then just follows that error)."""
        if quiet and any(i.rank == rank for i in self.incidents):
            return
        if not named:
            role, index = self._roles[rank]
            where = f" on {self.ranks[rank].host}" if len(self.hosts()) > 1 and self.ranks[rank].host else ""
            text = f"rank {rank} ({role} {index}){where}: {text}"
        with self._lock:
            if self.ended_at is not None and t > self.ended_at:
                return  # a casualty of ending the job
            # Ordered by when the fault happened: a stop counts from the moment the rank stopped.
            self.incidents.append(Incident(t if stamp is None else stamp, primary, rank, text, external))
            if self._decide_at is None or (primary and self._decide_at > time.time() + SETTLE_SECONDS):
                self._decide_at = time.time() + (SETTLE_SECONDS if primary else ECHO_SECONDS)

    _decide_at = None
    _startup_reported = _shutdown_reported = False

    def _next_deadline(self):
        deadlines = [self._decide_at]
        if not self._startup_reported and not all(s.ready or s.exited for s in self.ranks.values()):
            deadlines.append(self._started + self.startup_timeout)
        for s in self.ranks.values():  # a rank stopped after its work is judged at the end of training
            if s.stopped_at is not None and not (s.exited or s.reported or s.done):
                deadlines.append(s.stopped_at + self.peer_timeout)
        if self._coordinator_done is not None and not self._shutdown_reported:
            deadlines.append(self._coordinator_done + self.peer_timeout)
        deadlines = [d for d in deadlines if d is not None]
        return min(deadlines) if deadlines and self.ended_at is None else None

    def _check_timers(self):
        if self.ended_at is not None:
            return
        now = time.time()
        for r, s in self.ranks.items():
            if s.stopped_at is not None and not (s.exited or s.done) and now >= s.stopped_at + self.peer_timeout:
                self._stopped_incident(r, now)
        late = [r for r, s in self.ranks.items() if not (s.ready or s.exited)]
        if late and not self._startup_reported and now >= self._started + self.startup_timeout:
            self._startup_reported = True
            late.sort(key=lambda r: self.ranks[r].connected)  # one never started is the likelier cause
            for r in late[:1]:
                s = self.ranks[r]
                what = (f"started (pid {s.pid}) but was not ready" if s.connected else "was not started")
                self._incident(now, True, r, f"{what} within runconfig.startup_timeout ({self.startup_timeout:g} s)")
        if (self._coordinator_done is not None and not self._shutdown_reported
                and now >= self._coordinator_done + self.peer_timeout):
            self._shutdown_reported = True
            left = [r for r, s in self.ranks.items() if not s.exited]
            left.sort(key=lambda r: self.ranks[r].done)  # a rank that never finished its work is the silent one
            for r in left[:1]:
                s = self.ranks[r]
                state = "finished its work but did not exit" if s.done else "did not finish its work"
                if s.stopped_at is not None:
                    state += f" (its process is stopped, {self._stop_name(s)})"
                self._incident(now, True, r, f"{state} within runconfig.peer_timeout ({self.peer_timeout:g} s) "
                                             "after the training ended")
        if self._decide_at is not None and now >= self._decide_at:
            with self._lock:
                chosen = self._cause()
            self.end(chosen.line)  # an incident set _decide_at: there is a cause


def _reachable_address(hostfile):
    """This machine's address as the hosts of ``hostfile`` see it (WSE_CONTROL_HOST overrides)."""
    if os.environ.get("WSE_CONTROL_HOST"):
        return os.environ["WSE_CONTROL_HOST"]
    hosts = []
    for line in open(hostfile):
        line = line.split("#", 1)[0].strip()
        if line:
            hosts.append(line.split(":", 1)[0].split()[0])
    for host in hosts:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((host, 9))  # no packet is sent: this only asks the kernel for the route
                address = s.getsockname()[0]
        except OSError:
            continue
        if not address.startswith("127."):
            return address
    return socket.gethostbyname(socket.gethostname())
