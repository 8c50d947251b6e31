"""Fused elementwise and row-wise kernels of the layer numerics (dense GEMMs stay in numpy's BLAS).

Every kernel trusts its inputs (shapes, dtypes, C-contiguity, ids in range): the checks live in
``wse_core.nn.ops``. Reductions that produce a parameter gradient (bias, LayerNorm gamma/beta,
embedding rows) sum over rows in row order for each column, so the bits never depend on the
number of threads; row-wise work (LayerNorm, softmax, loss) is parallel over rows.
"""
from cython cimport floating
from cython.parallel cimport prange
from libc.math cimport erf, erff, exp, log, sqrt, tanh
from libc.stdlib cimport calloc, free
from libc.stdint cimport int32_t

from wse_core._parallel cimport WSE_GRAIN, wse_threads_for

cdef extern from "wse_math.h" nogil:
    float wse_expf(float x) noexcept
    float wse_tanhf(float x) noexcept

cdef enum:
    # Columns per task of the column reductions: each task owns its columns for every row.
    COLBLOCK = 64

# GELU, tanh approximation (GPT-2's gelu_new): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))); and
# exact (Model Zoo's and torch's gelu): 0.5 x (1 + erf(x / sqrt(2))).
cdef double GELU_C = 0.7978845608028654  # sqrt(2 / pi)
cdef double GELU_A = 0.044715
cdef double INV_SQRT2 = 0.7071067811865476
cdef double INV_SQRT_2PI = 0.3989422804014327


cdef inline floating _tanh(floating x) noexcept nogil:
    if floating is float:
        return wse_tanhf(x)
    else:
        return tanh(x)


cdef inline floating _exp(floating x) noexcept nogil:
    if floating is float:
        return wse_expf(x)
    else:
        return exp(x)


def layernorm_forward(const floating[:, ::1] x, const floating[::1] gamma, const floating[::1] beta,
                      double eps, floating[:, ::1] y, floating[::1] mean, floating[::1] rstd):
    """y := (x - mean(x)) / sqrt(var(x) + eps) * gamma + beta, row by row; saves mean and rstd."""
    cdef Py_ssize_t r, c, rows = x.shape[0], cols = x.shape[1]
    cdef double s, d, mu, rs
    cdef int nt = wse_threads_for(rows * cols, WSE_GRAIN)
    with nogil:
        for r in prange(rows, schedule="static", num_threads=nt):
            s = 0.0
            for c in range(cols):
                s = s + x[r, c]
            mu = s / cols
            s = 0.0
            for c in range(cols):
                d = x[r, c] - mu
                s = s + d * d
            rs = 1.0 / sqrt(s / cols + eps)
            mean[r] = <floating>mu
            rstd[r] = <floating>rs
            for c in range(cols):
                y[r, c] = <floating>((x[r, c] - mu) * rs) * gamma[c] + beta[c]


def layernorm_backward(const floating[:, ::1] dy, const floating[:, ::1] x, const floating[::1] gamma,
                       const floating[::1] mean, const floating[::1] rstd, floating[:, ::1] dx,
                       floating[::1] dgamma, floating[::1] dbeta):
    """dx := rstd (g - mean(g) - xhat mean(g xhat)) with g = dy gamma; dgamma := sum_rows dy xhat; dbeta := sum_rows dy."""
    cdef Py_ssize_t r, c, b, c0, c1, rows = x.shape[0], cols = x.shape[1]
    cdef Py_ssize_t nblocks = (cols + COLBLOCK - 1) // COLBLOCK
    cdef double a, bb, g, xh
    cdef int nt = wse_threads_for(rows * cols, WSE_GRAIN)
    cdef double* acc = <double*>calloc(2 * cols + 1, sizeof(double))
    if acc == NULL:
        raise MemoryError()
    try:
        with nogil:
            for r in prange(rows, schedule="static", num_threads=nt):
                a = 0.0
                bb = 0.0
                for c in range(cols):
                    g = dy[r, c] * gamma[c]
                    xh = (x[r, c] - mean[r]) * rstd[r]
                    a = a + g
                    bb = bb + g * xh
                a = a / cols
                bb = bb / cols
                for c in range(cols):
                    g = dy[r, c] * gamma[c]
                    xh = (x[r, c] - mean[r]) * rstd[r]
                    dx[r, c] = <floating>(rstd[r] * (g - a - xh * bb))
            for b in prange(nblocks, schedule="static", num_threads=nt):
                c0 = b * COLBLOCK
                c1 = c0 + COLBLOCK
                if c1 > cols:
                    c1 = cols
                for r in range(rows):
                    for c in range(c0, c1):
                        acc[c] += dy[r, c] * ((x[r, c] - mean[r]) * rstd[r])
                        acc[cols + c] += dy[r, c]
                for c in range(c0, c1):
                    dgamma[c] = <floating>acc[c]
                    dbeta[c] = <floating>acc[cols + c]
    finally:
        free(acc)


def column_sum(const floating[:, ::1] a, floating[::1] out):
    """out := sum over rows of a (row order per column, float64 accumulation): a bias gradient."""
    cdef Py_ssize_t r, c, b, c0, c1, rows = a.shape[0], cols = a.shape[1]
    cdef Py_ssize_t nblocks = (cols + COLBLOCK - 1) // COLBLOCK
    cdef int nt = wse_threads_for(rows * cols, WSE_GRAIN)
    cdef double* acc = <double*>calloc(cols + 1, sizeof(double))
    if acc == NULL:
        raise MemoryError()
    try:
        with nogil:
            for b in prange(nblocks, schedule="static", num_threads=nt):
                c0 = b * COLBLOCK
                c1 = c0 + COLBLOCK
                if c1 > cols:
                    c1 = cols
                for r in range(rows):
                    for c in range(c0, c1):
                        acc[c] += a[r, c]
                for c in range(c0, c1):
                    out[c] = <floating>acc[c]
    finally:
        free(acc)


cdef inline floating _erf(floating x) noexcept nogil:
    if floating is float:
        return erff(x)
    else:
        return erf(x)


def bias_gelu_forward(floating[:, ::1] h, const floating[::1] bias, floating[:, ::1] y, bint exact):
    """h := h + bias (kept for the backward pass); y := gelu(h), exact or the tanh approximation."""
    cdef Py_ssize_t r, c, rows = h.shape[0], cols = h.shape[1]
    cdef floating v, k = <floating>GELU_C, a = <floating>GELU_A, half = 0.5, one = 1.0
    cdef floating s = <floating>INV_SQRT2
    cdef int nt = wse_threads_for(rows * cols, WSE_GRAIN)
    # One loop per form: a branch in the inner loop kept gcc from vectorising it (the tanh form ran
    # at 11 ns an element, docs/benchmarks.md "Where the block's time goes"); the bits are the same.
    with nogil:
        if exact:
            for r in prange(rows, schedule="static", num_threads=nt):
                for c in range(cols):
                    v = h[r, c] + bias[c]
                    h[r, c] = v
                    y[r, c] = half * v * (one + _erf(v * s))
        else:
            for r in prange(rows, schedule="static", num_threads=nt):
                for c in range(cols):
                    v = h[r, c] + bias[c]
                    h[r, c] = v
                    y[r, c] = half * v * (one + _tanh(k * (v + a * v * v * v)))


def gelu_backward(const floating[:, ::1] pre, floating[:, ::1] dy, bint exact):
    """dy := dy * gelu'(pre), in place (exact: 0.5 (1 + erf(x / sqrt 2)) + x exp(-x^2 / 2) / sqrt(2 pi))."""
    cdef Py_ssize_t r, c, rows = pre.shape[0], cols = pre.shape[1]
    cdef floating v, t, k = <floating>GELU_C, a = <floating>GELU_A, half = 0.5, one = 1.0
    cdef floating three_a = <floating>(3.0 * GELU_A), s = <floating>INV_SQRT2, g = <floating>INV_SQRT_2PI
    cdef int nt = wse_threads_for(rows * cols, WSE_GRAIN)
    with nogil:  # one loop per form, as bias_gelu_forward
        if exact:
            for r in prange(rows, schedule="static", num_threads=nt):
                for c in range(cols):
                    v = pre[r, c]
                    dy[r, c] = dy[r, c] * (half * (one + _erf(v * s)) + v * g * <floating>exp(-half * v * v))
        else:
            for r in prange(rows, schedule="static", num_threads=nt):
                for c in range(cols):
                    v = pre[r, c]
                    t = _tanh(k * (v + a * v * v * v))
                    dy[r, c] = dy[r, c] * (half * (one + t)
                                           + half * v * (one - t * t) * k * (one + three_a * v * v))


def bias_relu_forward(floating[:, ::1] h, const floating[::1] bias, floating[:, ::1] y):
    """h := h + bias (kept for the backward pass); y := max(h, 0)."""
    cdef Py_ssize_t r, c, rows = h.shape[0], cols = h.shape[1]
    cdef floating v
    cdef int nt = wse_threads_for(rows * cols, WSE_GRAIN)
    with nogil:
        for r in prange(rows, schedule="static", num_threads=nt):
            for c in range(cols):
                v = h[r, c] + bias[c]
                h[r, c] = v
                y[r, c] = v if v > 0 else 0


def relu_backward(const floating[:, ::1] pre, floating[:, ::1] dy):
    """dy := dy where pre > 0, else 0, in place."""
    cdef Py_ssize_t r, c, rows = pre.shape[0], cols = pre.shape[1]
    cdef int nt = wse_threads_for(rows * cols, WSE_GRAIN)
    with nogil:
        for r in prange(rows, schedule="static", num_threads=nt):
            for c in range(cols):
                if not pre[r, c] > 0:
                    dy[r, c] = 0


def causal_softmax_forward(floating[:, :, ::1] s, double scale):
    """s[b, i, :] := softmax(scale * s[b, i, :o+i+1]) followed by zeros, in place (a causal mask), where
    o = L - t for blocks [t, L]: the last t of L positions attending to themselves and every earlier one
    (o = 0 in training's square blocks; a KV cache's decode step is one row, t = 1, seeing all L)."""
    cdef Py_ssize_t nb = s.shape[0], t = s.shape[1], o = s.shape[2] - s.shape[1], row, b, i, j
    cdef floating m, e, sc = <floating>scale
    cdef double total
    cdef int nt = wse_threads_for(nb * t * (t + o), WSE_GRAIN)
    with nogil:
        for row in prange(nb * t, schedule="static", num_threads=nt):
            b = row // t
            i = row % t
            m = s[b, i, 0] * sc
            for j in range(1, o + i + 1):
                if s[b, i, j] * sc > m:
                    m = s[b, i, j] * sc
            total = 0.0
            for j in range(o + i + 1):
                e = _exp(s[b, i, j] * sc - m)
                s[b, i, j] = e
                total = total + e
            for j in range(o + i + 1):
                s[b, i, j] = <floating>(s[b, i, j] / total)
            for j in range(o + i + 1, t + o):
                s[b, i, j] = 0


def causal_softmax_backward(const floating[:, :, ::1] p, floating[:, :, ::1] dp, double scale):
    """dp := scale * p * (dp - sum_j p dp) over the causal part of each row, zeros above; in place."""
    cdef Py_ssize_t nb = p.shape[0], t = p.shape[1], row, b, i, j
    cdef double dot
    cdef floating sc = <floating>scale, d
    cdef int nt = wse_threads_for(nb * t * t, WSE_GRAIN)
    with nogil:
        for row in prange(nb * t, schedule="static", num_threads=nt):
            b = row // t
            i = row % t
            dot = 0.0
            for j in range(i + 1):
                dot = dot + p[b, i, j] * dp[b, i, j]
            d = <floating>dot
            for j in range(i + 1):
                dp[b, i, j] = sc * p[b, i, j] * (dp[b, i, j] - d)
            for j in range(i + 1, t):
                dp[b, i, j] = 0


def cross_entropy(floating[:, ::1] logits, const int32_t[::1] labels, const int32_t[::1] mask,
                  floating[:, ::1] dlogits, double[::1] losses):
    """losses[r] := mask[r] (logsumexp(logits[r]) - logits[r, labels[r]]); dlogits[r] := mask[r] (softmax(logits[r]) - onehot).

    ``dlogits`` may be ``logits`` itself (each row is read before it is written).
    """
    cdef Py_ssize_t rows = logits.shape[0], v = logits.shape[1], r, j
    cdef floating m, inv
    cdef double total, lse
    cdef int nt = wse_threads_for(rows * v, WSE_GRAIN)
    with nogil:
        for r in prange(rows, schedule="static", num_threads=nt):
            if mask[r] == 0:
                losses[r] = 0.0
                for j in range(v):
                    dlogits[r, j] = 0
            else:
                m = logits[r, 0]
                for j in range(1, v):
                    if logits[r, j] > m:
                        m = logits[r, j]
                total = 0.0
                for j in range(v):
                    total = total + _exp(logits[r, j] - m)
                lse = m + log(total)
                losses[r] = lse - logits[r, labels[r]]
                inv = <floating>(1.0 / total)
                for j in range(v):
                    dlogits[r, j] = _exp(logits[r, j] - m) * inv
                dlogits[r, labels[r]] = dlogits[r, labels[r]] - 1


def embedding_backward(const int32_t[::1] ids, const floating[:, ::1] dy, floating[:, ::1] dtable):
    """dtable[ids[t]] += dy[t] for t in order (dtable zeroed by the caller): an embedding's gradient."""
    cdef Py_ssize_t n = ids.shape[0], cols = dy.shape[1], b, c, c0, c1, t
    cdef Py_ssize_t nblocks = (cols + COLBLOCK - 1) // COLBLOCK
    cdef int nt = wse_threads_for(n * cols, WSE_GRAIN)
    with nogil:
        for b in prange(nblocks, schedule="static", num_threads=nt):
            c0 = b * COLBLOCK
            c1 = c0 + COLBLOCK
            if c1 > cols:
                c1 = cols
            for t in range(n):
                for c in range(c0, c1):
                    dtable[ids[t], c] += dy[t, c]
