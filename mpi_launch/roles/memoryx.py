"""A MemoryX server: holds the weights and optimizer state of its units, streams them out for every
micro-batch of a step, adds the micro-batches' gradient sums, applies the update.

Simulated time: the weights of a step leave when the previous update is done (the SwarmX root
keeps the port of the link); the update starts when every gradient sum has arrived and the
coordinator's control message is in, and takes ``wse_core.perf.step.update_seconds`` (the bytes
this server owns).

On this rank's own clock the update is applied a unit at a time, each unit's just before its
weights first leave in the next step, so the CS-2s compute the first units while the later ones
are updated (unless the coordinator asked for a checkpoint or an evaluation of the step, or it is
the last: then all at once); and a parameter's share of the gradient norm is taken as soon as its
last gradient is in, while the backward pass goes on. Neither changes a bit: each parameter's
update and sum of squares are the same arithmetic in any order (docs/design/ranks.md "The update a unit at a time").

Its messages (``mpi_launch.protocol``): it sends STEP["forward weights"], STEP["recompute weights"]
and STEP["backward weights"] to the SwarmX root, in the order of
``wse_core.microbatch.micro_batch_schedule`` for every round, and receives STEP["gradients"] from it,
a round at a time, adding the rounds as the reference step adds micro-batches
(``wse_core.microbatch.TreeAccumulator``); it sends the coordinator STEP["norms"], STEP["shard"] and
STEP["eval weights"] and receives STEP["control"]."""
import time

import numpy as np

from mpi_launch.protocol import (CONTROL, EVAL_WEIGHTS, GRADS, NORMS, REPORT, SHARD, WEIGHTS_PHASE, EvalWeights, Norms,
                                 Shard)
from mpi_launch.roles.base import Role


class MemoryX(Role):
    """Holds and updates the weights it owns. A step: every round's weights out (``_send_weights``,
    the last update applied as they first leave), the rounds' gradient sums in (``_sum_gradients``)
    and the norms out (``_norms_out``), then the coordinator's control: the update (``_update``), and
    a checkpoint shard or the weights for an evaluation when it asks (``after_update``)."""

    def run(self):
        self._prepare()
        clock, lat, link = self.clock, self.hw.swarmx_hop_latency_s, self.link
        later = None  # the last step's update, when it is applied as this step's weights leave
        for step in range(self.start_step - 1, self.max_steps):
            if step >= self.start_step:
                sends, wire, t_opt = self._send_weights(later)
                later = None
                total, at_grads_in = self._norms_out(step, sends)
            control = link.recv_object(self.plan.coordinator, link.tag(CONTROL), f"the coordinator (step {step})")
            clock.receive(control.t + lat)
            if step >= self.start_step:
                later = self._update(step, control, total, wire, t_opt, at_grads_in)
            self.after_update(control)
            if step >= self.start_step:
                self.step_done(step)

    def _prepare(self):
        """The weights it owns (``setup``), and where they are used: the items of the schedule it
        sends, the order the gradients come in, how many uses each parameter's total waits for."""
        from wse_core.microbatch import micro_batch_schedule
        from wse_core.perf.step import update_seconds

        owned = [n for n in self.model.param_names if self.param_owner[n] == self.index]
        self.setup(owned)
        # (unit, index) of every use of an owned parameter: a tied parameter is used twice.
        self._uses = [(u, i, n) for u, names in enumerate(self.unit_params) for i, n in enumerate(names)
                      if self.param_owner[n] == self.index]
        self._my_units = [u for u, k in enumerate(self.plan.unit_owner) if k == self.index]
        # Every item of an owned unit (one without parameters too: its header), and of a unit using an
        # owned parameter (a tied one, in another server's unit).
        mine = set(self._my_units) | {u for u, _, _ in self._uses}
        self._schedule = [(kind, u) for kind, u in micro_batch_schedule(len(self.units)) if u in mine]
        self._update_s = update_seconds(self.model, self.plan.unit_owner, self.hw)[self.index]
        self._unit_uses = {u: [(i, n) for uu, i, n in self._uses if uu == u] for u in mine}
        # The order the gradients come in (the backward items'), and how many uses each parameter's
        # total waits for (a tied one: two).
        self._coming = [u for kind, u in self._schedule if kind == "backward"]
        self._n_uses = {n: sum(1 for _, _, m in self._uses if m == n) for n in owned}

    def _send_weights(self, later):
        """Every round's weights to the SwarmX root, item after item, each parameter updated by the
        last step's update (``later``) just before its first use leaves (the module's docstring).
        Returns the sends, the weights on the wire, and the optimizer's seconds before the first send
        and behind it."""
        link, root, clock, precision = self.link, self.plan.swarmx_root, self.clock, self.model.precision
        sends, wire, t_opt = [], {}, [0.0, 0.0]
        # Weights go out in the run's precision (16-bit patterns in a mixed-precision run),
        # every round's at once: the SwarmX root's port carries them in this order.
        for _ in range(self.n_micro):
            for kind, u in self._schedule:
                for i, n in self._unit_uses[u]:
                    if n not in wire:  # its first use: updated (the module's docstring), on the wire
                        if later is not None:
                            t0 = time.perf_counter()
                            self.apply(*later, [n])
                            t_opt[bool(sends)] += time.perf_counter() - t0
                        wire[n] = precision.to_wire(self.weights[n])
                if u in self._my_units:  # the unit's owner sends its header
                    sends.append(link.send_header(root, WEIGHTS_PHASE[kind], u, (clock.now, None)))
                if kind != "recompute":  # a recompute item is its header alone (roles.csx)
                    sends += [r for i, n in self._unit_uses[u]
                              for r in link.isend_arrays([wire[n]], root, WEIGHTS_PHASE[kind], u, index=i)]
        return sends, wire, t_opt

    def _norms_out(self, step, sends):
        """The step's gradients in, its weights' sends done, the norms to the coordinator; returns the
        gradients' totals and when the last came in (``time.monotonic``)."""
        root, clock = self.plan.swarmx_root, self.clock
        total, norms, last, left = self._sum_gradients(step)
        self.link.wait_all(sends, f"SwarmX root rank {root} (weights of step {step})")
        at_grads_in = time.monotonic()
        clock.receive(last)
        self.link.send_object(Norms(sumsq=[(n, norms[n]) for n in self.owned], t=clock.now, left=left),
                              self.plan.coordinator, self.link.tag(REPORT, 0, NORMS))
        return total, at_grads_in

    def _sum_gradients(self, step):
        """Every round's gradient sums from the SwarmX root, added as the reference step adds
        micro-batches; a parameter's total and its share of the norm are taken as soon as its last
        use is in. Returns the totals, the shares, and the latest ``last`` and ``left`` of the headers."""
        from wse_core.optim import sum_of_squares
        from wse_core.microbatch import TreeAccumulator

        link, root, precision, uses = self.link, self.plan.swarmx_root, self.model.precision, self._uses
        sums = {(u, i): TreeAccumulator(self.n_micro, precision.add) for u, i, _ in uses}
        last = left = 0.0
        total, norms, waiting = {}, {}, dict(self._n_uses)
        for r in range(self.n_micro):
            got, greqs = {}, {}
            for u, i, n in uses:
                got[u, i] = np.empty(self.shapes[n], precision.wire_dtype)
                greqs.setdefault(u, []).extend(link.irecv_into([got[u, i]], root, GRADS, u, index=i))
            for u in self._coming:
                if u in self._my_units:
                    h = link.recv_header(root, GRADS, u, f"SwarmX root rank {root} (gradients of step {step})")
                    last, left = max(last, h["last"]), max(left, h["left"])
                link.wait_all(greqs.get(u, []), f"SwarmX root rank {root} (gradients of "
                                                f"{self.units[u].name}, round {r} of step {step})")
                for i, n in self._unit_uses[u]:
                    sums[u, i].push(precision.from_wire(got[u, i]))
                    if r == self.n_micro - 1:
                        waiting[n] -= 1
                        if not waiting[n]:  # its total is in: its share of the norm
                            # A tied parameter's uses are added in unit order, as
                            # Model.combine_unit_grads does.
                            gs = [sums[uu, ii].total() for uu, ii, m in uses if m == n]
                            total[n] = gs[0] if len(gs) == 1 else precision.add(gs[0], gs[1])
                            norms[n] = sum_of_squares(total[n])
        return total, norms, last, left

    def _update(self, step, control, total, wire, t_opt, at_grads_in):
        """The coordinator's update of ``step`` on the clock, and applied now if the step's weights are
        wanted (a checkpoint, an evaluation, the last step); otherwise it is returned, to be applied a
        unit at a time as the next step's weights leave. The step's timing line."""
        later = None
        if not control.skip:
            self.clock.advance(self._update_s)
        if control.checkpoint is not None or control.evaluate or step == self.max_steps - 1:
            t0 = time.perf_counter()
            self.apply(control, total, step, self.owned)  # the weights of this step are wanted now
            t_opt[0] += time.perf_counter() - t0
        else:
            later = (control, total, step)
        schedule = self._schedule
        nbytes = {u: sum(wire[n].nbytes for _, n in self._unit_uses[u]) for _, u in schedule}
        self.timing(step, optimizer=t_opt[0], optimizer_behind=t_opt[1], at_grads_in=at_grads_in,
                    bytes_out=self.n_micro * sum(nbytes[u] for kind, u in schedule if kind != "recompute"),
                    bytes_in=self.n_micro * sum(nbytes[u] for kind, u in schedule if kind == "backward"))
        return later

    def setup(self, owned):
        """The weights and optimizer state of the parameters ``owned``: from the run's checkpoint, or new."""
        from data_tools.checkpoint import Checkpoint
        o = self.params.optimizer
        self.optimizer = o.optimizer()
        self.lr_factors = self.model.lr_factors(o.adjust_learning_rate)
        if self.run_info["checkpoint"]:
            self.weights, self.state = Checkpoint(self.run_info["checkpoint"]).load(owned)
            for n in owned:  # a weights-only checkpoint (wse checkpoint from-hf): the optimizer starts fresh
                if not self.state[n]:
                    self.state[n] = self.optimizer.init_state(self.weights[n])
            self.log(f"loaded {len(owned)} parameters from {self.run_info['checkpoint']}")
        else:
            self.weights = self.model.init_params(self.params.runconfig.seed, names=owned)
            self.state = {n: self.optimizer.init_state(self.weights[n]) for n in owned}
        self.owned = owned
        # The CSR pattern of owned sparse weights, saved with every checkpoint beside their values.
        self.sparse = {n: {"indptr": st.indptr, "indices": st.indices, "shape": np.array(st.shape, np.int64)}
                       for n, st in self.model.structures.items() if n in owned}

    def apply(self, control, grads, step, names):
        """The update the coordinator ordered, of the parameters ``names`` (none for a step whose
        16-bit gradients overflowed)."""
        from wse_core.nn.reference import apply_update

        if not control.skip:
            apply_update(self.model, self.weights, self.state, self.optimizer, grads, control.grad_scale,
                         step=step + 1, lr=control.lr, lr_factors=self.lr_factors, names=names)

    def after_update(self, control):
        """A checkpoint shard, and the weights for an evaluation, when the coordinator asks for them."""
        from data_tools.checkpoint import CheckpointWriter

        coordinator = self.plan.coordinator
        if control.checkpoint is not None:
            writer = CheckpointWriter(self.model_dir, control.checkpoint)
            table = writer.write_shard(self.index, self.weights, self.state, sparse=self.sparse)
            self.link.send_object(Shard(table), coordinator, self.link.tag(REPORT, 0, SHARD))
        if control.evaluate:  # the coordinator evaluates the weights of this step on eval_input
            self.link.send_object(EvalWeights({n: self.weights[n] for n in self.owned}), coordinator,
                                  self.link.tag(REPORT, 0, EVAL_WEIGHTS))
