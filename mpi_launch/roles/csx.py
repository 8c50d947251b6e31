"""The CS-2: runs its micro-batches one after another, each through the schedule of weight streaming
(``wse_core.perf.step.micro_batch_schedule``: forward, then segment by segment a recompute from the
checkpoint and the backward), as the weights stream through; sends each unit's gradients up.

What the emulated CS-2 keeps of a micro-batch from its forward pass to its backward (docs/design.md
section 8, "Micro-batching"): the input of every segment's first unit (the checkpoint) and the
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
are in; docs/design.md section 3).

Its messages (``mpi_launch.protocol``): it receives STEP["data"], STEP["forward weights"],
STEP["loss scale"], STEP["recompute weights"] and STEP["backward weights"], and sends STEP["loss"],
STEP["gradients"] and STEP["step time"].
"""
import time

import numpy as np

from mpi_launch.messaging import Lanes
from mpi_launch.protocol import BWD_WEIGHTS, CONTROL, DATA, FWD_WEIGHTS, GRADS, LOSS, RCP_WEIGHTS, REPORT, STEP_TIME
from mpi_launch.roles.base import Role

PHASE = {"forward": FWD_WEIGHTS, "recompute": RCP_WEIGHTS, "backward": BWD_WEIGHTS}


class CS2(Role):
    def run(self):
        from wse_core.nn.layers import DropoutKey
        from wse_core.optim.loss_scale import LossScaler
        from wse_core.perf import unit_seconds, unit_work
        from wse_core.perf.step import micro_batch_schedule

        parent = self.plan.parent[self.plan.csx[self.index]]
        w = self.plan.num_workers_per_csx
        workers = self.plan.workers[self.index]
        model, units = self.model, self.units
        precision = model.precision
        scaler = LossScaler.from_params(self.params.optimizer, model.config.get("fp16_type"))
        dynamic, loss_scale = scaler.dynamic, scaler.scale  # a static scale never changes
        io, clock, nbytes = self.port(self.hw.io_gbps), self.clock, self.unit_stream_bytes
        link, tag = self.link, self.link.tag
        seq = self.seq_len() if model.is_lm else None
        cost = [unit_seconds(unit_work(u, self.mbs, seq), self.hw) for u in units]
        items = [(m, kind, u) for m in range(self.n_micro) for kind, u in micro_batch_schedule(len(units))]
        head = len(units) - 1
        seed = self.params.runconfig.seed

        def gradients_out(u, ready):
            """Unit u's gradients, ready at ``ready``, cross the port: their header goes up."""
            header, left = io.carry(nbytes[u], (ready, None))
            sends.append(link.send_header(parent, GRADS, u, header, left=left))

        def report_loss():
            """Every round's loss, once the last forward is computed and the clock has reached it."""
            if tally["t_loss"] is not None and len(losses) == self.n_micro and not tally["reported"]:
                tally["reported"] = True
                sends.append(link.isend_object(
                    {"loss_sums": [ls for ls, _ in losses], "tokens": sum(n for _, n in losses),
                     "values": values, "t": tally["t_loss"]}, self.plan.coordinator, tag(REPORT, 0, LOSS)))

        def clock_lane():
            """The step in simulated time, item after item as their weights' headers come (a lane:
            ``messaging.Lanes``, behind the computing, which never waits for it before the step's end)."""
            accept, pending = clock.now, None
            for m, kind, u in items:
                h = yield from link.header(parent, PHASE[kind], u,
                                           f"SwarmX rank {parent} ({kind} weights of {units[u].name})")
                arrive = io.carry(nbytes[u], (h["first"], h["last"]), accept)[1]  # their last byte is in
                if pending is not None:  # the last gradients cross the port after this item's weights
                    gradients_out(*pending)
                    pending = None
                tally["waited"] += max(0.0, arrive - clock.now)
                accept = clock.receive(arrive)  # the next item's weights may come in while this one computes
                seconds = cost[u]["backward" if kind == "backward" else "forward"]  # a recompute: a forward
                done = clock.advance(seconds)
                tally["compute"] += seconds
                if kind == "backward":
                    pending = (u, done)
                elif kind == "forward" and u == head and m == self.n_micro - 1:
                    tally["t_loss"] = clock.now
                    report_loss()
            gradients_out(*pending)

        for step in range(self.start_step, self.max_steps):
            t0 = time.perf_counter()
            # Data for this step, and the first item's weights, arrive while nothing else happens yet.
            data_reqs, raw = [], []
            for m in range(self.n_micro):
                a = [np.empty(shape, dtype) for shape, dtype in model.example_layout(self.round_size(m), seq)]
                raw.append(a)
                data_reqs += [self.comm.Irecv(x, source=workers[m % w], tag=tag(DATA, m, i)) for i, x in enumerate(a)]
            weights, wreqs = link.irecv_arrays(self.unit_layout(0), parent, FWD_WEIGHTS, 0)
            link.wait_all(data_reqs, f"input workers {workers} (micro-batches of step {step})")
            t_data = time.perf_counter() - t0
            if dynamic:  # the coordinator's loss scale for this step (sent when the last step ended)
                loss_scale = link.recv_object(self.plan.coordinator, tag(CONTROL),
                                              f"the coordinator (loss scale of step {step})")["loss_scale"]
            t_wait, t_layers = 0.0, 0.0
            sends, keep, losses, values = [], [], [], []
            tally = {"waited": 0.0, "compute": 0.0, "t_loss": None, "reported": False}
            clock_of_step = clock_lane()
            lanes = Lanes(link, clock_of_step)
            for i, (m, kind, u) in enumerate(items):
                tw = time.perf_counter()
                what = f"SwarmX rank {parent} ({kind} weights of {units[u].name})"
                lanes.wait(lanes.add(link.completing(wreqs, what)))  # the clock takes the headers meanwhile
                t_wait += time.perf_counter() - tw
                # A recompute item has no weights to take, its header alone (the module's docstring).
                params = None if kind == "recompute" else dict(zip(self.unit_params[u],
                                                                    map(precision.from_wire, weights)))
                if i + 1 < len(items):
                    _, next_kind, nu = items[i + 1]
                    weights, wreqs = (([], []) if next_kind == "recompute" else
                                      link.irecv_arrays(self.unit_layout(nu), parent, PHASE[next_kind], nu))
                if kind == "backward":
                    tc = time.perf_counter()
                    with link.progress(wreqs + sends):  # the next weights and the last gradients move
                        dy, grads = model.unit_backward(u, dy, saved[u], params)
                    t_layers += time.perf_counter() - tc
                    saved[u] = None
                    arrays = [precision.to_wire(grads[n]) for n in self.unit_params[u]]
                    keep.append(arrays)
                    sends += link.isend_arrays(arrays, parent, GRADS, u)
                    lanes.advance()
                    continue
                if kind == "recompute":  # the values are kept: see the module's docstring
                    continue
                if u == 0:  # a new micro-batch
                    if link.done(sends, f"SwarmX rank {parent} (gradients of step {step})"):
                        sends, keep = [], []  # what was sent so far has left: its buffers may go
                    batch = model.batch_of(raw[m])
                    drop = DropoutKey(seed, step + 1, self.round_range(m)[0])
                    x, saved = model.first_input(batch, np.float32), [None] * len(units)
                tc = time.perf_counter()
                with link.progress(wreqs + sends):
                    x, saved[u] = model.unit_forward(u, x, params, drop)
                    if u == head:
                        values.append(model.step_values(x, batch))  # before the loss, which may overwrite x
                        loss_sum, n_tokens, dy = model.loss(x, batch, loss_scale)
                        losses.append((loss_sum, n_tokens))
                t_layers += time.perf_counter() - tc
                if u == head and m == self.n_micro - 1:
                    report_loss()
                lanes.advance()
            at_backward_end = time.monotonic()
            tg = time.perf_counter()
            lanes.wait(clock_of_step)  # the headers still to come: the CS-2s' drift is paid here, once a step
            link.wait_all(sends, f"SwarmX rank {parent} (gradients of step {step})")
            link.send_object({"compute": tally["compute"], "waited": tally["waited"]}, self.plan.coordinator,
                             tag(REPORT, 0, STEP_TIME))
            t_end = time.perf_counter()
            self.timing(step, seconds=t_end - t0, data_wait=t_data, weight_wait=t_wait, layers=t_layers,
                        compute=tg - t0 - t_data - t_wait, grad_send_wait=t_end - tg, at_backward_end=at_backward_end)
            self.log(f"step {step}: loss_sum {sum(ls for ls, _ in losses):.6f} tokens {sum(n for _, n in losses)} "
                     f"time {t_end - t0:.3f}s waiting {t_wait + t_data + t_end - tg:.3f}s")
            self.step_done(step)
