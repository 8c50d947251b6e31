"""Generation on the emulated cluster: an inference job's plan, its ranks started under the
launcher's watchdog, and ``ClusterEngine``, the generation Engine whose forward passes the CS-2
ranks run (docs/design/inference.md "Inference on the cluster"; the roles: ``mpi_launch.roles.inference``).

``ClusterEngine(model, source, source_format, num_csx=...)`` plans the job (``wse_core.perf.inference``
chooses resident or streamed weights for ``max_streams`` sequences of the model's full length,
and refuses in one line a batch whose KV caches do not fit), writes its spec to a private
directory, starts the ranks, and answers ``add``/``cancel``/``step``/``busy`` as
``wse_core.nn.generate.Engine`` does, each a message to the job's coordinator over a Unix socket in
that directory. ``close()`` ends the job. A job that fails raises ``InferenceJobError`` with the
watchdog's line and names its logs, kept in ``log_dir`` (``keep``: the newest ``KEPT``); a job that
ends cleanly leaves nothing. A job whose process was killed (SIGKILL gives it no chance) is found by
the next job this user starts (``reclaim``), which keeps its logs the same way.
"""
import errno
import fcntl
import json
import os
import re
import shutil
import socket
import tempfile
import threading
import time
from dataclasses import fields
from multiprocessing.connection import Connection
from pathlib import Path

from data_tools.files import write_text
from mpi_launch.mpiexec import check_capacity, job_command
from mpi_launch.plan import make_plan
from mpi_launch.rundir import RunDir
from mpi_launch.spec import RunConfig
from wse_core.checks import plural
from wse_core.errors import ConfigError, JobError

#: The socket the coordinator connects to, in the job's directory (mode 0700: only its user reaches it).
SOCKET = "engine.sock"
#: A running job's directory, in the temporary directory: a socket's path must fit in 107 bytes,
#: which a model's directory may not leave room for.
PREFIX = "wse-infer-"
#: Where ``wse serve``/``wse generate`` keep the logs of failed jobs by default: beside the model served.
LOGS = "inference_logs"
#: Failed jobs whose logs a log_dir keeps (the newest); each job's are a few rank logs.
KEPT = 10
#: A kept job's directory in a log_dir: when it was kept, then its own name (unique). Nothing else
#: in a log_dir (a user's own files, with ``--log_dir``) is ever removed.
_KEPT_NAME = re.compile(rf"\d{{8}}-\d{{6}}-{PREFIX}\w+")
#: How long a rank waits for a silent peer beyond what the passes so far say (``roles.inference``):
#: training's ``runconfig.peer_timeout`` and its default, for the same rule.
PEER_TIMEOUT = next(f.default for f in fields(RunConfig) if f.name == "peer_timeout")


class InferenceJobError(JobError):
    """The inference job could not start, or failed (one line naming the rank, or what is wrong; a
    RuntimeError)."""


def spec(model, source, source_format, *, num_csx=1, num_wgt_servers=1, swarmx_fanout=2, max_streams=16, placement=None,
         hw=None, peer_timeout=PEER_TIMEOUT, startup_timeout=120):
    """(the job's spec, the ``perf.inference.Latency`` that placed it): ``max_streams`` sequences of the
    model's full length on ``num_csx`` CS-2s; ValueError in one line when they do not fit.
    ``peer_timeout``, ``startup_timeout``: seconds, as training's runconfig keys of those names
    (how the ranks use them: ``roles.inference.InferenceRole.pace``)."""
    from wse_core.checks import Int
    from wse_core.perf import Hardware
    from wse_core.perf.inference import serve

    for name, value, low in (("num_csx", num_csx, 1), ("num_wgt_servers", num_wgt_servers, 1),
                             ("swarmx_fanout", swarmx_fanout, 2), ("max_streams", max_streams, 1),
                             ("peer_timeout", peer_timeout, 1), ("startup_timeout", startup_timeout, 1)):
        Int(low)(value, name)  # more MemoryX servers than units: the plan refuses it (plan_of)
    hw = hw or Hardware.for_model(model)
    capacity = model.config["max_position_embeddings"]
    latency = serve(model, batch=max_streams, prompt_tokens=capacity - 1, new_tokens=1, num_csx=num_csx, hw=hw,
                    placement=placement)
    wafers = latency.detail.get("wafers", [0] * len(model.units))
    return {"model": model.config, "source": str(Path(source).resolve()), "format": source_format, "num_csx": num_csx,
            "num_wgt_servers": num_wgt_servers, "swarmx_fanout": swarmx_fanout, "placement": latency.placement,
            "wafers": list(wafers), "max_streams": max_streams, "peer_timeout": peer_timeout,
            "startup_timeout": startup_timeout}, latency


def plan_of(spec, model=None):
    """The rank plan of an inference job: the coordinator, MemoryX, the SwarmX tree, the CS-2s (no
    input workers: the prompts come from the coordinator). ``model``: the spec's, when built already."""
    from wse_core.models import build_model

    model = build_model(spec["model"]) if model is None else model
    return make_plan(num_csx=spec["num_csx"], num_wgt_servers=spec["num_wgt_servers"], num_workers_per_csx=0,
                     swarmx_fanout=spec["swarmx_fanout"], unit_bytes=model.unit_bytes())


class ClusterEngine:
    """A generation Engine on the emulated cluster (see the module's docstring). ``log_dir``: where the
    job's logs go if it fails (``keep``). ``stream``: where the launcher's lines go (ranks ready;
    default: nowhere). ``options``: ``spec``'s. Use as a context manager, or ``close()``."""

    def __init__(self, model, source, source_format, *, log_dir, stream=None, cores=None, **options):
        from mpi_launch.launcher import launch

        self.model = model
        self.spec, self.latency = spec(model, source, source_format, **options)
        self.plan = plan_of(self.spec)
        check_capacity(self.plan, cores=cores)
        self.log_dir = Path(log_dir).absolute()
        self._sink = None if stream is not None else open(os.devnull, "w")
        sink = stream if stream is not None else self._sink
        reclaim(sink)
        self.dir = Path(tempfile.mkdtemp(prefix=PREFIX))
        self.logs, self._unkept = self.dir / "logs", ""  # where the job's logs are; why not in log_dir
        self._held = _hold(self.dir)
        self._stop, self._outcome, self._live, self._conn, self._thread = threading.Event(), None, set(), None, None
        self._settled, listener = False, None
        try:
            run_dir = RunDir(self.dir)
            run_dir.logs.mkdir()
            self.spec["socket"], self.spec["log_dir"] = str(self.dir / SOCKET), str(self.log_dir)
            write_text(run_dir.run_json, json.dumps({"kind": "infer", "inference": self.spec}, indent=1))
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(self.spec["socket"])
            listener.listen(1)
            cmd = job_command(self.plan, self.dir, cores=cores)
            startup_timeout = self.spec["startup_timeout"]
            sink.write(f"starting {self.plan.summary()}\n")  # ready in a second here, or many on a loaded machine
            sink.flush()

            def run():
                try:
                    self._outcome = launch(cmd, self.plan, run_dir, peer_timeout=self.spec["peer_timeout"],
                                           startup_timeout=startup_timeout, stream=sink, stop=self._stop)
                except BaseException as exc:  # noqa: BLE001 - said by _failed, on the caller's thread
                    self._outcome = (1, f"{type(exc).__name__}: {exc}")

            self._thread = threading.Thread(target=run, name="wse-inference-job", daemon=True)
            self._thread.start()
            listener.settimeout(0.2)  # a sleep between looks at the job, not a spin
            deadline = time.monotonic() + startup_timeout + 60
            while self._conn is None:
                try:
                    self._conn = Connection(listener.accept()[0].detach())
                except socket.timeout:
                    if not self._thread.is_alive():
                        raise self._failed() from None
                    if time.monotonic() > deadline:
                        self._stop.set()
                        raise self._failed(f"its coordinator did not connect within {startup_timeout + 60:g} s")
        except BaseException:
            self.close()  # a failed job's logs go to log_dir
            raise
        finally:
            if listener is not None:
                listener.close()

    def _failed(self, line=None):
        self._thread.join()
        self._settle()
        code, failure = self._outcome or (1, None)
        return InferenceJobError(f"the inference job on {plural(self.plan.num_csx, 'CS-2')} failed: "
                                 f"{line or failure or f'exit code {code}'} (its logs: {self.logs}{self._unkept})")

    def _call(self, *order, answer=True):
        try:
            self._conn.send(order)
            reply = self._conn.recv() if answer else ("ok", None)
        except (EOFError, OSError):  # the coordinator is gone: the watchdog names why and ends the job
            self._conn.close()
            self._conn = None
            self._thread.join(self.spec["peer_timeout"])
            self._end()
            raise self._failed() from None
        if reply[0] == "error":
            raise ConfigError(reply[1])
        return reply[1]

    def add(self, prompt, max_new_tokens, sampling=None, stop_ids=()):
        from wse_core.nn.generate import GREEDY

        most = self.spec["max_streams"]
        if len(self._live) >= most:
            raise ConfigError(f"max_streams: {most} sequences are generating, as many as this inference job was placed "
                              "for (their KV caches counted against SRAM); start it with a larger max_streams")
        i = self._call("add", list(map(int, prompt)), max_new_tokens, sampling or GREEDY, tuple(stop_ids))
        self._live.add(i)
        return i

    def cancel(self, i):
        self._call("cancel", i, answer=False)
        self._live.discard(i)

    @property
    def busy(self):
        return bool(self._live)

    @property
    def capacity(self):
        return self.model.config["max_position_embeddings"]

    @property
    def vocab_size(self):
        return self.model.config["vocab_size"]

    def step(self):
        made = self._call("step")
        for i, tok in made:
            if tok is None:
                self._live.discard(i)
        return made

    def _end(self):
        if self._conn is not None:
            try:
                self._conn.send(("close",))
            except OSError:
                pass
            self._conn.close()
            self._conn = None
        else:
            self._stop.set()
        self._thread.join()

    def _settle(self):
        """The job is over: its directory goes, or moves to log_dir if the job failed (once)."""
        if self._settled:
            return
        self._settled = True
        code, failure = self._outcome or (0, None)
        try:
            if code == 0 and failure is None:
                shutil.rmtree(self.dir, ignore_errors=True)
            else:
                self.logs = keep(self.dir, self.log_dir) / "logs"
        except OSError as exc:  # the logs stay where they are, and the error says why
            self._unkept = f"; not moved to {self.log_dir}: {exc.strerror or exc}"
        finally:
            os.close(self._held)  # a directory left here is the next job's to reclaim

    def close(self):
        """End the job: its directory goes with it, or moves to log_dir if the job failed."""
        if self._thread is not None and (self._thread.is_alive() or self._conn is not None):
            self._end()
        self._settle()
        if self._sink is not None:
            self._sink.close()
            self._sink = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _hold(path):
    """A descriptor holding an flock on directory ``path``: its job is alive while the process that
    made it is, whatever ends that process (the kernel drops the lock), so ``reclaim`` knows."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a blocking wait: a ``reclaim`` elsewhere may be looking at it for a moment
    return fd


def keep(job_dir, log_dir):
    """Move the directory of a job that failed (its run.json and logs/, not its socket) into ``log_dir``
    as ``<date>-<time>-<its name>``, and remove the oldest kept there beyond ``KEPT``; its new path.
    OSError when it cannot (``log_dir`` not writable, say)."""
    (job_dir / SOCKET).unlink(missing_ok=True)  # nobody answers on it any more
    log_dir.mkdir(parents=True, exist_ok=True)
    name = f"{time.strftime('%Y%m%d-%H%M%S')}-{job_dir.name}"
    kept = log_dir / name
    try:
        os.rename(job_dir, kept)
    except OSError as exc:
        if exc.errno != errno.EXDEV:
            raise
        # Another filesystem: a copy beside, renamed whole, so another job's ``keep`` counting the
        # kept directories never meets half of one.
        partial = log_dir / f".{name}.partial"
        try:
            shutil.copytree(job_dir, partial, symlinks=True)
            os.rename(partial, kept)
        except OSError:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        shutil.rmtree(job_dir, ignore_errors=True)
    for old in sorted(p.name for p in log_dir.iterdir() if _KEPT_NAME.fullmatch(p.name))[:-KEPT]:
        shutil.rmtree(log_dir / old, ignore_errors=True)
    return kept


def reclaim(stream):
    """Keep the logs of this user's inference jobs whose process was killed (a SIGKILL leaves it no
    chance to): each such directory in the temporary directory that no process holds (``_hold``)
    goes to the log_dir its run.json names (``keep``), its stale socket removed. Said on ``stream``."""
    for path in sorted(Path(tempfile.gettempdir()).glob(f"{PREFIX}*")):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue  # gone meanwhile (another job kept it), or not a directory
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its job is alive
            try:
                log_dir = Path(json.loads((path / "run.json").read_text())["inference"]["log_dir"])
            except (OSError, ValueError, KeyError, TypeError):
                continue  # being made (held before its run.json is written), moved, or an older version's
            try:
                kept = keep(path, log_dir)
            except OSError as exc:
                stream.write(f"warning: {path}: logs of an inference job whose process was killed, left here: "
                             f"cannot move them to {log_dir}: {exc.strerror or exc}\n")
            else:
                stream.write(f"kept the logs of an inference job whose process was killed: {kept / 'logs'}\n")
        finally:
            os.close(fd)
