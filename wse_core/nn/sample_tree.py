"""A weight's gradient as the tree over samples: the same bits whatever the micro-batch.

A weight's gradient is a sum over the batch's samples. Summed by one BLAS call (or one kernel loop)
over a micro-batch's rows, its bits would depend on which samples share the micro-batch, so on the
micro-batch size and, through ``micro_batch_size: auto``, on num_csx. Here every such sum is
``tree_reduce`` over the micro-batch's samples: each sample's contribution is computed alone (its
rows' BLAS call, its kernel loop) and the contributions are added as the balanced pairwise tree
over sample index, each partial sum in the run's precision. A micro-batch that is a node of the
global batch's tree over samples (``MicroBatches.aligned``) then computes that node's bits, and the
cluster adds micro-batches as the same tree (``wse_core.microbatch``): every step computes the bits
of the tree over its B samples, for any micro-batch size and num_csx (docs/design.md section 5 (a)).

Cost: a weight-gradient product takes one BLAS call per sample (K = the sample's tokens, not the
micro-batch's), and the tree adds each weight's gradient once per sample beyond the first.
"""
import contextlib
import contextvars

import numpy as np

from wse_core.microbatch import tree_reduce
from wse_core.nn.gemm import matmul

#: The ``Precision`` the partial sums of gradients are made in (``sums_in``; None: float32).
_precision = contextvars.ContextVar("wse_gradient_sums", default=None)


@contextlib.contextmanager
def sums_in(precision):
    """Within: ``sample_sum``'s leaves are rounded to ``precision``'s format and its adds are
    ``precision.add``, as every other partial sum of gradients (``Model.unit_backward`` sets it)."""
    token = _precision.set(None if precision is None or precision.format is None else precision)
    try:
        yield
    finally:
        _precision.reset(token)


def _add_in_place(a, b):
    for x, y in zip(a, b):
        np.add(x, y, out=x)
    return a


def sample_sum(n, leaf):
    """The tree over samples 0..n-1 of ``leaf(s)``, a tuple of fresh arrays (the sample's
    contributions to some gradients): a tuple of their sums."""
    precision = _precision.get()
    if precision is None:
        return tree_reduce(0, n, lambda s: tuple(leaf(s)), _add_in_place)
    return tree_reduce(0, n, lambda s: tuple(precision.round_(x) for x in leaf(s)),
                       lambda a, b: tuple(precision.add(x, y) for x, y in zip(a, b)))


def samples_of(rows, t):
    """The samples of a micro-batch of ``rows`` token rows, ``t`` a sample."""
    if t is None or rows % t:
        raise ValueError(f"{rows} rows are not whole samples of {t} rows")
    return rows // t


def weight_product(d, x, t):
    """sum over samples s of d_s^T x_s (a dense weight's gradient), for token-major 2-D ``d``, ``x``
    of ``t`` rows a sample."""
    return sample_sum(samples_of(d.shape[0], t), lambda s: (matmul(d[s * t:(s + 1) * t].T, x[s * t:(s + 1) * t]),))[0]


def loss_sum(losses, t=None):
    """The float64 sum of per-row ``losses``: the tree over samples of ``t`` rows (None: all rows one
    sample) of each sample's sum, so a sample's part does not depend on its micro-batch."""
    t = len(losses) if t is None else t
    return tree_reduce(0, samples_of(len(losses), t), lambda s: float(losses[s * t:(s + 1) * t].sum()),
                       lambda a, b: a + b)


def embedding_grad(ids, dy, num_embeddings, backward):
    """The gradient of a table lookup over the samples of ``ids`` [b, t] with output gradients ``dy``
    [b * t, c]: the tree over samples of each sample's table, built only on the rows it touches.

    A row a sample does not touch is +0 in its dense table, and x + 0 is x but for -0 (which becomes
    +0): each add below makes exactly the dense tree's sums, touching only rows some sample has.
    ``backward(ids, dy, rows)`` is the kernel (``ops.embedding_backward``: in token order from 0)."""
    b, t = ids.shape
    precision = _precision.get()

    def leaf(s):
        rows, inverse = np.unique(ids[s], return_inverse=True)
        part = backward(np.ascontiguousarray(inverse, np.int32), dy[s * t:(s + 1) * t], len(rows))
        return rows, part if precision is None else precision.round_(part)

    def add(a, b_):
        (ra, pa), (rb, pb) = a, b_
        rows = np.union1d(ra, rb)
        out = np.zeros((len(rows), pa.shape[1]), pa.dtype)
        ia, ib = np.searchsorted(rows, ra), np.searchsorted(rows, rb)
        out[ia] = pa
        out[ib] += pb                        # both: pa + pb; b's alone: 0 + pb
        only_a = np.ones(len(rows), bool)
        only_a[ib] = False
        out[only_a] += 0.0                   # a's alone: pa + 0
        return rows, out if precision is None else precision.round_(out)

    rows, part = tree_reduce(0, b, leaf, add)
    table = np.zeros((num_embeddings, dy.shape[1]), dy.dtype)
    table[rows] = part
    return table
