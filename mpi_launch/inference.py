"""Generation on the emulated cluster: an inference job's plan, its ranks started under the
launcher's watchdog, and ``ClusterEngine``, the generation Engine whose forward passes the CS-2
ranks run (docs/design.md section 2, "Inference on the cluster"; the roles: ``mpi_launch.roles.inference``).

``ClusterEngine(model, source, kind, num_csx=...)`` plans the job (``wse_core.perf.inference``
chooses resident or streamed weights for ``max_streams`` sequences of the model's full length,
and refuses in one line a batch whose KV caches do not fit), writes its spec to a private
directory, starts the ranks, and answers ``add``/``cancel``/``step``/``busy`` as
``wse_core.nn.generate.Engine`` does, each a message to the job's coordinator over a Unix socket in
that directory. ``close()`` ends the job. A job that fails raises ``InferenceJobError`` with the
watchdog's line; its directory (rank logs) is kept and named.
"""
import json
import os
import shutil
import socket
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path

from data_tools.files import write_text
from mpi_launch.mpiexec import check_capacity, job_command
from mpi_launch.plan import make_plan
from mpi_launch.rundir import RunDir
from wse_core.checks import plural

#: The socket the coordinator connects to, in the job's directory (mode 0700: only its user reaches it).
SOCKET = "engine.sock"


class InferenceJobError(RuntimeError):
    """The inference job could not start, or failed (one line naming the rank, or what is wrong)."""


def spec(model, source, kind, *, num_csx=1, num_wgt_servers=1, swarmx_fanout=2, max_streams=16, placement=None,
         hw=None, peer_timeout=300.0):
    """(the job's spec, the ``perf.inference.Latency`` that placed it): ``max_streams`` sequences of the
    model's full length on ``num_csx`` CS-2s; ValueError in one line when they do not fit."""
    from wse_core.checks import Int
    from wse_core.perf import Hardware
    from wse_core.perf.inference import serve

    for name, value, low in (("num_csx", num_csx, 1), ("num_wgt_servers", num_wgt_servers, 1),
                             ("swarmx_fanout", swarmx_fanout, 2), ("max_streams", max_streams, 1)):
        Int(low)(value, name)  # more MemoryX servers than units: the plan refuses it (plan_of)
    hw = hw or Hardware.for_model(model)
    capacity = model.config["max_position_embeddings"]
    latency = serve(model, batch=max_streams, prompt_tokens=capacity - 1, new_tokens=1, num_csx=num_csx, hw=hw,
                    placement=placement)
    wafers = latency.detail.get("wafers", [0] * len(model.units))
    return {"model": model.config, "source": str(Path(source).resolve()), "kind": kind, "num_csx": num_csx,
            "num_wgt_servers": num_wgt_servers, "swarmx_fanout": swarmx_fanout, "placement": latency.placement,
            "wafers": list(wafers), "max_streams": max_streams, "peer_timeout": float(peer_timeout)}, latency


def plan_of(spec):
    """The rank plan of an inference job: the coordinator, MemoryX, the SwarmX tree, the CS-2s (no
    input workers: the prompts come from the coordinator)."""
    from wse_core.nn import build_model

    model = build_model(spec["model"])
    return make_plan(num_csx=spec["num_csx"], num_wgt_servers=spec["num_wgt_servers"], num_workers_per_csx=0,
                     swarmx_fanout=spec["swarmx_fanout"], unit_bytes=model.unit_bytes())


class ClusterEngine:
    """A generation Engine on the emulated cluster (see the module's docstring). ``stream``: where the
    launcher's lines go (ranks ready; default: nowhere). Use as a context manager, or ``close()``."""

    def __init__(self, model, source, kind, *, startup_timeout=120.0, stream=None, cores=None, **options):
        from mpi_launch.launcher import launch

        self.model = model
        self.spec, self.latency = spec(model, source, kind, **options)
        self.plan = plan_of(self.spec)
        check_capacity(self.plan, cores=cores)
        self.dir = Path(tempfile.mkdtemp(prefix="wse-infer-"))
        run_dir = RunDir(self.dir)
        run_dir.logs.mkdir()
        self.spec["socket"] = str(self.dir / SOCKET)
        write_text(run_dir.run_json, json.dumps({"inference": self.spec}, indent=1))
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.spec["socket"])
        listener.listen(1)
        self._stop, self._outcome, self._live, self._conn = threading.Event(), None, set(), None
        cmd = job_command(self.plan, self.dir, cores=cores)
        self._sink = None if stream is not None else open(os.devnull, "w")
        sink = stream if stream is not None else self._sink

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
        try:
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
            self.close()  # a failed job's directory stays, with its logs
            raise
        finally:
            listener.close()

    def _failed(self, line=None):
        self._thread.join()
        code, failure = self._outcome or (1, None)
        return InferenceJobError(f"the inference job on {plural(self.plan.num_csx, 'CS-2')} failed: "
                                 f"{line or failure or f'exit code {code}'} (its logs: {self.dir / 'logs'})")

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
            raise ValueError(reply[1])
        return reply[1]

    def add(self, prompt, max_new_tokens, sampling=None, stop_ids=()):
        from wse_core.nn.generate import GREEDY

        most = self.spec["max_streams"]
        if len(self._live) >= most:
            raise ValueError(f"max_streams: {most} sequences are generating, as many as this inference job was placed "
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

    def close(self):
        """End the job; its directory goes with it unless it failed."""
        if self._thread.is_alive() or self._conn is not None:
            self._end()
        if self._sink is not None:
            self._sink.close()
            self._sink = None
        code, failure = self._outcome or (0, None)
        if code == 0 and failure is None:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

