"""The appliance's client side, below the Job (``Job.submit``) and the service (``pyapi.appliance``) alike:
where the socket is, one request per connection, the job handle, and a job's states.

The wire format is one JSON object per line over a unix socket: the client sends one request
(``{"op": ..., ...}``) and reads replies until the service closes the connection; a reply with
``"error"`` is a refusal, one line. Who is asking is not in the request: the service reads the
caller's uid from the socket itself (``SO_PEERCRED``). See docs/design/appliance.md "Who is asking".
"""
import enum
import json
import os
import socket
import time
from pathlib import Path

from pyapi.errors import ApplianceError, JobError
# wse_core.numerics (numpy) and mpi_launch.rundir (data_tools.files) are imported where they are used:
# `wse --help` imports this module and must load neither (tests/test_cli.py).

#: The socket of an appliance started by root, which serves every user of the machine.
SYSTEM_STATE_DIR = Path("/var/lib/wse-appliance")
SOCKET_NAME = "appliance.sock"
SOCKET_ENV = "WSE_APPLIANCE_SOCKET"
#: A request line longer than this is refused (params files are a few KiB).
MAX_LINE = 1 << 20


# A job's states: ``queued -> running -> done | failed | cancelled`` (``running -> queued`` when the
# service stops, and at its next start for jobs a killed service was running): docs/design/appliance.md
# "Jobs". The states travel as their values: in the jobs table's ``state`` column and in every reply.


class JobState(str, enum.Enum):
    QUEUED = "queued"        # waiting for its CS-2s (or for the service to start again)
    RUNNING = "running"      # an attempt's runner is alive (a restart stays running)
    DONE = "done"
    FAILED = "failed"        # its own input, or a fault after its restarts; its reason says which
    CANCELLED = "cancelled"

    def __str__(self):  # the value, in messages and f-strings (not "JobState.DONE")
        return self.value

    def __format__(self, spec):
        return format(self.value, spec)

    def is_terminal(self):
        """Ended: nothing more happens to the job."""
        return self in ENDED


#: Holding or waiting for CS-2s: two of one user's active jobs may not share a model_dir.
ACTIVE = (JobState.QUEUED, JobState.RUNNING)
ENDED = (JobState.DONE, JobState.FAILED, JobState.CANCELLED)


def user_state_dir():
    """Where an appliance started by an ordinary user keeps its state: $XDG_STATE_HOME/wse-appliance."""
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base) / "wse-appliance"


def default_state_dir():
    return SYSTEM_STATE_DIR if os.geteuid() == 0 else user_state_dir()


def default_socket():
    """$WSE_APPLIANCE_SOCKET; else this user's own appliance if one has a socket; else the machine's."""
    if os.environ.get(SOCKET_ENV):
        return Path(os.environ[SOCKET_ENV])
    own = default_state_dir() / SOCKET_NAME
    if own.exists():
        return own
    return SYSTEM_STATE_DIR / SOCKET_NAME


def send_line(sock, obj):
    # MSG_NOSIGNAL: a peer gone is an error here, not a SIGPIPE, whatever the calling program set.
    sock.sendall((json.dumps(obj) + "\n").encode(), socket.MSG_NOSIGNAL)


class Client:
    """Requests to one appliance."""

    def __init__(self, socket_path=None):
        self.path = Path(socket_path) if socket_path else default_socket()

    def _connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(str(self.path))
        except FileNotFoundError:
            s.close()
            raise ApplianceError(f"no appliance at {self.path}: start one with `wse appliance start`, "
                                 f"or name its socket with --socket or ${SOCKET_ENV}") from None
        except OSError as exc:
            s.close()
            raise ApplianceError(f"cannot reach the appliance at {self.path}: {exc.strerror or exc}") from None
        return s

    def stream(self, op, **fields):
        """Send one request; yield each reply until the service closes the connection."""
        with self._connect() as s:
            try:
                send_line(s, {"op": op, **fields})
            except OSError as exc:
                raise ApplianceError(f"the appliance at {self.path} dropped the connection: "
                                     f"{exc.strerror or exc}") from None
            buffer = b""
            while True:
                try:
                    chunk = s.recv(65536)
                except OSError as exc:  # e.g. reset by a service that is stopping
                    raise ApplianceError(f"the appliance at {self.path} dropped the connection: "
                                         f"{exc.strerror or exc}") from None
                if not chunk:
                    break
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    reply = json.loads(line)
                    if "error" in reply:
                        raise ApplianceError(reply["error"])
                    yield reply
        if buffer.strip():
            raise ApplianceError(f"the appliance at {self.path} closed the connection mid-reply")

    def request(self, op, **fields):
        """One request, one reply."""
        for reply in self.stream(op, **fields):
            return reply
        raise ApplianceError(f"the appliance at {self.path} closed the connection without a reply")

    # -- the operations ------------------------------------------------------------------------
    def status(self):
        return self.request("status")

    def submit(self, params, *, max_restarts=0, priority=0, name=None):
        """Queue a validated job (``pyapi.params.RunSpec``); return its ``SubmittedJob``.

        This process's numerics variables (``wse_core.numerics``: BLAS kernel, thread counts) go with
        it, so the job computes the bits ``wse fit`` computes here."""
        from wse_core.numerics import numerics_variables

        d = params.to_dict()
        model_dir = Path(d["runconfig"]["model_dir"]).absolute()
        d["runconfig"]["model_dir"] = str(model_dir)
        reply = self.request("submit", params=d, cwd=os.getcwd(), max_restarts=max_restarts, priority=priority,
                             name=name or model_dir.name, numerics=numerics_variables())
        return SubmittedJob(self, reply["job"]["id"], model_dir)

    def submit_serve(self, serve, *, max_restarts=0, priority=0, name=None):
        """Queue a serve job (``wse serve --submit``: the fields of ``requests.ServeSpec``); return its
        ``SubmittedJob``. It holds its CS-2s until cancelled."""
        model = Path(serve["model"]).absolute()
        reply = self.request("submit", kind="serve", params=dict(serve, model=str(model)), cwd=os.getcwd(),
                             max_restarts=max_restarts, priority=priority, name=name or f"serve {model.name}")
        return SubmittedJob(self, reply["job"]["id"], model)

    def jobs(self):
        return self.request("jobs")["jobs"]

    def job(self, job_id):
        return self.request("job", id=job_id)["job"]

    def cancel(self, job_id):
        return self.request("cancel", id=job_id)["job"]

    def logs(self, job_id, follow=False):
        """The job's log as it grows (``follow``) or as it stands: an iterator of text pieces."""
        for reply in self.stream("logs", id=job_id, follow=follow):
            if "data" in reply:
                yield reply["data"]

    def wait(self, job_id, timeout=None):
        """The job's record once it has ended (or ApplianceError after ``timeout`` seconds)."""
        return self.request("wait", id=job_id, timeout=timeout)["job"]

    def stop(self):
        return self.request("stop")


class SubmittedJob:
    """A job in the appliance's queue, from Python: ``status()``, ``wait()``, ``metrics()``, ``logs()``, ``cancel()``."""

    def __init__(self, client, job_id, model_dir):
        self.client, self.id, self.model_dir = client, job_id, Path(model_dir)

    def __repr__(self):
        return f"SubmittedJob(id={self.id}, model_dir={str(self.model_dir)!r})"

    def status(self):
        """The job's record: state, CS-2s, step, loss, simulated and wall seconds, restarts, reason."""
        return self.client.job(self.id)

    def wait(self, timeout=None):
        """Block until the job ends; return its record, or raise JobError if it failed or was cancelled."""
        job = self.client.wait(self.id, timeout)
        if job["state"] != JobState.DONE:
            raise JobError(f"job {self.id} {job['state']}: {job['reason']}")
        return job

    def metrics(self):
        """Every step's record of metrics.jsonl so far (read from the job's model_dir)."""
        from mpi_launch.rundir import RunDir

        return RunDir(self.model_dir).read_metrics()

    def logs(self, follow=False):
        return "".join(self.client.logs(self.id, follow))

    def cancel(self):
        return self.client.cancel(self.id)


def wait_for_socket(path, proc, timeout):
    """Wait until the appliance ``proc`` answers at ``path`` (True), or exits (False)."""
    deadline = time.monotonic() + timeout
    client = Client(path)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            if client.status()["pid"] == proc.pid:
                return True
        except ApplianceError:
            pass
        time.sleep(0.1)
    return False
