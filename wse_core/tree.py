"""The one summation order of the project: a balanced pairwise tree over items in index order.

A sum over micro-batches is ``tree_reduce(0, n, leaf, add)``: split [lo, hi) at
``(lo + hi) // 2``, sum each half, add left + right. A weight-streaming step computes its n
micro-batches in rounds (docs/design.md section 8, "Micro-batching"): in round r, CS-2 c computes
micro-batch ``r * num_csx + c`` (``micro_batch_of``), SwarmX sums the round's num_csx gradients
with ``tree_sum`` in CS-2 order, and MemoryX adds the rounds with a ``TreeAccumulator``. When the
number of rounds is a power of two, the rounds' contiguous groups of num_csx items are exactly the
subtrees at depth log2(rounds), so (with SwarmX's own tree a balanced one: num_csx up to its
fan-out, or both powers of two) the cluster gives the bits of one process summing all n items.
"""


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


def micro_batch_of(round_, csx, num_csx):
    """The index, in the step's global batch, of the micro-batch CS-2 ``csx`` computes in round ``round_``."""
    return round_ * num_csx + csx


def cluster_sums_as_one(num_csx, rounds, swarmx_fanout):
    """Whether a step of ``rounds`` rounds on ``num_csx`` CS-2s, under SwarmX nodes of ``swarmx_fanout``
    children, sums its micro-batches as one process does (``tree_reduce`` over all of them), so its bits
    are the single-process reference's: one CS-2 (its rounds are the items themselves), or a power of two
    of rounds with SwarmX's own tree a balanced one (the module's docstring)."""
    def pow2(n):
        return n & (n - 1) == 0

    return num_csx == 1 or pow2(rounds) and (num_csx <= swarmx_fanout or pow2(num_csx) and pow2(swarmx_fanout))


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
