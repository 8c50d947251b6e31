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
update and sum of squares are the same arithmetic in any order (docs/design.md section 3).

Its messages (``mpi_launch.protocol``): it sends STEP["forward weights"], STEP["recompute weights"]
and STEP["backward weights"] to the SwarmX root, in the order of
``wse_core.perf.step.micro_batch_schedule`` for every round, and receives STEP["gradients"] from it,
a round at a time, adding the rounds as the reference step adds micro-batches
(``wse_core.tree.TreeAccumulator``); it sends the coordinator STEP["norms"], STEP["shard"] and
STEP["eval weights"] and receives STEP["control"]."""
import time

import numpy as np

from mpi_launch.protocol import CONTROL, EVAL_WEIGHTS, GRADS, NORMS, REPORT, SHARD
from mpi_launch.roles.base import Role
from mpi_launch.roles.csx import PHASE


class MemoryX(Role):
    def run(self):
        from wse_core.optim import sum_of_squares
        from wse_core.perf.step import micro_batch_schedule, update_seconds
        from wse_core.tree import TreeAccumulator

        owned = [n for n in self.model.param_names if self.param_owner[n] == self.index]
        self.setup(owned)
        root = self.plan.swarmx_root
        # (unit, index) of every use of an owned parameter: a tied parameter is used twice.
        uses = [(u, i, n) for u, names in enumerate(self.unit_params) for i, n in enumerate(names)
                if self.param_owner[n] == self.index]
        my_units = [u for u, k in enumerate(self.plan.unit_owner) if k == self.index]
        # Every item of an owned unit (one without parameters too: its header), and of a unit using an
        # owned parameter (a tied one, in another server's unit).
        mine = set(my_units) | {u for u, _, _ in uses}
        schedule = [(kind, u) for kind, u in micro_batch_schedule(len(self.units)) if u in mine]
        update_s = update_seconds(self.model, self.plan.unit_owner, self.hw)[self.index]
        clock, lat = self.clock, self.hw.swarmx_hop_latency_s
        link, tag = self.link, self.link.tag
        coordinator = self.plan.coordinator
        precision = self.model.precision
        unit_uses = {u: [(i, n) for uu, i, n in uses if uu == u] for u in mine}
        # The order the gradients come in (the backward items'), and how many uses each parameter's
        # total waits for (a tied one: two).
        coming = [u for kind, u in schedule if kind == "backward"]
        n_uses = {n: sum(1 for _, _, m in uses if m == n) for n in owned}
        later = None  # the last step's update, when it is applied as this step's weights leave
        for step in range(self.start_step - 1, self.max_steps):
            if step >= self.start_step:
                sends, wire, t_opt = [], {}, [0.0, 0.0]
                # Weights go out in the run's precision (16-bit patterns in a mixed-precision run),
                # every round's at once: the SwarmX root's port carries them in this order.
                for _ in range(self.n_micro):
                    for kind, u in schedule:
                        for i, n in unit_uses[u]:
                            if n not in wire:  # its first use: updated (the module's docstring), on the wire
                                if later is not None:
                                    t0 = time.perf_counter()
                                    self.apply(*later, [n])
                                    t_opt[bool(sends)] += time.perf_counter() - t0
                                wire[n] = precision.to_wire(self.weights[n])
                        if u in my_units:  # the unit's owner sends its header
                            sends.append(link.send_header(root, PHASE[kind], u, (clock.now, None)))
                        if kind != "recompute":  # a recompute item is its header alone (roles.csx)
                            sends += [r for i, n in unit_uses[u]
                                      for r in link.isend_arrays([wire[n]], root, PHASE[kind], u, index=i)]
                later = None
                sums = {(u, i): TreeAccumulator(self.n_micro, precision.add) for u, i, _ in uses}
                last = left = 0.0
                total, norms, waiting = {}, {}, dict(n_uses)
                for r in range(self.n_micro):
                    got, greqs = {}, {}
                    for u, i, n in uses:
                        got[u, i] = np.empty(self.shapes[n], precision.wire_dtype)
                        greqs.setdefault(u, []).extend(link.irecv_into([got[u, i]], root, GRADS, u, index=i))
                    for u in coming:
                        if u in my_units:
                            h = link.recv_header(root, GRADS, u, f"SwarmX root rank {root} (gradients of step {step})")
                            last, left = max(last, h["last"]), max(left, h["left"])
                        link.wait_all(greqs.get(u, []), f"SwarmX root rank {root} (gradients of "
                                                        f"{self.units[u].name}, round {r} of step {step})")
                        for i, n in unit_uses[u]:
                            sums[u, i].push(precision.from_wire(got[u, i]))
                            if r == self.n_micro - 1:
                                waiting[n] -= 1
                                if not waiting[n]:  # its total is in: its share of the norm
                                    # A tied parameter's uses are added in unit order, as
                                    # Model.combine_unit_grads does.
                                    gs = [sums[uu, ii].total() for uu, ii, m in uses if m == n]
                                    total[n] = gs[0] if len(gs) == 1 else precision.add(gs[0], gs[1])
                                    norms[n] = sum_of_squares(total[n])
                link.wait_all(sends, f"SwarmX root rank {root} (weights of step {step})")
                at_grads_in = time.monotonic()
                clock.receive(last)
                link.send_object({"sumsq": [(n, norms[n]) for n in owned], "t": clock.now, "left": left},
                                 coordinator, tag(REPORT, 0, NORMS))
            control = link.recv_object(coordinator, tag(CONTROL), f"the coordinator (step {step})")
            clock.receive(control["t"] + lat)
            if step >= self.start_step:
                if not control["skip"]:
                    clock.advance(update_s)
                if control["checkpoint"] is not None or control.get("eval") or step == self.max_steps - 1:
                    t0 = time.perf_counter()
                    self.apply(control, total, step, owned)  # the weights of this step are wanted now
                    t_opt[0] += time.perf_counter() - t0
                else:
                    later = (control, total, step)
                nbytes = {u: sum(wire[n].nbytes for _, n in unit_uses[u]) for _, u in schedule}
                self.timing(step, optimizer=t_opt[0], optimizer_behind=t_opt[1], at_grads_in=at_grads_in,
                            bytes_out=self.n_micro * sum(nbytes[u] for kind, u in schedule if kind != "recompute"),
                            bytes_in=self.n_micro * sum(nbytes[u] for kind, u in schedule if kind == "backward"))
            self.after_update(control)
            if step >= self.start_step:
                self.step_done(step)

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
        if control["skip"]:
            return
        for n in names:
            self.optimizer.update(self.weights[n], grads[n], self.state[n], step=step + 1,
                                  lr=control["lr"] * self.lr_factors[n], grad_scale=control["grad_scale"],
                                  name=n, decay=self.model.param_specs[n].decay)

    def after_update(self, control):
        """A checkpoint shard, and the weights for an evaluation, when the coordinator asks for them."""
        from data_tools.checkpoint import CheckpointWriter

        coordinator = self.plan.coordinator
        if control["checkpoint"] is not None:
            writer = CheckpointWriter(self.model_dir, control["checkpoint"])
            table = writer.write_shard(self.index, self.weights, self.state, sparse=self.sparse)
            self.link.send_object(table, coordinator, self.link.tag(REPORT, 0, SHARD))
        if control.get("eval"):  # the coordinator evaluates the weights of this step on eval_input
            self.link.send_object({n: self.weights[n] for n in self.owned}, coordinator,
                                  self.link.tag(REPORT, 0, EVAL_WEIGHTS))
