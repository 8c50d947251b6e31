"""Running a job: ``mpiexec`` under a watchdog (mpi_launch.watchdog), its coordinator's lines streamed,
its failure named in one line, and nothing of it left running.

``launch`` starts mpiexec in a session of its own, hands it to a ``Watchdog`` that ends the job at
the first fault, and ends it just the same when the launcher is told to stop (SIGTERM, SIGINT,
SIGHUP: ``JobInterrupted``; a signal the launcher inherited as ignored, as ``nohup`` ignores SIGHUP,
stays ignored). Hydra's messages go to ``logs/mpiexec.log``, the supervisors' reports to
``logs/watchdog.log``. The coordinator's lines go to an ``Output``: a stream that fails (its reader
left, its disk is full) is let go and the job goes on. ``job_processes`` finds what a job left running.
"""
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from mpi_launch.mpiexec import hydra_env, mpi_env
from mpi_launch.watchdog import Watchdog, signame

#: Seconds mpiexec gets to exit after the job was ended, before its process group is killed again.
TEARDOWN_SECONDS = 5.0


def hydra_reason(stderr):
    """The informative line of hydra's complaint (mpiexec.log keeps all of it)."""
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip() and not ln.startswith("=")]
    for ln in lines:
        low = ln.lower()
        if "error" in low or "unable" in low or "cannot" in low or "failed" in low:
            return ln
    return lines[-1] if lines else "mpiexec failed without a message"


class OutputLost(UserWarning):
    """The stream a job's lines went to failed (a full disk, an I/O error); the job went on without it."""


class Output:
    """Where a job's lines go: a caller's stream, written and flushed a line at a time, whose failure
    never ends the job. Standard output is a view of a run, its record is in model_dir (metrics.jsonl,
    checkpoints, logs/): `wse fit | head -3` ended a training at step 20 with nothing saved.

    A stream that fails is let go: nothing more is written to it, and its descriptor is pointed at
    /dev/null, so the caller's own last lines and Python's flush at exit do not fail on it again. A
    reader who left (a broken pipe) is the user's choice and is not remarked on; any other failure
    (`wse fit > /dev/full`) is said once, as an ``OutputLost`` warning naming the stream."""

    def __init__(self, stream):
        self.stream, self.lost = stream, False
        self._lock = threading.Lock()  # the watchdog's thread and the caller's write whole lines

    @classmethod
    def of(cls, stream):
        """``stream`` as an Output (itself if it is one)."""
        return stream if isinstance(stream, cls) else cls(stream)

    def write(self, text):
        with self._lock:
            if self.lost:
                return
            try:
                self.stream.write(text)
                self.stream.flush()
            except (OSError, ValueError) as exc:  # ValueError: the stream was closed
                self.lost = True
                self._let_go(exc)

    def _let_go(self, exc):
        try:
            null = os.open(os.devnull, os.O_WRONLY)
            try:
                os.dup2(null, self.stream.fileno())
            finally:
                os.close(null)
        except (OSError, ValueError, AttributeError):
            pass  # a stream without a descriptor of its own: only this Output stops writing to it
        if not isinstance(exc, (BrokenPipeError, ConnectionResetError)):
            name = getattr(self.stream, "name", None)
            name = {"<stdout>": "standard output", "<stderr>": "standard error"}.get(name, name)
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            warnings.warn(f"{name if isinstance(name, str) else 'the output stream'}: {reason}: nothing more is "
                          "written there; the job goes on", OutputLost, stacklevel=3)


class JobInterrupted(BaseException):
    """The launcher was asked to stop (SIGTERM, SIGINT, SIGHUP) and ended the job."""

    def __init__(self, sig):
        super().__init__(signame(sig))
        self.signal = sig


def launch(cmd, plan, run_dir, *, peer_timeout, startup_timeout, hostfile=None, stream=sys.stdout, next_up=None,
           stop=None):
    """Run the job under a watchdog, streaming the coordinator's lines; return (exit code, failure line or None).

    Says when every rank is ready, and ``next_up`` (what the ranks do before the first step's line),
    so a big model's start-up is not a silence. ``stop`` (a threading.Event), once set, ends the job
    as a fault would (a caller in another thread: a cstorch loop left early).

    SIGTERM, SIGINT and SIGHUP end the job cleanly and raise JobInterrupted (from the main thread;
    elsewhere only the caller's own KeyboardInterrupt handling applies), unless the process ignores
    them: `nohup wse fit ... &` must outlive the terminal. ``stream`` failing never ends the job (``Output``).
    """
    out = Output.of(stream)
    log = open(run_dir.watchdog_log, "w")

    def ready(seconds):  # on the watchdog's thread
        out.write(f"{plan.world_size} ranks ready in {seconds:.1f} s" + (f"; {next_up}" if next_up else "") + "\n")

    watchdog = Watchdog(plan, peer_timeout=peer_timeout, startup_timeout=startup_timeout, hostfile=hostfile,
                        log=log, on_ready=ready)
    previous = _trap_stop_signals()
    try:
        code, stderr = _run_watched(cmd, run_dir, watchdog, out, stop)
        # The logs are the job's record, not its outcome: a disk that filled up says so only when
        # nothing else went wrong (a full disk's first victim, a rank's file, is the verdict).
        unwritten = _write_mpiexec_log(run_dir, stderr, watchdog.log_error)
    finally:
        try:
            log.close()
        except OSError:
            pass  # said by watchdog.log_error: its writes met the same failure
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if watchdog.verdict is not None:
        return code or 1, watchdog.verdict
    if code != 0:
        return code, hydra_reason(stderr)
    if unwritten is not None:
        raise unwritten
    return 0, None


def _trap_stop_signals():
    """Make SIGTERM, SIGINT and SIGHUP raise JobInterrupted (from the main thread only: Python runs
    handlers there); return the handlers they replaced, for the caller to put back."""
    previous = {}

    def interrupted(sig, frame):
        raise JobInterrupted(sig)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:  # ignored by whoever started us: their choice
                previous[sig] = signal.signal(sig, interrupted)
    return previous


def _run_watched(cmd, run_dir, watchdog, out, stop):
    """mpiexec from start to exit under ``watchdog``, the coordinator's lines to ``out``; return its
    exit code and what hydra said (its failure banner, then its stderr). The watchdog is stopped and
    the job's shared memory removed however it ends."""
    with tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
                                env=mpi_env(1, {"OMP_WAIT_POLICY": "PASSIVE", **watchdog.env(),
                                               **hydra_env(run_dir.hwloc_xml)}))
        watchdog.start(proc)
        stopper, ended = _start_stopper(stop, proc, watchdog)
        try:
            banner = _stream_lines(proc, out)
            code = _await_exit(proc, watchdog)
            watchdog.conclude()
        except BaseException:
            watchdog.end()
            proc.wait()
            raise
        finally:
            if stopper is not None:
                ended.set()
                stopper.join()
            watchdog.stop()
            watchdog.wait_gone(TEARDOWN_SECONDS)
            watchdog.remove_shared_memory()
        err.seek(0)
        return code, "".join(banner) + err.read()


def _start_stopper(stop, proc, watchdog):
    """A thread that ends the job once ``stop`` is set, and the event that tells it the job is over
    (set it, then join the thread, before the watchdog stops); (None, None) without ``stop``."""
    if stop is None:
        return None, None
    ended = threading.Event()

    def watch_stop():
        while not ended.is_set() and proc.poll() is None:
            if stop.wait(0.2):  # a sleep between looks at the job, not a spin
                if not ended.is_set():
                    watchdog.end("the job was stopped before its last step (its caller asked)")
                return

    stopper = threading.Thread(target=watch_stop, name="wse-launch-stop", daemon=True)
    stopper.start()
    return stopper, ended


def _stream_lines(proc, out):
    """Write mpiexec's standard output to ``out`` until it closes; return hydra's failure banner (it
    comes on stdout, and from its first line on everything goes to logs/mpiexec.log instead)."""
    banner = []
    for line in proc.stdout:
        if line.startswith(("=", "YOUR APPLICATION TERMINATED")) or banner:
            banner.append(line)
        elif line.strip():
            out.write(line)
    return banner


def _await_exit(proc, watchdog):
    """mpiexec's exit code, once its output has closed; ended if it outlives its ranks by TEARDOWN_SECONDS."""
    deadline = time.monotonic() + TEARDOWN_SECONDS
    while proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if proc.poll() is None:  # mpiexec outlived its ranks: end it
        watchdog.end()
    return proc.wait()


def _write_mpiexec_log(run_dir, stderr, unwritten):
    """Write hydra's messages to logs/mpiexec.log; return the first failure to write the job's logs
    (``unwritten``: the watchdog's), or None."""
    try:
        run_dir.mpiexec_log.write_text(stderr)
    except OSError as exc:  # met writing, it names no file (a full disk)
        unwritten = unwritten or OSError(exc.errno, exc.strerror, str(run_dir.mpiexec_log))
    return unwritten


def job_processes(marker):
    """Live processes of the jobs whose command lines mention ``marker`` (a model_dir, a test's
    tmp_path): those processes, their descendants (hydra's proxies start sessions of their own) and
    everything in their sessions; never the caller or its session. What tests and ``wse bench
    faults`` count to prove a job left nothing behind."""
    procs = {}  # pid -> (ppid, session, command line)
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] not in ("Z", "X"):
            procs[int(d.name)] = (int(fields[1]), int(fields[3]), cmd)
    found = {pid for pid, (_, _, cmd) in procs.items() if str(marker) in cmd}
    while True:
        sessions = {procs[pid][1] for pid in found} - {os.getsid(0)}
        more = {pid for pid, (ppid, sid, _) in procs.items() if ppid in found or sid in sessions} - found
        if not more:
            return sorted(found)
        found |= more
