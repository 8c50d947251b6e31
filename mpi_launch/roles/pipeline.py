"""The CS-2 of a pipelined run: every layer stays on the wafer with its gradients and optimizer
state, samples flow through the layers, and the update happens here (docs/design.md section 3).

It is a MemoryX for all the weights that computes the step itself: the same forward, loss and
backward as the reference step (``wse_core.nn.reference.accumulate``, the balanced tree over
micro-batches the weight-streaming cluster keeps too), then the coordinator's protocol of a
MemoryX server (norms in, control back, update, checkpoint shard 0, weights for an evaluation).
So its weights are bit-identical to weight streaming and to the reference, and its checkpoints
are a weight-streaming run's with one MemoryX.

Simulated time: the pipelined step of ``wse_core.perf.pipeline`` (fill, slowest stage, drain)
for the compute, and its on-wafer update.

Its messages (``mpi_launch.protocol``): it receives STEP["data"], STEP["loss scale"] and
STEP["control"], and sends STEP["loss"], STEP["norms"], STEP["step time"], and STEP["shard"] and
STEP["eval weights"] as a MemoryX does."""
import time

import numpy as np

from mpi_launch.protocol import (CONTROL, LOSS, NORMS, REPORT, STEP_TIME, Control, LossReport, LossScale, Norms,
                                 StepTime)
from mpi_launch.roles.memoryx import MemoryX


class PipelinedCS2(MemoryX):
    """Computes each step itself (``_compute_step``: its data in, the reference step's forward, loss
    and backward, the reports out), then takes the coordinator's control as a MemoryX does."""

    def run(self):
        from wse_core.optim.loss_scale import LossScaler

        self.setup(list(self.model.param_names))
        placement = self.resolved.placement
        self._compute_s, update_s = placement.step_s - placement.update_s, placement.update_s
        scaler = LossScaler.from_params(self.params.optimizer, self.model.config.get("fp16_type"))
        # A static scale never changes; a dynamic one comes each step.
        self._dynamic, self._loss_scale = scaler.dynamic, scaler.scale
        self._seq = self.seq_len() if self.model.is_lm else None
        clock, lat = self.clock, self.hw.swarmx_hop_latency_s
        self._controls = []
        for step in range(self.start_step - 1, self.max_steps):
            if step >= self.start_step:
                t0 = time.perf_counter()
                t_data, loss_sum, n_tokens, grads = self._compute_step(step, t0)
                t_compute = time.perf_counter() - t0 - t_data
            control = self._control(Control, step)
            clock.receive(control.t + lat)
            if step >= self.start_step:
                t_opt = time.perf_counter()
                self.apply(control, grads, step, self.owned)
                if not control.skip:
                    clock.advance(update_s)
                self.timing(step, seconds=time.perf_counter() - t0, data_wait=t_data, compute=t_compute,
                            optimizer=time.perf_counter() - t_opt)
                self.log(f"step {step}: loss_sum {loss_sum:.6f} tokens {n_tokens}")
            self.after_update(control)
            if step >= self.start_step:
                self.step_done(step)

    def _compute_step(self, step, t0):
        """The step begun at ``t0``: its micro-batches from the input workers, the reference step's
        forward, loss and backward on them, and the reports of a CS-2 and of a MemoryX to the
        coordinator. Returns the seconds waited for data, the loss sum, its tokens and the gradients."""
        from wse_core.nn.reference import accumulate
        from wse_core.optim import sum_of_squares

        model, tag, coordinator, clock = self.model, self.link.tag, self.plan.coordinator, self.clock
        workers = self.plan.workers[0]
        raw, reqs = self.post_micro_batches(workers, self._seq)
        self.link.wait_all(reqs, f"input workers {workers} (micro-batches of step {step})")
        t_data = time.perf_counter() - t0
        batch = model.batch_of([np.concatenate([r[i] for r in raw]) for i in range(len(raw[0]))])
        if self._dynamic:
            self._loss_scale = self._control(LossScale, step).scale
        loss_sum, n_tokens, unit_grads, values = accumulate(
            model, model.compute_weights(self.weights), batch, self.mbs,
            dropout=(self.params.runconfig.seed, step + 1), loss_scale=self._loss_scale)
        grads = model.combine_unit_grads(unit_grads)
        clock.advance(self._compute_s)
        send = self.link.send_object
        # the micro-batches' values each (the coordinator combines them as the CS-2s' in their order)
        send(LossReport(loss_sums=[loss_sum], tokens=n_tokens, values=values, t=clock.now), coordinator,
             tag(REPORT, 0, LOSS))
        send(Norms(sumsq=[(n, sum_of_squares(grads[n])) for n in self.owned], t=clock.now, left=clock.now),
             coordinator, tag(REPORT, 0, NORMS))
        send(StepTime(compute=self._compute_s, waited=0.0), coordinator, tag(REPORT, 0, STEP_TIME))
        return t_data, loss_sum, n_tokens, grads

    def _control(self, kind, step):
        """The coordinator's next CONTROL message of type ``kind``: this rank gets both the CS-2's
        (``LossScale``) and the MemoryX server's (``Control``), in the order they were sent."""
        while not any(isinstance(c, kind) for c in self._controls):
            self._controls.append(self.link.recv_object(self.plan.coordinator, self.link.tag(CONTROL),
                                                        f"the coordinator (step {step})"))
        i = next(i for i, c in enumerate(self._controls) if isinstance(c, kind))
        return self._controls.pop(i)
