"""The functions of ``wse_core.nn.ops`` in plain, unfused numpy: the baseline of ``wse bench nn``.

Same signatures and in-place contracts as ``ops``; no checks beyond numpy's own. Each function
makes the passes over memory that straightforward numpy code makes.
"""
import math

import numpy as np

from wse_core.nn.sample_tree import loss_sum

GELU_C = math.sqrt(2.0 / math.pi)


def layernorm_forward(x, gamma, beta, eps):
    mean = x.mean(axis=1)
    xc = x - mean[:, None]
    rstd = 1.0 / np.sqrt((xc * xc).mean(axis=1) + eps)
    return (xc * rstd[:, None]) * gamma + beta, mean, rstd.astype(x.dtype)


def layernorm_backward(dy, x, gamma, mean, rstd):
    xhat = (x - mean[:, None]) * rstd[:, None]
    g = dy * gamma
    dx = rstd[:, None] * (g - g.mean(axis=1, keepdims=True) - xhat * (g * xhat).mean(axis=1, keepdims=True))
    return dx, (dy * xhat).sum(axis=0), dy.sum(axis=0)


def column_sum(a):
    return a.sum(axis=0)


def _erf(v):
    """erf elementwise (numpy has none; scipy's when installed, else math.erf element by element)."""
    try:
        from scipy.special import erf
    except ImportError:
        return np.vectorize(math.erf, otypes=[v.dtype])(v)
    return erf(v)


def bias_gelu_forward(h, bias, exact=False):
    h += bias
    if exact:
        return 0.5 * h * (1.0 + _erf(h / math.sqrt(2.0)))
    return 0.5 * h * (1.0 + np.tanh(GELU_C * (h + 0.044715 * h**3)))


def gelu_backward(pre, dy, exact=False):
    if exact:
        dy *= 0.5 * (1.0 + _erf(pre / math.sqrt(2.0))) + pre * np.exp(-0.5 * pre * pre) / math.sqrt(2.0 * math.pi)
        return dy
    t = np.tanh(GELU_C * (pre + 0.044715 * pre**3))
    dy *= 0.5 * (1.0 + t) + 0.5 * pre * (1.0 - t * t) * GELU_C * (1.0 + 3 * 0.044715 * pre * pre)
    return dy


def bias_relu_forward(h, bias):
    h += bias
    return np.maximum(h, 0)


def relu_backward(pre, dy):
    dy[pre <= 0] = 0
    return dy


def causal_softmax_forward(scores, scale):
    t, length = scores.shape[-2:]
    scores *= scale
    scores[:, np.triu(np.ones((t, length), bool), k=length - t + 1)] = -np.inf
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def causal_softmax_backward(probs, dprobs, scale):
    dot = (probs * dprobs).sum(axis=-1, keepdims=True)
    dprobs -= dot
    dprobs *= probs
    dprobs *= scale
    return dprobs


def cross_entropy(logits, labels, mask, sample_rows=None):
    rows = np.arange(logits.shape[0])
    shifted = logits - logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(shifted).sum(axis=1))
    losses = (lse - shifted[rows, labels]) * (mask != 0)
    probs = np.exp(shifted - lse[:, None])
    probs[rows, labels] -= 1.0
    probs *= (mask != 0)[:, None]
    logits[...] = probs
    return loss_sum(losses.astype(np.float64), sample_rows), logits


def embedding_backward(ids, dy, num_embeddings):
    dtable = np.zeros((num_embeddings, dy.shape[1]), dy.dtype)
    np.add.at(dtable, ids, dy)
    return dtable
