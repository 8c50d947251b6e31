"""Fused in-place optimizer kernels: one pass over memory per parameter update.

Every kernel trusts its inputs (1-D, C-contiguous, same dtype and length): the checks live in
``wse_core.optim.optimizers``. Each element is updated independently, so the result does not
depend on the number of threads. Scalar hyperparameters are cast to the array dtype once, as
PyTorch does for float32 tensors, so float32 arithmetic stays float32.
"""
from cython cimport floating
from cython.parallel cimport prange
from libc.math cimport sqrt, sqrtf

from wse_core._parallel cimport WSE_GRAIN, wse_threads_for

cdef enum:
    # Block of the deterministic sum of squares: partial sums per block, added in block order.
    SUMSQ_BLOCK = 4096


def sgd(floating[::1] param, const floating[::1] grad, double lr, double weight_decay,
        double grad_scale):
    """param := param - lr * (grad_scale * grad + weight_decay * param)."""
    cdef Py_ssize_t i, n = param.shape[0]
    cdef floating lr_ = <floating>lr, wd = <floating>weight_decay, gs = <floating>grad_scale
    cdef floating g
    cdef int nt = wse_threads_for(n, WSE_GRAIN)
    with nogil:
        for i in prange(n, schedule="static", num_threads=nt):
            g = grad[i] * gs
            if wd != 0:
                g = g + wd * param[i]
            param[i] = param[i] - lr_ * g


def sgd_momentum(floating[::1] param, const floating[::1] grad, floating[::1] momentum_buffer,
                 double lr, double momentum, double dampening, double weight_decay, bint nesterov,
                 bint first_step, double grad_scale):
    """b := g on the first step, else momentum * b + (1 - dampening) * g; param -= lr * (g + momentum * b if nesterov else b)."""
    cdef Py_ssize_t i, n = param.shape[0]
    cdef floating lr_ = <floating>lr, mu = <floating>momentum, wd = <floating>weight_decay
    cdef floating one_minus_damp = <floating>(1.0 - dampening), gs = <floating>grad_scale
    cdef floating g, b
    cdef int nt = wse_threads_for(n, WSE_GRAIN)
    with nogil:
        for i in prange(n, schedule="static", num_threads=nt):
            g = grad[i] * gs
            if wd != 0:
                g = g + wd * param[i]
            if first_step:
                b = g
            else:
                b = mu * momentum_buffer[i] + one_minus_damp * g
            momentum_buffer[i] = b
            if nesterov:
                g = g + mu * b
            else:
                g = b
            param[i] = param[i] - lr_ * g


def adam(floating[::1] param, const floating[::1] grad, floating[::1] exp_avg,
         floating[::1] exp_avg_sq, double lr, double beta1, double beta2, double eps,
         double weight_decay, bint decoupled, int step, double grad_scale):
    """Adam (decoupled=False: L2 term added to the gradient) or AdamW (decoupled=True: param *= 1 - lr*wd) with bias correction at 1-based ``step``."""
    cdef Py_ssize_t i, n = param.shape[0]
    # Same arrangement as torch.optim's single-tensor path: step_size = lr / (1 - beta1^t),
    # denom = sqrt(v) / sqrt(1 - beta2^t) + eps, param += -step_size * m / denom.
    cdef double bias_correction1 = 1.0 - beta1 ** step
    cdef floating step_size = <floating>(lr / bias_correction1)
    cdef floating bc2_sqrt = <floating>sqrt(1.0 - beta2 ** step)
    cdef floating b1 = <floating>beta1, b2 = <floating>beta2
    cdef floating one_minus_b1 = <floating>(1.0 - beta1), one_minus_b2 = <floating>(1.0 - beta2)
    cdef floating eps_ = <floating>eps, wd = <floating>weight_decay, gs = <floating>grad_scale
    cdef floating decay = <floating>(1.0 - lr * weight_decay)
    cdef floating g, p, m, v, denom
    cdef int nt = wse_threads_for(n, WSE_GRAIN)
    with nogil:
        for i in prange(n, schedule="static", num_threads=nt):
            g = grad[i] * gs
            p = param[i]
            if decoupled:
                p = p * decay
            elif wd != 0:
                g = g + wd * p
            m = b1 * exp_avg[i] + one_minus_b1 * g
            v = b2 * exp_avg_sq[i] + one_minus_b2 * g * g
            exp_avg[i] = m
            exp_avg_sq[i] = v
            if floating is float:
                denom = sqrtf(v) / bc2_sqrt + eps_
            else:
                denom = sqrt(v) / bc2_sqrt + eps_
            param[i] = p - step_size * (m / denom)


def sumsq(const floating[::1] x):
    """sum(x**2) in float64, bit-identical for any thread count.

    Blocks of SUMSQ_BLOCK elements are summed in parallel with four interleaved accumulators and
    the block sums are added in block order, so the rounding never depends on scheduling.
    """
    cdef Py_ssize_t n = x.shape[0]
    cdef Py_ssize_t nblocks = (n + SUMSQ_BLOCK - 1) // SUMSQ_BLOCK
    cdef Py_ssize_t b, j, lo, hi
    cdef double s0, s1, s2, s3, a0, a1, a2, a3, total = 0.0
    cdef int nt = wse_threads_for(n, WSE_GRAIN)
    if n == 0:
        return 0.0
    partial = bytearray(nblocks * sizeof(double))
    cdef double[::1] parts = memoryview(partial).cast("d")
    with nogil:
        for b in prange(nblocks, schedule="static", num_threads=nt):
            lo = b * SUMSQ_BLOCK
            hi = min(lo + SUMSQ_BLOCK, n)
            s0 = 0.0
            s1 = 0.0
            s2 = 0.0
            s3 = 0.0
            j = lo
            while j + 4 <= hi:
                a0 = x[j]
                a1 = x[j + 1]
                a2 = x[j + 2]
                a3 = x[j + 3]
                s0 = s0 + a0 * a0
                s1 = s1 + a1 * a1
                s2 = s2 + a2 * a2
                s3 = s3 + a3 * a3
                j = j + 4
            while j < hi:
                a0 = x[j]
                s0 = s0 + a0 * a0
                j = j + 1
            parts[b] = (s0 + s1) + (s2 + s3)
        for b in range(nblocks):
            total += parts[b]
    return total


def scale(floating[::1] x, double factor):
    """x := factor * x."""
    cdef Py_ssize_t i, n = x.shape[0]
    cdef floating f = <floating>factor
    cdef int nt = wse_threads_for(n, WSE_GRAIN)
    with nogil:
        for i in prange(n, schedule="static", num_threads=nt):
            x[i] = x[i] * f

