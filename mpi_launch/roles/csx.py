"""The CS-2: runs its micro-batches one after another, each through the schedule of weight streaming
(``wse_core.microbatch.micro_batch_schedule``: forward, then segment by segment a recompute from the
checkpoint and the backward), as the weights stream through; sends each unit's gradients up.

What the emulated CS-2 keeps of a micro-batch from its forward pass to its backward (docs/design/time-model.md
"Micro-batching"): the input of every segment's first unit (the checkpoint) and the
activations of the last segment; the other segments' are recomputed from their checkpoints, with
their weights streamed again, before their backward. This rank's host keeps the whole micro-batch's
activations instead (what its planned memory counts), so a recompute item costs the clock its
weights across the port and a forward, but computes nothing: its values would be the forward's
bits (the same inputs, weights and dropout keys), and computing them again took a sixth to a
third of the rank's step. Nor do its weights travel: they would not be used, so MemoryX sends its
header alone and SwarmX relays the header (a fifth of a step's weight bytes for the GPT-2 of
``wse bench peers``, copied at every hop).

Simulated time: this rank keeps its CS-2's I/O port. An item's weights cross it once there is room
for them (a CS-2 holds two units: from the moment the item before starts computing), the clock
waits for them, computing advances it by the model's cost (``wse_core.perf.unit_seconds``; a
recompute costs the unit's forward), and a backward item's gradients cross the port as it ends,
after the next item's weights (the order the walk in ``wse_core.perf.step`` follows; the
gradient's header is sent once that next item's header is in). The clock is a lane
(``messaging.Lanes``) that takes the headers as they come, behind the computing: an item waits
for its weights' data only, so a CS-2 ahead of another is held back by it once a step, at the
step's end, not at every segment (SwarmX sends a header once both CS-2s' gradients before it
are in; docs/design/ranks.md "Lanes").

Its messages (``mpi_launch.protocol``): it receives STEP["data"], STEP["forward weights"],
STEP["loss scale"], STEP["recompute weights"] and STEP["backward weights"], and sends STEP["loss"],
STEP["gradients"] and STEP["step time"].
"""
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from mpi_launch.messaging import Lanes
from mpi_launch.protocol import (CONTROL, FWD_WEIGHTS, GRADS, LOSS, REPORT, STEP_TIME, WEIGHTS_PHASE, LossReport,
                                 StepTime)
from mpi_launch.roles.base import Role


@dataclass
class _Step:
    """What a CS-2 holds of the step it computes: the sends in flight and the buffers they read, each
    round's loss and values, the clock lane's tally, and the micro-batch being computed."""
    number: int
    loss_scale: float
    sends: list = field(default_factory=list)   # requests: gradients and their headers, the loss
    keep: list = field(default_factory=list)    # the buffers of the gradients' sends
    losses: list = field(default_factory=list)  # (loss sum, tokens) of each round
    values: list = field(default_factory=list)  # what else each round's step hands a compiled model's script
    waited: float = 0.0          # simulated seconds the CS-2 waited for weights
    compute: float = 0.0         # simulated seconds it computed
    t_loss: Optional[float] = None  # the simulated time the last round's forward ended
    reported: bool = False       # the loss has gone to the coordinator
    batch: Any = None            # the round's micro-batch, its dropout key, activations and saved values
    drop: Any = None
    x: Any = None
    dy: Any = None
    saved: Optional[list] = None


class CS2(Role):
    """Computes every step's items as the weights stream in (``_compute``: forward, recompute,
    backward, ``_forward`` and ``_backward``), its clock a lane that follows the headers
    (``_clock_lane``), and reports the loss and the step's time to the coordinator."""

    def run(self):
        from wse_core.optim.loss_scale import LossScaler
        from wse_core.perf import unit_seconds, unit_work
        from wse_core.microbatch import micro_batch_schedule

        self._parent = self.plan.parent[self.plan.csx[self.index]]
        self._workers = self.plan.workers[self.index]
        scaler = LossScaler.from_params(self.params.optimizer, self.model.config.get("fp16_type"))
        self._dynamic, self._loss_scale = scaler.dynamic, scaler.scale  # a static scale never changes
        self._io = self.port(self.hw.io_gbps)
        self._seq = self.seq_len() if self.model.is_lm else None
        self._cost = [unit_seconds(unit_work(u, self.mbs, self._seq), self.hw) for u in self.units]
        self._items = [(m, kind, u) for m in range(self.n_micro) for kind, u in micro_batch_schedule(len(self.units))]
        self._head = len(self.units) - 1
        for step in range(self.start_step, self.max_steps):
            self._step(step)

    def _step(self, step):
        """One step: its data and first weights in, every item computed, the gradients' sends and the
        clock's headers waited out, the step's time to the coordinator, the step's log lines."""
        link, parent = self.link, self._parent
        t0 = time.perf_counter()
        # Data for this step, and the first item's weights, arrive while nothing else happens yet.
        raw, weights, wreqs = self._take_data(step)
        t_data = time.perf_counter() - t0
        if self._dynamic:  # the coordinator's loss scale for this step (sent when the last step ended)
            self._loss_scale = link.recv_object(self.plan.coordinator, link.tag(CONTROL),
                                                f"the coordinator (loss scale of step {step})").scale
        st = _Step(step, self._loss_scale)
        clock_of_step = self._clock_lane(st)
        lanes = Lanes(link, clock_of_step)
        t_wait, t_layers = self._compute(st, lanes, raw, weights, wreqs)
        at_backward_end = time.monotonic()
        tg = time.perf_counter()
        lanes.wait(clock_of_step)  # the headers still to come: the CS-2s' drift is paid here, once a step
        link.wait_all(st.sends, f"SwarmX rank {parent} (gradients of step {step})")
        link.send_object(StepTime(compute=st.compute, waited=st.waited), self.plan.coordinator,
                         link.tag(REPORT, 0, STEP_TIME))
        t_end = time.perf_counter()
        self.timing(step, seconds=t_end - t0, data_wait=t_data, weight_wait=t_wait, layers=t_layers,
                    compute=tg - t0 - t_data - t_wait, grad_send_wait=t_end - tg, at_backward_end=at_backward_end)
        self.log(f"step {step}: loss_sum {sum(ls for ls, _ in st.losses):.6f} tokens {sum(n for _, n in st.losses)} "
                 f"time {t_end - t0:.3f}s waiting {t_wait + t_data + t_end - tg:.3f}s")
        self.step_done(step)

    def _take_data(self, step):
        """Every round's micro-batch from the input workers, the first item's weights posted meanwhile;
        returns the micro-batches' arrays, and the first weights with their requests."""
        link, workers = self.link, self._workers
        raw, data_reqs = self.post_micro_batches(workers, self._seq)
        weights, wreqs = link.irecv_arrays(self.unit_layout(0), self._parent, FWD_WEIGHTS, 0)
        link.wait_all(data_reqs, f"input workers {workers} (micro-batches of step {step})")
        return raw, weights, wreqs

    def _compute(self, st, lanes, raw, weights, wreqs):
        """Every item of the step, each once its weights are in, the next item's weights posted before
        it computes; returns the seconds waited for weights and the seconds computing."""
        link, parent, items, precision = self.link, self._parent, self._items, self.model.precision
        t_wait, t_layers = 0.0, 0.0
        for i, (m, kind, u) in enumerate(items):
            tw = time.perf_counter()
            what = f"SwarmX rank {parent} ({kind} weights of {self.units[u].name})"
            lanes.wait(lanes.add(link.completing(wreqs, what)))  # the clock takes the headers meanwhile
            t_wait += time.perf_counter() - tw
            # A recompute item has no weights to take, its header alone (the module's docstring).
            params = None if kind == "recompute" else dict(zip(self.unit_params[u],
                                                                map(precision.from_wire, weights)))
            if i + 1 < len(items):
                _, next_kind, nu = items[i + 1]
                weights, wreqs = (([], []) if next_kind == "recompute" else
                                  link.irecv_arrays(self.unit_layout(nu), parent, WEIGHTS_PHASE[next_kind], nu))
            if kind == "backward":
                t_layers += self._backward(st, u, params, wreqs)
                lanes.advance()
                continue
            if kind == "recompute":  # the values are kept: see the module's docstring
                continue
            if u == 0:  # a new micro-batch
                self._new_round(st, m, raw)
            t_layers += self._forward(st, m, u, params, wreqs)
            lanes.advance()
        return t_wait, t_layers

    def _new_round(self, st, m, raw):
        """Round m's micro-batch, its dropout key and first input; the buffers of sends that have left go."""
        from wse_core.nn.layers import DropoutKey

        if self.link.done(st.sends, f"SwarmX rank {self._parent} (gradients of step {st.number})"):
            st.sends, st.keep = [], []  # what was sent so far has left: its buffers may go
        st.batch = self.model.batch_of(raw[m])
        st.drop = DropoutKey(self.params.runconfig.seed, st.number + 1, self.round_range(m)[0])
        st.x, st.saved = self.model.first_input(st.batch, np.float32), [None] * len(self.units)

    def _forward(self, st, m, u, params, wreqs):
        """Unit u's forward on round m's micro-batch (and the loss after the last unit); returns the
        seconds it took."""
        model = self.model
        tc = time.perf_counter()
        with self.link.progress(wreqs + st.sends):
            st.x, st.saved[u] = model.unit_forward(u, st.x, params, st.drop)
            if u == self._head:
                st.values.append(model.step_values(st.x, st.batch))  # before the loss, which may overwrite x
                loss_sum, n_tokens, st.dy = model.loss(st.x, st.batch, st.loss_scale)
                st.losses.append((loss_sum, n_tokens))
        took = time.perf_counter() - tc
        if u == self._head and m == self.n_micro - 1:
            self._report_loss(st)
        return took

    def _backward(self, st, u, params, wreqs):
        """Unit u's backward; its gradients go up to the SwarmX parent. Returns the seconds it took."""
        precision = self.model.precision
        tc = time.perf_counter()
        with self.link.progress(wreqs + st.sends):  # the next weights and the last gradients move
            st.dy, grads = self.model.unit_backward(u, st.dy, st.saved[u], params)
        took = time.perf_counter() - tc
        st.saved[u] = None
        arrays = [precision.to_wire(grads[n]) for n in self.unit_params[u]]
        st.keep.append(arrays)
        st.sends += self.link.isend_arrays(arrays, self._parent, GRADS, u)
        return took

    def _clock_lane(self, st):
        """The step in simulated time, item after item as their weights' headers come (a lane:
        ``messaging.Lanes``, behind the computing, which never waits for it before the step's end)."""
        link, parent, io, clock, nbytes = self.link, self._parent, self._io, self.clock, self.unit_stream_bytes
        accept, pending = clock.now, None
        for m, kind, u in self._items:
            h = yield from link.header(parent, WEIGHTS_PHASE[kind], u,
                                       f"SwarmX rank {parent} ({kind} weights of {self.units[u].name})")
            arrive = io.carry(nbytes[u], (h["first"], h["last"]), accept)[1]  # their last byte is in
            if pending is not None:  # the last gradients cross the port after this item's weights
                self._gradients_out(st, *pending)
                pending = None
            st.waited += max(0.0, arrive - clock.now)
            accept = clock.receive(arrive)  # the next item's weights may come in while this one computes
            seconds = self._cost[u]["backward" if kind == "backward" else "forward"]  # a recompute: a forward
            done = clock.advance(seconds)
            st.compute += seconds
            if kind == "backward":
                pending = (u, done)
            elif kind == "forward" and u == self._head and m == self.n_micro - 1:
                st.t_loss = clock.now
                self._report_loss(st)
        self._gradients_out(st, *pending)

    def _gradients_out(self, st, u, ready):
        """Unit u's gradients, ready at ``ready``, cross the port: their header goes up."""
        header, left = self._io.carry(self.unit_stream_bytes[u], (ready, None))
        st.sends.append(self.link.send_header(self._parent, GRADS, u, header, left=left))

    def _report_loss(self, st):
        """Every round's loss, once the last forward is computed and the clock has reached it."""
        if st.t_loss is not None and len(st.losses) == self.n_micro and not st.reported:
            st.reported = True
            st.sends.append(self.link.isend_object(
                LossReport(loss_sums=[ls for ls, _ in st.losses], tokens=sum(n for _, n in st.losses),
                           values=st.values, t=st.t_loss), self.plan.coordinator, self.link.tag(REPORT, 0, LOSS)))
