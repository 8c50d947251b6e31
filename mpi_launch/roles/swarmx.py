"""A SwarmX node: broadcasts weights down its subtree and sums gradients on their way up, for every
micro-batch of a step in the order of ``wse_core.perf.step.micro_batch_schedule``.

Simulated time: a node keeps the port of the link above it (the root: one per MemoryX server),
which carries weights down and gradient sums up in the order this program handles them; each
tensor's header goes on to the children (weights) or the parent (gradients) before its data.

Its messages (``mpi_launch.protocol``): it relays STEP["forward weights"], STEP["recompute weights"]
and STEP["backward weights"] down and sums STEP["gradients"] up."""
from mpi_launch.protocol import BWD_WEIGHTS, FWD_WEIGHTS, GRADS, RCP_WEIGHTS
from mpi_launch.roles.base import Role

PHASE = {"forward": FWD_WEIGHTS, "recompute": RCP_WEIGHTS, "backward": BWD_WEIGHTS}


class SwarmX(Role):
    def run(self):
        from wse_core.perf.step import micro_batch_schedule

        me = self.plan.swarmx[self.index]
        kids = self.plan.children[me]
        parent = self.plan.parent[me]
        n_units = len(self.units)
        if parent is None:
            self._ports = [self.port(self.hw.memoryx_gbps) for _ in self.plan.memoryx]
        else:
            self._ports = [self.port(self.tree_gbps)]
        schedule = micro_batch_schedule(n_units)
        for step in range(self.start_step, self.max_steps):
            self._pending, self._keep = [], []  # requests in flight, and the buffers they use
            pending = None  # a unit whose gradients come up once the next item's weights went down
            for _ in range(self.n_micro):
                for kind, u in schedule:
                    self._relay(u, PHASE[kind], parent, kids, step)
                    if pending is not None:
                        self._reduce(pending, parent, kids, step)
                    pending = u if kind == "backward" else None
                if self.link.done(self._pending, f"children {kids} and parent of SwarmX rank {me} (step {step})"):
                    self._pending, self._keep = [], []  # what has been sent: let its buffers go
            self._reduce(pending, parent, kids, step)
            self.link.wait_all(self._pending, f"children {kids} and parent of SwarmX rank {me} (step {step})")
            self.step_done(step)

    def _sources(self, u, parent):
        if parent is not None:
            return [parent] * len(self.unit_params[u])
        return [self.plan.memoryx[self.param_owner[n]] for n in self.unit_params[u]]

    def _above(self, u, parent):
        """(the rank above for unit u's header, the port of that link)."""
        if parent is not None:
            return parent, self._ports[0]
        owner = self.plan.unit_owner[u]
        return self.plan.memoryx[owner], self._ports[owner]

    def _relay(self, u, phase, parent, kids, step):
        above, port = self._above(u, parent)
        h = self.link.recv_header(above, phase, u, f"rank {above} (weights of {self.units[u].name})")
        header, _ = port.carry(self.unit_stream_bytes[u], (h["first"], h["last"]))
        self._pending += [self.link.send_header(k, phase, u, header) for k in kids]
        sources = self._sources(u, parent)
        arrays, sends = self.link.relay(self.unit_layout(u), sources, kids, phase, u,
                                        f"weights of {self.units[u].name} from rank(s) {sorted(set(sources))}")
        self._pending += sends
        self._keep.append(arrays)

    def _reduce(self, u, parent, kids, step):
        above, port = self._above(u, parent)
        hs = [self.link.recv_header(k, GRADS, u, f"child {k} (gradients of {self.units[u].name})") for k in kids]
        header, _ = port.carry(self.unit_stream_bytes[u], (max(h["first"] for h in hs), max(h["last"] for h in hs)))
        self._pending.append(self.link.send_header(above, GRADS, u, header, left=max(h["left"] for h in hs)))
        dests = self._sources(u, parent)  # up the tree, or from the root to each parameter's MemoryX
        sums, sends = self.link.reduce(self.unit_layout(u), kids, dests, GRADS, u,
                                       f"gradients of {self.units[u].name} from children {kids}",
                                       combine=self.model.precision.wire_sum)
        self._pending += sends
        self._keep.append(sums)
