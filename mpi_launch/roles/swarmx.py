"""A SwarmX node: broadcasts weights down its subtree and sums gradients on their way up, for every
micro-batch of a step in the order of ``wse_core.microbatch.micro_batch_schedule``.

Simulated time: a node keeps the port of the link above it (the root: one per MemoryX server),
which carries weights down and gradient sums up in the order this program handles their headers;
each tensor's header goes on to the children (weights) or the parent (gradients) before its data.

The headers, the weights and the gradients are three lanes (``messaging.Lanes``) run side by side:
the weights go down as they come and the gradients up as both children's have landed, whatever
the headers wait for, so a CS-2 ahead of the other is not held back by it before the step's end
(docs/design/ranks.md "Lanes"). Only the headers keep the order of the port.

Its messages (``mpi_launch.protocol``): it relays STEP["forward weights"], STEP["recompute weights"]
and STEP["backward weights"] down and sums STEP["gradients"] up."""
from mpi_launch.messaging import Lanes
from mpi_launch.protocol import GRADS, WEIGHTS_PHASE
from mpi_launch.roles.base import Role


class SwarmX(Role):
    def run(self):
        from wse_core.microbatch import micro_batch_schedule

        me = self.plan.swarmx[self.index]
        self._kids = self.plan.children[me]
        self._parent = self.plan.parent[me]
        if self._parent is None:
            self._ports = [self.port(self.hw.memoryx_gbps) for _ in self.plan.memoryx]
        else:
            self._ports = [self.port(self.tree_gbps)]
        schedule = micro_batch_schedule(len(self.units))
        for step in range(self.start_step, self.max_steps):
            what = f"children {self._kids} and parent of SwarmX rank {me} (step {step})"
            headers, weights, gradients = (self._headers(schedule), self._data(schedule, self._relay, what),
                                           self._data(schedule, self._reduce, what))
            lanes = Lanes(self.link, headers, weights, gradients)
            sends, (w_sends, w_keep), (g_sends, g_keep) = (lanes.wait(lane) for lane in (headers, weights, gradients))
            self.link.wait_all(sends + w_sends + g_sends, what)  # then the buffers behind them may go
            self.step_done(step)

    def _sources(self, u):
        if self._parent is not None:
            return [self._parent] * len(self.unit_params[u])
        return [self.plan.memoryx[self.param_owner[n]] for n in self.unit_params[u]]

    def _above(self, u):
        """(the rank above for unit u's header, the port of that link)."""
        if self._parent is not None:
            return self._parent, self._ports[0]
        owner = self.plan.unit_owner[u]
        return self.plan.memoryx[owner], self._ports[owner]

    def _headers(self, schedule):
        """Every tensor's header, in the order the port carries them: an item's weights, then the
        gradients of the backward item before it. Returns the header sends."""
        link, kids, pending, sends = self.link, self._kids, None, []
        for _ in range(self.n_micro):
            for kind, u in schedule:
                above, port = self._above(u)
                h = yield from link.header(above, WEIGHTS_PHASE[kind], u,
                                           f"rank {above} (weights of {self.units[u].name})")
                header, _ = port.carry(self.unit_stream_bytes[u], (h["first"], h["last"]))
                sends += [link.send_header(k, WEIGHTS_PHASE[kind], u, header) for k in kids]
                if pending is not None:
                    yield from self._gradient_header(pending, sends)
                pending = u if kind == "backward" else None
        yield from self._gradient_header(pending, sends)
        return sends

    def _gradient_header(self, u, sends):
        above, port = self._above(u)
        hs = []
        for k in self._kids:
            hs.append((yield from self.link.header(k, GRADS, u, f"child {k} (gradients of {self.units[u].name})")))
        header, _ = port.carry(self.unit_stream_bytes[u], (max(h["first"] for h in hs), max(h["last"] for h in hs)))
        sends.append(self.link.send_header(above, GRADS, u, header, left=max(h["left"] for h in hs)))

    def _data(self, schedule, move, what):
        """A lane moving tensors (``move``: ``_relay`` or ``_reduce``) item after item; the buffers
        of what has left by the end of a micro-batch are let go. Returns the sends still in flight
        and the buffers they send from."""
        sends, keep = [], []
        for _ in range(self.n_micro):
            for kind, u in schedule:
                keep.append((yield from move(kind, u, sends)))
            if self.link.done(sends, what):
                sends, keep = [], []
        return sends, keep

    def _relay(self, kind, u, sends):
        """Every item's weights, down as they come (a recompute item has none: its header alone)."""
        if kind == "recompute":
            return None
        sources = self._sources(u)
        return (yield from self.link.relaying(self.unit_layout(u), sources, self._kids, WEIGHTS_PHASE[kind], u,
                                              f"weights of {self.units[u].name} from rank(s) {sorted(set(sources))}",
                                              sends))

    def _reduce(self, kind, u, sends):
        """A backward item's gradients, summed over the children, up as they land (up the tree, or
        from the root to each parameter's MemoryX)."""
        if kind != "backward":
            return None
        return (yield from self.link.reducing(self.unit_layout(u), self._kids, self._sources(u), GRADS, u,
                                              f"gradients of {self.units[u].name} from children {self._kids}",
                                              sends, combine=self.model.precision.wire_sum))
