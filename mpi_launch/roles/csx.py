"""The CS-2: runs every unit on its micro-batches as the weights stream through; sends gradient sums up.

Simulated time (docs/design.md section 8): this rank keeps its CS-2's I/O port. Unit u's weights
cross it once there is room for them (a CS-2 holds two units: from the moment the previous unit
starts computing), the clock waits for them, computing a unit advances it by the model's cost
(``wse_core.perf.unit_seconds``), and each unit's gradient sum crosses the port as its backward
ends, after the next unit's weights (the order the walk in ``wse_core.perf.step`` follows; the
gradient's header is sent once that next unit's header is in, so no wall time is lost to it).

Its messages (``mpi_launch.protocol``): it receives STEP["data"], STEP["forward weights"],
STEP["loss scale"] and STEP["backward weights"], and sends STEP["loss"], STEP["gradients"] and
STEP["step time"].
"""
import time

import numpy as np

from mpi_launch.protocol import BWD_WEIGHTS, CONTROL, DATA, FWD_WEIGHTS, GRADS, LOSS, REPORT, STEP_TIME
from mpi_launch.roles.base import Role
from wse_core.tree import tree_sum


class CS2(Role):
    def run(self):
        from wse_core.nn.layers import DropoutKey
        from wse_core.optim.loss_scale import LossScaler
        from wse_core.perf import unit_seconds, unit_work

        parent = self.plan.parent[self.plan.csx[self.index]]
        w = self.plan.num_workers_per_csx
        workers = self.plan.workers[self.index]
        lm = self.model.is_lm
        precision = self.model.precision
        scaler = LossScaler.from_params(self.params.optimizer, self.model.config.get("fp16_type"))
        dynamic, loss_scale = scaler.dynamic, scaler.scale  # a static scale never changes
        io, clock, nbytes = self.port(self.hw.io_gbps), self.clock, self.unit_stream_bytes
        link, tag = self.link, self.link.tag
        seq = self.seq_len() if lm else None
        cost = [unit_seconds(unit_work(u, self.mbs, seq), self.hw) for u in self.units]
        sim_fwd = [self.n_micro * c["forward"] for c in cost]
        sim_bwd = [self.n_micro * c["backward"] for c in cost]

        def weights_arrive(phase, u, accept):
            """Carry unit u's weights across this CS-2's port: when their last byte is in."""
            h = link.recv_header(parent, phase, u, f"SwarmX rank {parent} (weights of {self.units[u].name})")
            return io.carry(nbytes[u], (h["first"], h["last"]), accept)[1]

        for step in range(self.start_step, self.max_steps):
            t0 = time.perf_counter()
            # Data for this step, and unit 0's weights, arrive while nothing else happens yet.
            data_reqs, raw = [], []
            for m in range(self.n_micro):
                src = workers[m % w]
                a = [np.empty(shape, dtype) for shape, dtype in self.model.example_layout(self.mbs, seq)]
                raw.append(a)
                data_reqs += [self.comm.Irecv(x, source=src, tag=tag(DATA, m, i)) for i, x in enumerate(a)]
            weights, wreqs = link.irecv_arrays(self.unit_layout(0), parent, FWD_WEIGHTS, 0)
            accept, waited = clock.now, 0.0
            link.wait_all(data_reqs, f"input workers {workers} (micro-batches of step {step})")
            t_data = time.perf_counter() - t0
            batches = [self.model.batch_of(a) for a in raw]
            xs = [self.model.first_input(b, np.float32) for b in batches]
            # Micro-batch m holds samples first + m * mbs ... of the step's global batch.
            first = self.index * self.n_micro * self.mbs
            seed = self.params.runconfig.seed
            drops = [DropoutKey(seed, step + 1, first + m * self.mbs) for m in range(self.n_micro)]
            saved = [[None] * self.n_micro for _ in self.units]
            t_wait = 0.0
            for u, unit in enumerate(self.units):
                arrive = weights_arrive(FWD_WEIGHTS, u, accept)
                tw = time.perf_counter()
                link.wait_all(wreqs, f"SwarmX rank {parent} (forward weights of {unit.name})")
                t_wait += time.perf_counter() - tw
                waited += max(0.0, arrive - clock.now)
                accept = clock.receive(arrive)  # the next unit may come in while this one computes
                params = dict(zip(self.unit_params[u], map(precision.from_wire, weights)))
                if u + 1 < len(self.units):  # the next unit streams in while this one computes
                    weights, wreqs = link.irecv_arrays(self.unit_layout(u + 1), parent, FWD_WEIGHTS, u + 1)
                for m, (x, kept) in enumerate(self.model.units_forward(u, xs, params, drops)):
                    xs[m], saved[u][m] = x, kept
                clock.advance(sim_fwd[u])
            if dynamic:  # the coordinator's loss scale for this step (sent when the last step ended)
                loss_scale = link.recv_object(self.plan.coordinator, tag(CONTROL),
                                              f"the coordinator (loss scale of step {step})")["loss_scale"]
            losses = [self.model.loss(xs[m], batches[m], loss_scale) for m in range(self.n_micro)]
            loss_sum = tree_sum([x[0] for x in losses])
            n_tokens = sum(x[1] for x in losses)
            report = self.comm.isend({"loss_sum": loss_sum, "tokens": n_tokens, "t": clock.now},
                                     dest=self.plan.coordinator, tag=tag(REPORT, 0, LOSS))
            dys = [x[2] for x in losses]
            last = len(self.units) - 1
            weights, wreqs = link.irecv_arrays(self.unit_layout(last), parent, BWD_WEIGHTS, last)
            accept, grad_reqs, keep, ready = clock.now, [], [], None

            def gradients_out(u, at):
                """Unit u's gradient sum, ready at ``at``, crosses the port: its header goes up."""
                header, left = io.carry(nbytes[u], (at, None))
                grad_reqs.append(link.send_header(parent, GRADS, u, header, left=left))

            for u in reversed(range(len(self.units))):
                unit = self.units[u]
                # This unit's weights cross the port before the previous unit's gradients (the
                # order the walk keeps), which is why that gradient's header goes up only now.
                arrive = weights_arrive(BWD_WEIGHTS, u, accept)
                if ready is not None:
                    gradients_out(u + 1, ready)
                tw = time.perf_counter()
                link.wait_all(wreqs, f"SwarmX rank {parent} (backward weights of {unit.name})")
                t_wait += time.perf_counter() - tw
                waited += max(0.0, arrive - clock.now)
                accept = clock.receive(arrive)
                params = dict(zip(self.unit_params[u], map(precision.from_wire, weights)))
                if u > 0:
                    weights, wreqs = link.irecv_arrays(self.unit_layout(u - 1), parent, BWD_WEIGHTS, u - 1)
                grads = []
                for m, (dy, g) in enumerate(self.model.units_backward(u, dys, saved[u], params)):
                    dys[m], saved[u][m] = dy, None
                    grads.append(g)
                ready = clock.advance(sim_bwd[u])
                total = tree_sum(grads, add=self.model.add_grads)
                arrays = [precision.to_wire(total[n]) for n in self.unit_params[u]]
                keep.append(arrays)
                grad_reqs += link.isend_arrays(arrays, parent, GRADS, u)
            gradients_out(0, ready)
            at_backward_end = time.monotonic()
            tg = time.perf_counter()
            link.wait_all(grad_reqs + [report], f"SwarmX rank {parent} (gradients of step {step})")
            self.comm.send({"compute": sum(sim_fwd) + sum(sim_bwd), "waited": waited}, dest=self.plan.coordinator,
                           tag=tag(REPORT, 0, STEP_TIME))
            t_end = time.perf_counter()
            self.timing(step, seconds=t_end - t0, data_wait=t_data, weight_wait=t_wait,
                        compute=tg - t0 - t_data - t_wait, grad_send_wait=t_end - tg, at_backward_end=at_backward_end)
            self.log(f"step {step}: loss_sum {loss_sum:.6f} tokens {n_tokens} "
                     f"time {t_end - t0:.3f}s waiting {t_wait + t_data + t_end - tg:.3f}s")
            self.step_done(step)
