"""The one summation order of the project: a balanced pairwise tree over items in index order.

A sum over micro-batches is ``tree_reduce(0, n, leaf, add)``: split [lo, hi) at
``(lo + hi) // 2``, sum each half, add left + right. When ``n`` is divisible by a power of two
``g``, the g contiguous groups of n/g items are exactly the subtrees at depth log2(g); so CS-2s
that each own such a group, followed by SwarmX adding their partial sums with ``tree_sum`` in
CS-2 order, give the same bits as one process summing all n items.
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
