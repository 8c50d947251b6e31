"""Causal self-attention in blocks of query rows, which never computes the masked half (docs/design/numerics.md
"Attention").

Query rows go ``BLOCK`` at a time: block [r0, r1) attends to keys [0, r1), so its scores are a
[r1 - r0, r1] product, softmax'd as the last r1 - r0 of r1 positions (the diagonal part masked). A
sequence of t = 4 * BLOCK positions does 10/16 of the full products' work. Every product is per
(sample, head) and the blocks are fixed by t alone, so a sample's values depend neither on the
threads nor on the rest of its batch; the gradients of keys and values add the blocks' parts in
block order.

Tensors are [b, heads, t, d] views whose last axis is contiguous: q, k and v may be slices of the
QKV product's output and the result may be written into the token-major array the projection
reads, so no head is copied into a layout of its own. Where the kernels call BLAS themselves
(``gemm.blas_in_kernels``), one kernel does a (sample, head) at a time, its blocks' products,
softmax and dropout together while they are in cache (``_kernels.attention_forward`` and
``attention_backward``); elsewhere the same blocks go through numpy.
"""
import numpy as np

from wse_core.nn import _kernels
from wse_core.nn.gemm import blas_in_kernels, matmul, products

#: Query rows per block (fixed: it decides the bits).
BLOCK = 64


def _rows(*xs):
    """The views the kernels take: rows of unit stride (BLAS reads each (sample, head) as a matrix)."""
    return [x if x.strides[-1] == x.itemsize else np.ascontiguousarray(x) for x in xs]


def _mask(mask, dtype):
    return np.empty((0, 1, 1, 1), dtype) if mask is None else np.ascontiguousarray(mask, dtype)


def _bf16(x):
    """Whether the kernels' products are bfloat16 ones (``gemm.products_in``), as matmul's would be."""
    return products() == "bfloat16" and x.dtype == np.float32


def forward(q, k, v, scale, ops, mask=None, out=None):
    """softmax(scale q k^T, causal) v for q, k, v [b, heads, t, d] (a head each); ``mask`` [b, heads,
    t, t] scales the probabilities (attention dropout). Writes into ``out`` if given. Returns (out,
    probs [b, heads, t, t]) for ``backward``."""
    b, nh, t, _ = q.shape
    out = np.empty_like(q) if out is None else out
    if blas_in_kernels():  # the kernel writes every probability, the zeros above the diagonal too
        probs = np.empty((b, nh, t, t), q.dtype)
        if out.strides[-1] != out.itemsize:
            raise ValueError("out: expected a view whose last axis is contiguous")
        _kernels.attention_forward(*_rows(q, k, v), _mask(mask, q.dtype), out, probs, float(scale), BLOCK,
                                   _bf16(q))
        return out, probs
    probs = np.zeros((b, nh, t, t), q.dtype)
    for r0, r1 in _blocks(t):
        p = matmul(q[:, :, r0:r1], k[:, :, :r1].transpose(0, 1, 3, 2))   # [b, nh, r1 - r0, r1]
        ops.causal_softmax_forward(p.reshape(b * nh, r1 - r0, r1), scale)
        probs[:, :, r0:r1, :r1] = p
        out[:, :, r0:r1] = matmul(p if mask is None else p * mask[:, :, r0:r1, :r1], v[:, :, :r1])
    return out, probs


def backward(dout, q, k, v, probs, scale, ops, mask=None, grads=None):
    """Gradients (dq, dk, dv) of ``forward``'s output, given ``dout`` [b, heads, t, d]; written into
    ``grads`` (three views, whatever they hold) if given."""
    b, nh, t, _ = q.shape
    dq, dk, dv = (np.empty_like(q), np.empty_like(k), np.empty_like(v)) if grads is None else grads
    if blas_in_kernels():  # the kernel zeroes a head's dk and dv before it adds the blocks' parts
        if any(g.strides[-1] != g.itemsize for g in (dq, dk, dv)):
            raise ValueError("grads: expected views whose last axis is contiguous")
        _kernels.attention_backward(*_rows(dout, q, k, v), probs, _mask(mask, q.dtype), dq, dk, dv,
                                    float(scale), BLOCK, _bf16(q))
        return dq, dk, dv
    dk[...] = 0
    dv[...] = 0
    for r0, r1 in _blocks(t):
        p = np.ascontiguousarray(probs[:, :, r0:r1, :r1])
        dh = dout[:, :, r0:r1]
        dp = matmul(dh, v[:, :, :r1].transpose(0, 1, 3, 2))
        used = p if mask is None else p * mask[:, :, r0:r1, :r1]
        dv[:, :, :r1] += matmul(used.transpose(0, 1, 3, 2), dh)
        if mask is not None:
            dp *= mask[:, :, r0:r1, :r1]
        ops.causal_softmax_backward(p.reshape(b * nh, r1 - r0, r1), dp.reshape(b * nh, r1 - r0, r1), scale)
        dq[:, :, r0:r1] = matmul(dp, k[:, :, :r1])
        dk[:, :, :r1] += matmul(dp.transpose(0, 1, 3, 2), q[:, :, r0:r1])
    return dq, dk, dv


def _blocks(t):
    return [(r0, min(r0 + BLOCK, t)) for r0 in range(0, t, BLOCK)]
