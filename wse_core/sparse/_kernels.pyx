"""CSR kernels: y = A x, Y = A X, Y = A^T X and the values of U V^T at A's nonzeros.

Every kernel trusts its inputs (checked once by ``wse_core.sparse.CSRMatrix`` and per call by the
wrappers in ``wse_core.sparse.ops``). Rows are split between threads by nonzero count, not by row
count, so a matrix with a few dense rows still keeps every thread busy. Each output element is
summed in one fixed order that does not depend on the number of threads, so results are
bit-identical for any OMP_NUM_THREADS. Duplicate or unsorted column indices within a row are
summed like any other entry (scipy's semantics). The loops themselves are in ``csr_kernels.h``
(C with ``restrict``, so gcc vectorises them); this file splits the work and dispatches on the
value and index types.
"""
from cython cimport floating
from cython.parallel cimport parallel, threadid
from libc.stdint cimport int32_t, int64_t
from libc.stdlib cimport free, malloc
from libc.string cimport memset
from libc.stddef cimport ptrdiff_t

from wse_core._parallel cimport wse_max_threads, wse_threads_for

cdef extern from "csr_kernels.h" nogil:
    void wse_spmv_f32_i32(const int32_t*, const int32_t*, const float*, const float*, float*, ptrdiff_t, ptrdiff_t)
    void wse_spmv_f32_i64(const int64_t*, const int64_t*, const float*, const float*, float*, ptrdiff_t, ptrdiff_t)
    void wse_spmv_f64_i32(const int32_t*, const int32_t*, const double*, const double*, double*, ptrdiff_t, ptrdiff_t)
    void wse_spmv_f64_i64(const int64_t*, const int64_t*, const double*, const double*, double*, ptrdiff_t, ptrdiff_t)
    void wse_spmm_f32_i32(const int32_t*, const int32_t*, const float*, const float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_spmm_f32_i64(const int64_t*, const int64_t*, const float*, const float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_spmm_f64_i32(const int32_t*, const int32_t*, const double*, const double*, double*, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_spmm_f64_i64(const int64_t*, const int64_t*, const double*, const double*, double*, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_spmm_t_f32_i32(const int32_t*, const int32_t*, const float*, const float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_spmm_t_f32_i64(const int64_t*, const int64_t*, const float*, const float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_spmm_t_f64_i32(const int32_t*, const int32_t*, const double*, const double*, double*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_spmm_t_f64_i64(const int64_t*, const int64_t*, const double*, const double*, double*, ptrdiff_t, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_sddmm_f32_i32(const int32_t*, const int32_t*, const float*, const float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_sddmm_f32_i64(const int64_t*, const int64_t*, const float*, const float*, float*, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_sddmm_f64_i32(const int32_t*, const int32_t*, const double*, const double*, double*, ptrdiff_t, ptrdiff_t, ptrdiff_t)
    void wse_sddmm_f64_i64(const int64_t*, const int64_t*, const double*, const double*, double*, ptrdiff_t, ptrdiff_t, ptrdiff_t)

ctypedef fused index_t:
    int32_t
    int64_t

cdef enum:
    # Nonzeros (times the dense width) per thread below which a kernel stays on one thread.
    GRAIN = 65536
    # Columns of the dense operand handled together by one thread in spmm_t (a multiple of 16).
    COL_BLOCK = 64


cdef Py_ssize_t* _row_bounds(const index_t* indptr, Py_ssize_t m, int nt) noexcept nogil:
    """nt + 1 row boundaries splitting rows into runs of about equal nonzero count."""
    cdef Py_ssize_t* b = <Py_ssize_t*>malloc((nt + 1) * sizeof(Py_ssize_t))
    cdef Py_ssize_t t, lo, hi, mid
    cdef double nnz = <double>indptr[m], target
    if b == NULL:
        return NULL
    b[0] = 0
    for t in range(1, nt):
        target = nnz * t / nt
        lo, hi = b[t - 1], m
        while lo < hi:  # the first row whose start is at or past the target
            mid = (lo + hi) // 2
            if indptr[mid] < target:
                lo = mid + 1
            else:
                hi = mid
        b[t] = lo
    b[nt] = m
    return b



cdef inline void _spmv_rows(const index_t* ip, const index_t* ix, const floating* d, const floating* x, floating* y,
                            ptrdiff_t r0, ptrdiff_t r1) noexcept nogil:
    if floating is float:
        if index_t is int32_t:
            wse_spmv_f32_i32(ip, ix, d, x, y, r0, r1)
        else:
            wse_spmv_f32_i64(ip, ix, d, x, y, r0, r1)
    else:
        if index_t is int32_t:
            wse_spmv_f64_i32(ip, ix, d, x, y, r0, r1)
        else:
            wse_spmv_f64_i64(ip, ix, d, x, y, r0, r1)


cdef inline void _spmm_rows(const index_t* ip, const index_t* ix, const floating* d, const floating* X, floating* Y,
                            ptrdiff_t n, ptrdiff_t r0, ptrdiff_t r1) noexcept nogil:
    if floating is float:
        if index_t is int32_t:
            wse_spmm_f32_i32(ip, ix, d, X, Y, n, r0, r1)
        else:
            wse_spmm_f32_i64(ip, ix, d, X, Y, n, r0, r1)
    else:
        if index_t is int32_t:
            wse_spmm_f64_i32(ip, ix, d, X, Y, n, r0, r1)
        else:
            wse_spmm_f64_i64(ip, ix, d, X, Y, n, r0, r1)


cdef inline void _spmm_t_cols(const index_t* ip, const index_t* ix, const floating* d, const floating* X, floating* Y,
                              ptrdiff_t m, ptrdiff_t n, ptrdiff_t c0, ptrdiff_t c1) noexcept nogil:
    if floating is float:
        if index_t is int32_t:
            wse_spmm_t_f32_i32(ip, ix, d, X, Y, m, n, c0, c1)
        else:
            wse_spmm_t_f32_i64(ip, ix, d, X, Y, m, n, c0, c1)
    else:
        if index_t is int32_t:
            wse_spmm_t_f64_i32(ip, ix, d, X, Y, m, n, c0, c1)
        else:
            wse_spmm_t_f64_i64(ip, ix, d, X, Y, m, n, c0, c1)


cdef inline void _sddmm_rows(const index_t* ip, const index_t* ix, const floating* U, const floating* V, floating* out,
                             ptrdiff_t n, ptrdiff_t r0, ptrdiff_t r1) noexcept nogil:
    if floating is float:
        if index_t is int32_t:
            wse_sddmm_f32_i32(ip, ix, U, V, out, n, r0, r1)
        else:
            wse_sddmm_f32_i64(ip, ix, U, V, out, n, r0, r1)
    else:
        if index_t is int32_t:
            wse_sddmm_f64_i32(ip, ix, U, V, out, n, r0, r1)
        else:
            wse_sddmm_f64_i64(ip, ix, U, V, out, n, r0, r1)


cdef inline const index_t* _p(const index_t[::1] a) noexcept nogil:
    return &a[0] if a.shape[0] > 0 else NULL


def spmv(const index_t[::1] indptr, const index_t[::1] indices, const floating[::1] data,
         const floating[::1] x, floating[::1] y):
    """y := A x (four partial sums per row, in a fixed pattern, keep several loads in flight)."""
    cdef Py_ssize_t m = y.shape[0]
    cdef int nt = wse_threads_for(data.shape[0], GRAIN), t
    cdef Py_ssize_t* bounds
    if m == 0:
        return
    bounds = _row_bounds(&indptr[0], m, nt)
    if bounds == NULL:
        raise MemoryError()
    try:
        with nogil, parallel(num_threads=nt):
            t = threadid()
            _spmv_rows(&indptr[0], _p(indices), &data[0] if data.shape[0] else NULL,
                       &x[0] if x.shape[0] else NULL, &y[0], bounds[t], bounds[t + 1])
    finally:
        free(bounds)


def spmm(const index_t[::1] indptr, const index_t[::1] indices, const floating[::1] data,
         const floating[:, ::1] X, floating[:, ::1] Y):
    """Y := A X: row r of Y sums data * (row of X) over row r's nonzeros, in storage order."""
    cdef Py_ssize_t m = Y.shape[0], n = Y.shape[1]
    cdef int nt = wse_threads_for(data.shape[0] * n, GRAIN), t
    cdef Py_ssize_t* bounds
    if m == 0 or n == 0:
        return
    bounds = _row_bounds(&indptr[0], m, nt)
    if bounds == NULL:
        raise MemoryError()
    try:
        with nogil, parallel(num_threads=nt):
            t = threadid()
            _spmm_rows(&indptr[0], _p(indices), &data[0] if data.shape[0] else NULL,
                       &X[0, 0] if X.shape[0] else NULL, &Y[0, 0], n, bounds[t], bounds[t + 1])
    finally:
        free(bounds)


def spmm_t(const index_t[::1] indptr, const index_t[::1] indices, const floating[::1] data,
           const floating[:, ::1] X, floating[:, ::1] Y):
    """Y := A^T X without forming A^T: each thread owns a strip of Y's columns and scatters into it.

    Every element of Y accumulates its terms in row order of A, whatever the threads.
    """
    cdef Py_ssize_t m = X.shape[0], n = X.shape[1], k = Y.shape[0], r, c0, c1
    cdef Py_ssize_t nblocks = (n + COL_BLOCK - 1) // COL_BLOCK
    cdef int nt = min(wse_threads_for(data.shape[0] * n, GRAIN), max(<int>nblocks, 1)), t
    if n == 0 or k == 0:
        return
    with nogil, parallel(num_threads=nt):
        t = threadid()
        c0 = min(n, (t * nblocks // nt) * COL_BLOCK)
        c1 = min(n, ((t + 1) * nblocks // nt) * COL_BLOCK)
        if c1 > c0:
            for r in range(k):
                memset(&Y[r, c0], 0, (c1 - c0) * sizeof(floating))
            if m > 0:
                _spmm_t_cols(&indptr[0], _p(indices), &data[0] if data.shape[0] else NULL, &X[0, 0], &Y[0, 0],
                             m, n, c0, c1)


def sddmm(const index_t[::1] indptr, const index_t[::1] indices, const floating[:, ::1] U,
          const floating[:, ::1] V, floating[::1] out):
    """out[j] := dot(U[r], V[indices[j]]) for each nonzero j of row r (8 partial sums, fixed order)."""
    cdef Py_ssize_t m = U.shape[0], n = U.shape[1]
    cdef int nt = wse_threads_for(out.shape[0] * n, GRAIN), t
    cdef Py_ssize_t* bounds
    if out.shape[0] == 0:
        return
    if n == 0:
        memset(&out[0], 0, out.shape[0] * sizeof(floating))
        return
    bounds = _row_bounds(&indptr[0], m, nt)
    if bounds == NULL:
        raise MemoryError()
    try:
        with nogil, parallel(num_threads=nt):
            t = threadid()
            _sddmm_rows(&indptr[0], _p(indices), &U[0, 0], &V[0, 0], &out[0], n, bounds[t], bounds[t + 1])
    finally:
        free(bounds)
