"""The KV cache of the sequences being generated, and attention over it (docs/design/inference.md
"Generation").

Each sequence has its own length and, per attention unit, its keys and values ``[kv heads, T, d]``
for every position so far, in buffers sized once for the longest it may grow to. A step of
generation runs the model's units on the new positions of the step's sequences at once (the
products, norms and activations of training: the units' own ``infer``), except attention, which
each sequence does over its own cache: ``attend`` writes the new keys and values at the sequence's
positions and computes softmax(q k^T) v with the causal mask of those positions
(``ops.causal_softmax_forward`` on a [t, L] block: the last t of L positions). A sequence's results
do not depend on the others in the step: its rows of the dense products meet BLAS cut at sample
boundaries (``sample_rows``), its attention is its own. Sequences join (``add``) and leave
(``remove``) between steps, as continuous batching needs.
"""
import numpy as np

from wse_core.nn.gemm import matmul


class KVCache:
    """The caches of the sequences being generated, each able to hold ``capacity`` positions."""

    def __init__(self, capacity):
        self.capacity = int(capacity)
        self.lengths = {}   # sequence id -> positions cached
        self.buffers = {}   # sequence id -> {unit name: (k, v) [kv heads, capacity, d]}
        self.active, self.new = [], 0  # the step under way: its sequences, and the positions each adds
        self._next = 0

    def add(self, i=None):
        """A new, empty sequence; returns its id: ``i`` (a CS-2 keeps the ids the coordinator gave),
        or the next unused one."""
        if i is None:
            i = self._next
        elif i in self.lengths:
            raise ValueError(f"sequence {i} is already in the KV cache")
        self._next = max(self._next, i + 1)
        self.lengths[i], self.buffers[i] = 0, {}
        return i

    def remove(self, i):
        del self.lengths[i], self.buffers[i]

    def begin(self, active, t):
        """Start a step adding ``t`` positions to each sequence of ``active`` (ids, in the batch's order)."""
        for i in active:
            if self.lengths[i] + t > self.capacity:
                raise ValueError(f"{self.lengths[i] + t} positions exceed the model's {self.capacity} "
                                 "(model.max_position_embeddings)")
        self.active, self.new = list(active), t

    def end(self):
        for i in self.active:
            self.lengths[i] += self.new
        self.active, self.new = [], 0

    def starts(self):
        """The first new position of each sequence of the step."""
        return [self.lengths[i] for i in self.active]

    def positions(self):
        """[batch, t] absolute positions of the step's new tokens."""
        return np.asarray(self.starts())[:, None] + np.arange(self.new)[None, :]

    def attend(self, name, q, k, v, scale, ops, group=1):
        """Attention output [b, heads, t, d] of queries q [b, heads, t, d] over each sequence's cache,
        after writing the step's keys and values k, v [b, kv heads, t, d] into it (a kv head serves
        ``group`` query heads)."""
        b, nh, t, d = q.shape
        out = np.empty_like(q)
        for row, i in enumerate(self.active):
            bufs = self.buffers[i].get(name)
            if bufs is None:
                bufs = self.buffers[i][name] = tuple(np.empty((k.shape[1], self.capacity, d), k.dtype)
                                                     for _ in range(2))
            start = self.lengths[i]
            end = start + t
            bufs[0][:, start:end], bufs[1][:, start:end] = k[row], v[row]
            keys, values = (np.ascontiguousarray(np.repeat(buf[:, :end], group, axis=0) if group > 1 else buf[:, :end])
                            for buf in bufs)
            scores = matmul(q[row], keys.transpose(0, 2, 1))                 # [heads, t, end]
            ops.causal_softmax_forward(scores, scale)
            out[row] = matmul(scores, values)
        return out
