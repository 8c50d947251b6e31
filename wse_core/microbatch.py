"""A training step's micro-batches, in one place: how a global batch is dealt to the CS-2s'
micro-batches (``MicroBatches``), the order a micro-batch runs the model's units
(``micro_batch_schedule``), and the one summation order of the project (``tree_reduce``).

It sits on the bottom floor, below both what obeys it (the ranks, the reference step, the compiler's
runner) and what times it (``wse_core.perf``), so the two cannot disagree (docs/design.md section 3;
what it assumes of the hardware: docs/design/time-model.md "Micro-batching").

The order of sums: a balanced pairwise tree over items in index order. A sum over micro-batches is
``tree_reduce(0, n, leaf, add)``: split [lo, hi) at ``(lo + hi) // 2``, sum each half, add left +
right. A weight-streaming step computes its n micro-batches in rounds: in round r, CS-2 c computes
micro-batch ``r * num_csx + c`` (``MicroBatches.index``), SwarmX sums the round's num_csx gradients
with ``tree_sum`` in CS-2 order, and MemoryX adds the rounds with a ``TreeAccumulator``. When the
number of rounds is a power of two, the rounds' contiguous groups of num_csx items are exactly the
subtrees at depth log2(rounds), so (with SwarmX's own tree a balanced one: num_csx up to its
fan-out, or both powers of two) the cluster gives the bits of one process summing all n items.
"""
import math
from dataclasses import dataclass
from functools import cached_property

from wse_core.errors import ConfigError


def share(items, parts):
    """Each of ``parts``' share of ``items``, rounded up: ceil(items / parts) (a CS-2's samples of a
    batch, a micro-batch count, a sequence group)."""
    return -(-items // parts)


@dataclass(frozen=True)
class MicroBatches:
    """A step's ``batch_size`` samples dealt to the micro-batches of ``num_csx`` CS-2s, each computing
    ``rounds`` of at most ``size`` samples: R = ceil(ceil(B / num_csx) / size) rounds a CS-2, and the B
    samples dealt to the num_csx x R micro-batches as evenly as they go, the first B mod (num_csx x R)
    one sample larger (a batch that divides evenly gives micro-batches of ``size`` each). A bad
    combination is a ConfigError naming the key at fault."""
    batch_size: int
    size: int
    num_csx: int = 1

    def __post_init__(self):
        if not 1 <= self.num_csx <= self.batch_size:
            raise ConfigError(f"batch_size: {self.batch_size} samples cannot feed {self.num_csx} CS-2s")
        if not 1 <= self.size <= self.per_csx:
            raise ConfigError(f"micro_batch_size: {self.size} is not between 1 and the {self.per_csx} samples "
                              "of a CS-2 (batch_size / num_csx, rounded up)")
        if self.count > self.batch_size:
            raise ConfigError(f"micro_batch_size: {self.size} makes {self.count} micro-batches of a batch of "
                              f"{self.batch_size} samples")

    @property
    def per_csx(self):
        """The samples a CS-2 computes at most (its share, rounded up)."""
        return share(self.batch_size, self.num_csx)

    @property
    def rounds(self):
        """The micro-batches each CS-2 computes a step."""
        return share(self.per_csx, self.size)

    @property
    def count(self):
        """The step's micro-batches over all its CS-2s."""
        return self.num_csx * self.rounds

    @cached_property
    def ranges(self):
        """[(lo, hi), ...] of every micro-batch, in the global batch's order. A power of two of them
        are the nodes of the tree over samples at their depth (``aligned``: the batch halved at
        ``(lo + hi) // 2``, again and again), which differ in size by at most one as an even dealing
        does; any other count, an even dealing, the first B mod count one sample larger."""
        n, count = self.batch_size, self.count
        if count & (count - 1) == 0:
            def halve(lo, hi, parts):
                mid = (lo + hi) // 2
                return [(lo, hi)] if parts == 1 else halve(lo, mid, parts // 2) + halve(mid, hi, parts // 2)

            return halve(0, n, count)
        size, extra = divmod(n, count)
        bounds = [j * size + min(j, extra) for j in range(count + 1)]
        return list(zip(bounds[:-1], bounds[1:]))

    @cached_property
    def aligned(self):
        """Whether ``tree_reduce`` over these micro-batches, each the tree over its own samples, is the
        tree over the batch's samples: each split of the micro-batches at ``(lo + hi) // 2`` falls on
        its samples' split (``wse_core.nn.sample_tree``)."""
        def check(lo, hi):
            if hi - lo == 1:
                return True
            mid = (lo + hi) // 2
            first, end = self.ranges[lo][0], self.ranges[hi - 1][1]
            return self.ranges[mid][0] == (first + end) // 2 and check(lo, mid) and check(mid, hi)

        return check(0, self.count)

    def index(self, round_, csx):
        """The global batch's micro-batch that CS-2 ``csx`` computes in round ``round_``."""
        return round_ * self.num_csx + csx

    def range_of(self, round_, csx):
        """(lo, hi) of the samples CS-2 ``csx`` computes in round ``round_``."""
        return self.ranges[self.index(round_, csx)]

    def sums_as_one(self, swarmx_fanout):
        """Whether the cluster sums these micro-batches as one process does (``tree_reduce`` over all of
        them), so its bits are the single-process reference's: one CS-2 (its rounds are the items
        themselves), or a power of two of rounds with SwarmX's own tree a balanced one (the module's
        docstring)."""
        def pow2(n):
            return n & (n - 1) == 0

        return self.num_csx == 1 or pow2(self.rounds) and (
            self.num_csx <= swarmx_fanout or pow2(self.num_csx) and pow2(swarmx_fanout))

    def sample_tree(self, swarmx_fanout):
        """Whether the step's sums are the tree over the batch's samples, whose bits no micro-batch size
        nor num_csx changes (docs/design.md section 5, (a)): the cluster sums as one process does, and
        the micro-batches are that tree's nodes."""
        return self.sums_as_one(swarmx_fanout) and self.aligned

    @staticmethod
    def even_sizes(batch_size, num_csx=1):
        """The micro-batch sizes that deal a batch evenly, smallest first: each CS-2's share over a whole
        number of rounds, rounded up, as Cerebras takes them (a size between two of these computes no
        fewer rounds than the larger one)."""
        per_csx = share(batch_size, num_csx)
        sizes = {share(per_csx, k) for k in range(1, per_csx + 1)}
        return sorted(b for b in sizes if num_csx * share(per_csx, b) <= batch_size)


def checkpoint_interval(n_units):
    """Units per recomputed segment: ceil(sqrt(n)), which keeps the fewest boundaries (n/k + k)."""
    return max(1, math.ceil(math.sqrt(n_units)))


def micro_batch_schedule(n_units):
    """What a CS-2 does with one micro-batch, in order, as (kind, unit): "forward" every unit; then
    segment by segment from the last (``checkpoint_interval`` units each), "recompute" the segment's
    forward from its checkpoint (not the last segment's, whose activations are still on the wafer) and
    "backward" its units in reverse. Every item streams its unit's weights in (STEP["forward weights"],
    STEP["recompute weights"], STEP["backward weights"]); a backward item sends the unit's gradients
    out (STEP["gradients"])."""
    k = checkpoint_interval(n_units)
    starts = list(range(0, n_units, k))
    items = [("forward", u) for u in range(n_units)]
    for lo in reversed(starts):
        segment = range(lo, min(lo + k, n_units))
        if lo != starts[-1]:
            items += [("recompute", u) for u in segment]
        items += [("backward", u) for u in reversed(segment)]
    return items


def tree_reduce(lo, hi, leaf, add):
    """add-reduce leaf(lo), ..., leaf(hi - 1) as a balanced pairwise tree, computing leaves in order.

    Leaves are produced lazily in index order (post-order traversal), so at most about
    log2(hi - lo) partial results are alive at once.
    """
    if hi - lo < 1:
        raise ValueError(f"tree_reduce: empty range [{lo}, {hi})")
    if hi - lo == 1:
        return leaf(lo)
    mid = (lo + hi) // 2
    left = tree_reduce(lo, mid, leaf, add)
    return add(left, tree_reduce(mid, hi, leaf, add))


def tree_sum(items, add=lambda a, b: a + b):
    """Balanced pairwise tree sum of a non-empty sequence, in index order."""
    items = list(items)
    return tree_reduce(0, len(items), items.__getitem__, add)


class TreeAccumulator:
    """``tree_reduce(0, n, ...)`` of items given one at a time, in index order (``push``): each
    subtree is added as soon as its last item is in, so at most about log2(n) partial sums are kept."""

    def __init__(self, n, add=lambda a, b: a + b):
        if n < 1:
            raise ValueError(f"TreeAccumulator: {n} items")
        self.n, self.add, self._stack, self._pushed = n, add, [], 0
        self._right = set()  # the subtrees [lo, hi) that are the right half of their parent

        def split(lo, hi):
            if hi - lo > 1:
                mid = (lo + hi) // 2
                self._right.add((mid, hi))
                split(lo, mid)
                split(mid, hi)

        split(0, n)

    def push(self, value):
        if self._pushed == self.n:
            raise ValueError(f"TreeAccumulator: more than {self.n} items")
        lo, hi = self._pushed, self._pushed + 1
        self._pushed += 1
        while (lo, hi) in self._right:  # its left sibling is done: add them, as tree_reduce does
            left_lo, _, left = self._stack.pop()
            lo, value = left_lo, self.add(left, value)
        self._stack.append((lo, hi, value))

    def total(self):
        if self._pushed != self.n:
            raise ValueError(f"TreeAccumulator: {self._pushed} of {self.n} items")
        return self._stack[0][2]
