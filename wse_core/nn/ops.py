"""Fused layer kernels behind checked Python wrappers: LayerNorm, GELU/ReLU, causal softmax, loss.

``wse_core.nn.numpy_ops`` has the same functions in plain numpy (the unfused baseline of
``wse bench nn``); the layers take either module as their ``ops``. Arrays are float32 or float64,
C-contiguous; ``h`` and ``dy`` arguments documented as "in place" are overwritten.
"""
import numpy as np

from wse_core.checks import FLOAT_DTYPES
from wse_core.nn import _kernels
from wse_core.nn.sample_tree import loss_sum


def _float(name, x, ndim, dtype=None):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name}: expected float32 or float64, got {x.dtype}")
    if dtype is not None and x.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {x.dtype}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dimensions, got shape {x.shape}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous array")
    return x


def _vector(name, v, length, dtype):
    _float(name, v, 1, dtype)
    if v.shape[0] != length:
        raise ValueError(f"{name}: expected length {length}, got {v.shape[0]}")
    return v


def _same(name, a, ref_name, ref):
    _float(name, a, ref.ndim, ref.dtype)
    if a.shape != ref.shape:
        raise ValueError(f"{name}: expected shape {ref.shape} like {ref_name}, got {a.shape}")
    return a


def _int32(name, x, shape):
    if not isinstance(x, np.ndarray) or x.dtype != np.int32:
        raise TypeError(f"{name}: expected an int32 array, got {getattr(x, 'dtype', type(x).__name__)}")
    if x.shape != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {x.shape}")
    return np.ascontiguousarray(x)


def layernorm_forward(x, gamma, beta, eps):
    """LayerNorm over the last axis of 2-D ``x``: returns (y, mean, rstd)."""
    _float("x", x, 2)
    _vector("gamma", gamma, x.shape[1], x.dtype)
    _vector("beta", beta, x.shape[1], x.dtype)
    y = np.empty_like(x)
    mean = np.empty(x.shape[0], x.dtype)
    rstd = np.empty(x.shape[0], x.dtype)
    _kernels.layernorm_forward(x, gamma, beta, float(eps), y, mean, rstd)
    return y, mean, rstd


def layernorm_backward(dy, x, gamma, mean, rstd):
    """Gradients of LayerNorm: returns (dx, dgamma, dbeta)."""
    _float("x", x, 2)
    _same("dy", dy, "x", x)
    _vector("gamma", gamma, x.shape[1], x.dtype)
    _vector("mean", mean, x.shape[0], x.dtype)
    _vector("rstd", rstd, x.shape[0], x.dtype)
    dx = np.empty_like(x)
    dgamma = np.empty_like(gamma)
    dbeta = np.empty_like(gamma)
    _kernels.layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta)
    return dx, dgamma, dbeta


def column_sum(a):
    """Sum over the rows of 2-D ``a`` (a bias gradient), independent of the thread count."""
    _float("a", a, 2)
    out = np.empty(a.shape[1], a.dtype)
    _kernels.column_sum(a, out)
    return out


def bias_gelu_forward(h, bias, exact=False):
    """h := h + bias in place (the saved pre-activation); returns gelu(h): exact (erf; Model Zoo's and
    torch's ``gelu``) or the tanh approximation (GPT-2's ``gelu_new``)."""
    _float("h", h, 2)
    _vector("bias", bias, h.shape[1], h.dtype)
    y = np.empty_like(h)
    _kernels.bias_gelu_forward(h, bias, y, bool(exact))
    return y


def gelu_backward(pre, dy, exact=False):
    """dy := dy * gelu'(pre) in place (the same form as the forward); returns dy."""
    _float("pre", pre, 2)
    _same("dy", dy, "pre", pre)
    _kernels.gelu_backward(pre, dy, bool(exact))
    return dy


def bias_relu_forward(h, bias):
    """h := h + bias in place (the saved pre-activation); returns max(h, 0)."""
    _float("h", h, 2)
    _vector("bias", bias, h.shape[1], h.dtype)
    y = np.empty_like(h)
    _kernels.bias_relu_forward(h, bias, y)
    return y


def relu_backward(pre, dy):
    """dy := dy where pre > 0, else 0, in place; returns dy."""
    _float("pre", pre, 2)
    _same("dy", dy, "pre", pre)
    _kernels.relu_backward(pre, dy)
    return dy


def causal_softmax_forward(scores, scale):
    """scores[n, i, :] := causal softmax of scale * scores[n, i, :], in place; returns scores. Blocks
    [n, t, L] (t <= L) are the last t of L positions: row i sees the first L - t + i + 1 (training's
    are square; a KV cache's decode step is one row seeing all L)."""
    _float("scores", scores, 3)
    if scores.shape[1] > scores.shape[2]:
        raise ValueError(f"scores: expected blocks [n, t, L] with t <= L, got shape {scores.shape}")
    _kernels.causal_softmax_forward(scores, float(scale))
    return scores


def causal_softmax_backward(probs, dprobs, scale):
    """dprobs := gradient with respect to the unscaled scores, in place; returns dprobs (blocks
    [n, t, L] as in ``causal_softmax_forward``)."""
    _float("probs", probs, 3)
    _same("dprobs", dprobs, "probs", probs)
    _kernels.causal_softmax_backward(probs, dprobs, float(scale))
    return dprobs


def cross_entropy(logits, labels, mask, sample_rows=None):
    """Masked softmax cross-entropy over rows of 2-D ``logits``.

    Returns (loss_sum, dlogits): the float64 sum of the masked-in rows' losses (the tree over samples
    of ``sample_rows`` rows, ``sample_tree.loss_sum``) and the gradient of that sum. ``dlogits``
    overwrites ``logits``.
    """
    _float("logits", logits, 2)
    rows, vocab = logits.shape
    labels = _int32("labels", labels, (rows,))
    mask = _int32("loss_mask", mask, (rows,))
    bad = (mask != 0) & ((labels < 0) | (labels >= vocab))
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise ValueError(f"labels: id {int(labels[r])} at row {r} is outside the vocabulary [0, {vocab})")
    losses = np.empty(rows, np.float64)
    _kernels.cross_entropy(logits, labels, mask, logits, losses)
    return loss_sum(losses, sample_rows), logits


def embedding_backward(ids, dy, num_embeddings):
    """Gradient of a table lookup: dtable[ids[t]] += dy[t] in token order; returns dtable."""
    _float("dy", dy, 2)
    ids = _int32("ids", ids, (dy.shape[0],))
    if ids.size and (ids.min() < 0 or ids.max() >= num_embeddings):
        raise ValueError(f"ids: expected ids in [0, {num_embeddings}), got {ids.min()}..{ids.max()}")
    dtable = np.zeros((num_embeddings, dy.shape[1]), dy.dtype)
    _kernels.embedding_backward(ids, dy, dtable)
    return dtable
