"""What every role shares: ``BaseRole``, a rank's role in any job, training or inference (the rank's
link, ``messaging.Link``: the communicator, the job's tag layout, how long it waits for a peer; the
plan, the model, the log), and ``Role``, a role of a training job (the params, the step's
micro-batches, the simulated clock with the ports of the links this rank keeps:
docs/design/time-model.md "The clock"). An inference job's roles build on ``BaseRole`` too
(``roles.inference.InferenceRole``)."""
import json
import time

import numpy as np

from mpi_launch import messaging as msg
from mpi_launch.plan import param_owners
from mpi_launch.protocol import DATA, Layout
from mpi_launch.rundir import LineLog, RunDir


#: Bytes per second a checkpoint is taken to be written at (every shard, with its sha256) while
#: the job's other ranks wait: an assumption, a slow disk's; measured here, a 1 GB shard took about
#: 6 s (170 MB/s). It lengthens how long a silent peer is waited for (``Role.step_done``).
SAVE_BYTES_PER_S = 50e6


class BaseRole:
    """What a rank's role holds in any job: the communicator, the plan, its index among the ranks of
    its kind, the model (a ``wse_core.nn.Model``, built once by the rank) with its streaming units and
    which MemoryX owns each parameter, the run directory and the rank's log there. Its link
    (``self.link``) is the subclass's to open, once it knows its tag layout (``layout``) and how long a
    first wait may take."""

    def __init__(self, comm, plan, model, run_dir, index):
        self.comm, self.plan, self.index, self.rank = comm, plan, index, comm.rank
        self.model = model
        self.units, self.unit_params = self.model.units, self.model.unit_params
        self.shapes = {n: s.shape for n, s in self.model.param_specs.items()}
        self.param_owner = param_owners(self.unit_params, plan.unit_owner)
        self.run_dir = run_dir
        self.log_file = LineLog(run_dir.rank_log(self.rank))

    def layout(self, micro_batches):
        """The job's tag layout (``Layout.for_job``): this model's units and arrays, ``micro_batches`` a step."""
        return Layout.for_job(units=len(self.units), micro_batches=micro_batches,
                              arrays_per_unit=max(len(p) for p in self.unit_params))

    def log(self, text):
        self.log_file.write(f"{time.strftime('%H:%M:%S')} {text}\n")

    def unit_layout(self, u):
        """Shapes and dtypes of unit u's weights (or gradients) on the wire: 16-bit patterns in a
        mixed-precision run (``Precision.wire_dtype``), float32 otherwise."""
        return [(self.shapes[n], self.model.precision.wire_dtype) for n in self.unit_params[u]]


class Role(BaseRole):
    """A role of a training job: the run the launcher resolved (``mpi_launch.resolved.ResolvedRun``:
    the params, the plan, the model, the step's micro-batches), the run's start and end, the simulated
    clock, and how long a peer may stay silent (``step_done``)."""

    def __init__(self, comm, resolved, run, index, bells=None):
        from wse_core.perf.clock import Clock
        from wse_core.perf.step import stream_bytes

        params, plan = resolved.spec, resolved.plan
        super().__init__(comm, plan, resolved.model, RunDir(params.runconfig.model_dir), index)
        self.resolved, self.params, self.run_info = resolved, params, run
        self.model_dir = self.run_dir.path
        self.max_steps = params.runconfig.max_steps
        self.start_step = run["start_step"]
        # The step's micro-batches; each CS-2 computes n_micro of them (its rounds).
        self.batches = resolved.batches
        self.batch_size, self.mbs, self.n_micro = self.batches.batch_size, self.batches.size, self.batches.rounds
        self._timing_file = None
        layout = self.layout(self.n_micro)
        # Simulated time: the hardware (at the model's precision), this rank's clock, and the bytes
        # each unit streams.
        self.hw = resolved.hardware
        self.clock = Clock()
        self.unit_stream_bytes = stream_bytes(self.model, self.hw.bytes_per_value)
        # How long a peer may stay silent (step_done): until a step has set the pace, as long as
        # ranks may take to start, plus peer_timeout; a checkpoint's write is allowed for throughout.
        from mpi_launch.resolved import optimizer_states

        r = params.runconfig
        checkpoint_bytes = sum(plan.unit_bytes) * (1 + optimizer_states(params.optimizer))
        self._save_s = checkpoint_bytes / SAVE_BYTES_PER_S
        self._step_began, self._longest_step, self._uncounted = time.monotonic(), 0.0, self.UNCOUNTED_STEPS
        self.link = msg.Link(comm, layout, r.startup_timeout + r.peer_timeout + self._save_s,
                             f"runconfig.startup_timeout {r.startup_timeout:g} s + peer_timeout {r.peer_timeout:g} s"
                             f"{self._for_a_checkpoint()}, the first steps' allowance", bells)

    def round_range(self, m, csx=None):
        """(first, end) samples, in the step's global batch, of the micro-batch CS-2 ``csx`` (this
        rank's index by default) computes in round m (``MicroBatches.range_of``)."""
        return self.batches.range_of(m, self.index if csx is None else csx)

    def round_size(self, m, csx=None):
        lo, hi = self.round_range(m, csx)
        return hi - lo

    def post_micro_batches(self, workers, seq_len):
        """Receives posted for this CS-2's micro-batch of every round (STEP["data"]: round m from input
        worker m mod their count): (each round's arrays, the requests to wait for)."""
        raw, reqs = [], []
        for m in range(self.n_micro):
            a = [np.empty(shape, dtype) for shape, dtype in self.model.example_layout(self.round_size(m), seq_len)]
            raw.append(a)
            reqs += [self.comm.Irecv(x, source=workers[m % len(workers)], tag=self.link.tag(DATA, m, i))
                     for i, x in enumerate(a)]
        return raw, reqs

    def port(self, gbps):
        """A port of a link this rank keeps (see wse_core.perf.clock): its chunk is CHUNK_FLOATS elements
        of the wire's dtype (16-bit patterns in a mixed-precision run), as wse_core.perf.step walks it."""
        from wse_core.perf.clock import Port

        chunk_bytes = msg.CHUNK_FLOATS * self.model.precision.itemsize
        return Port(gbps, latency_s=self.hw.swarmx_hop_latency_s, chunk_bytes=chunk_bytes)

    @property
    def tree_gbps(self):
        """Rate of a SwarmX link to a child: its bundle of ports, at most a CS-2's I/O."""
        return min(self.hw.swarmx_port_gbps * self.hw.swarmx_ports_per_child, self.hw.io_gbps)

    #: Steps at the start whose length sets no pace: the first also holds every rank's start-up.
    UNCOUNTED_STEPS = 1

    def step_done(self, step):
        """After each step, how long a peer may stay silent: ``runconfig.peer_timeout`` plus twice the
        longest step this rank has seen (the first not counted) plus a checkpoint's write. A peer may
        be computing a whole step while this rank waits for it (the coordinator waits out every
        CS-2's forward pass for the losses); the longest step, not the last, because a checkpoint or
        an evaluation makes some steps longer than others (docs/design/ranks.md "Peer timeouts")."""
        now = time.monotonic()
        if self._uncounted:
            self._uncounted -= 1
        else:
            self._longest_step = max(self._longest_step, now - self._step_began)
            peer = self.params.runconfig.peer_timeout
            self.link.set_timeout(peer + 2 * self._longest_step + self._save_s,
                                  f"runconfig.peer_timeout {peer:g} s + twice the longest step so far, "
                                  f"{self._longest_step:.1f} s{self._for_a_checkpoint()}")
        self._step_began = now

    def _for_a_checkpoint(self):
        return f" + {self._save_s:.1f} s to write a checkpoint" if self._save_s >= 0.05 else ""

    def timing(self, step, **fields):
        """One JSON line per step in ``logs/timing_rank_<r>.jsonl``: where this rank's time went.

        Durations are seconds; ``at_*`` fields are ``time.monotonic()`` stamps, comparable across the
        ranks of one machine (``wse bench stream`` lines them up into a step breakdown).
        """
        if self._timing_file is None:
            self._timing_file = LineLog(self.run_dir.timing_log(self.rank))
        self._timing_file.write(json.dumps({"step": step + 1, **fields}) + "\n")

    def seq_len(self):
        """Tokens per example of the training data (read once, from its metadata)."""
        from data_tools.dataset import GlobalStream

        if not hasattr(self, "_seq"):
            t = self.params.train_input
            stream = GlobalStream(t.data_dir, mixture=t.mixture)
            self._seq = int(stream.example_shape[-1])
            stream.close()
        return self._seq

