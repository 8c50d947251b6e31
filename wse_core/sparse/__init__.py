"""Sparse linear algebra on CSR matrices: what a dataflow core does when it skips every zero.

    from wse_core.sparse import CSRMatrix, spmv, spmm, spmm_t, sddmm
    A = CSRMatrix.from_dense(w)          # or CSRMatrix(indptr, indices, data, shape)
    y = spmv(A, x)                       # A x
    Y = spmm(A, X)                       # A X,   X dense row-major [k, n]
    Z = spmm_t(A, Y)                     # A^T Y, without forming A^T
    g = sddmm(A, U, V)                   # (U V^T) at A's nonzeros: the weight gradient of a sparse layer

Values are float32 or float64; ``indptr`` and ``indices`` int32 or int64 (the same for both).
The structure is checked once, when the matrix is built (``indptr`` starts at 0, never decreases
and ends at nnz; every column index is in range), and frozen read-only; the values stay writable
so an optimizer can update them in place. Column indices within a row may be unsorted or repeated:
every kernel treats the entries as a sum (a repeated (row, column) adds), as scipy.sparse does,
and ``to_dense`` adds repeats. ``from_dense`` gives sorted, unique indices.

The kernels (``_kernels.pyx``) run on OpenMP threads with rows split by nonzero count, and each
output element is summed in one fixed order, so results are bit-identical for any thread count.
"""
import numpy as np

from wse_core.checks import FLOAT_DTYPES
from wse_core.sparse import _kernels

INDEX_DTYPES = (np.dtype(np.int32), np.dtype(np.int64))

__all__ = ["CSRMatrix", "spmv", "spmm", "spmm_t", "sddmm"]


class CSRMatrix:
    """A sparse matrix in compressed sparse row form."""

    def __init__(self, indptr, indices, data, shape):
        if not (isinstance(shape, tuple) and len(shape) == 2 and all(isinstance(s, (int, np.integer)) and s >= 0
                                                                     for s in shape)):
            raise ValueError(f"shape: expected (rows, columns) of non-negative ints, got {shape!r}")
        m, k = int(shape[0]), int(shape[1])
        indptr, indices, data = (np.asarray(a) for a in (indptr, indices, data))
        if data.dtype not in FLOAT_DTYPES:
            raise TypeError(f"data: expected float32 or float64, got {data.dtype}")
        if indptr.dtype not in INDEX_DTYPES or indices.dtype != indptr.dtype:
            raise TypeError(f"indptr, indices: expected both int32 or both int64, got {indptr.dtype} and "
                            f"{indices.dtype}")
        for name, a in (("indptr", indptr), ("indices", indices), ("data", data)):
            if a.ndim != 1:
                raise ValueError(f"{name}: expected a 1-D array, got shape {a.shape}")
        if indptr.shape[0] != m + 1:
            raise ValueError(f"indptr: expected {m + 1} entries for {m} rows, got {indptr.shape[0]}")
        nnz = indices.shape[0]
        if data.shape[0] != nnz:
            raise ValueError(f"data: expected {nnz} values like indices, got {data.shape[0]}")
        if indptr[0] != 0 or indptr[-1] != nnz:
            raise ValueError(f"indptr: expected to start at 0 and end at nnz {nnz}, got {indptr[0]} .. {indptr[-1]}")
        if m and np.any(np.diff(indptr) < 0):
            r = int(np.argmax(np.diff(indptr) < 0))
            raise ValueError(f"indptr: decreases at row {r} ({indptr[r]} -> {indptr[r + 1]})")
        if nnz and (indices.min() < 0 or indices.max() >= k):
            j = int(np.argmax((indices < 0) | (indices >= k)))
            raise ValueError(f"indices: column {indices[j]} at position {j} is outside [0, {k})")
        # The structure is frozen: the kernels trust it. Copies keep the caller's arrays untouched.
        self.indptr = np.array(indptr, copy=True, order="C")
        self.indices = np.array(indices, copy=True, order="C")
        self.indptr.flags.writeable = self.indices.flags.writeable = False
        self.data = np.ascontiguousarray(data)
        self.shape = (m, k)
        self._transpose = None

    @property
    def dtype(self):
        return self.data.dtype

    @property
    def nnz(self):
        return int(self.indices.shape[0])

    @property
    def density(self):
        m, k = self.shape
        return self.nnz / (m * k) if m * k else 0.0

    def __repr__(self):
        return (f"CSRMatrix(shape={self.shape}, nnz={self.nnz}, density={self.density:.4g}, "
                f"dtype={self.dtype}, index_dtype={self.indptr.dtype})")

    @classmethod
    def from_dense(cls, a, *, index_dtype=np.int32):
        """The nonzeros of a 2-D float array, row by row, columns sorted."""
        a = np.asarray(a)
        if a.ndim != 2:
            raise ValueError(f"a: expected a 2-D array, got shape {a.shape}")
        rows, cols = np.nonzero(a)
        indptr = np.zeros(a.shape[0] + 1, index_dtype)
        np.cumsum(np.bincount(rows, minlength=a.shape[0]), out=indptr[1:])
        return cls(indptr, cols.astype(index_dtype), a[rows, cols], a.shape)

    def with_data(self, data):
        """A matrix of the same structure with other values (no checks of the structure again)."""
        data = np.ascontiguousarray(data)
        if data.shape != (self.nnz,) or data.dtype not in FLOAT_DTYPES:
            raise ValueError(f"data: expected float32 or float64 of shape ({self.nnz},), got "
                             f"{data.dtype} {data.shape}")
        new = object.__new__(CSRMatrix)
        new.indptr, new.indices, new.data, new.shape = self.indptr, self.indices, data, self.shape
        new._transpose = getattr(self, "_transpose", None)
        return new

    def transpose_pattern(self):
        """(pattern of A^T, perm): A^T in CSR is ``pattern.with_data(A.data[perm])``. Computed once and kept.

        Rows of A^T list their entries in increasing row of A, so ``spmm`` on A^T adds each output's
        terms in the same order as ``spmm_t`` on A: the same bits, with spmm's register blocking.
        """
        if getattr(self, "_transpose", None) is None:
            m, k = self.shape
            rows = self.row_indices()
            perm = np.argsort(self.indices, kind="stable")  # by column, rows ascending within a column
            indptr = np.zeros(k + 1, self.indptr.dtype)
            np.cumsum(np.bincount(self.indices, minlength=k), out=indptr[1:])
            pattern = CSRMatrix(indptr, rows[perm].astype(self.indptr.dtype), self.data[perm], (k, m))
            self._transpose = (pattern, perm)
        return self._transpose

    def row_indices(self):
        """The row of every nonzero, in storage order."""
        return np.repeat(np.arange(self.shape[0], dtype=self.indptr.dtype), np.diff(self.indptr))

    def to_dense(self):
        out = np.zeros(self.shape, self.dtype)
        np.add.at(out, (self.row_indices(), self.indices), self.data)
        return out

    def to_scipy(self):
        """A ``scipy.sparse.csr_matrix`` sharing nothing with this one (needs scipy)."""
        try:
            import scipy.sparse
        except ImportError:
            raise ImportError("to_scipy needs scipy (pip install scipy); it is not a dependency of wse-cluster") from None
        return scipy.sparse.csr_matrix((self.data.copy(), self.indices.copy(), self.indptr.copy()), shape=self.shape)

    @classmethod
    def from_scipy(cls, s):
        """From any scipy.sparse matrix or array (converted to CSR)."""
        s = s.tocsr()
        return cls(s.indptr, s.indices.astype(s.indptr.dtype), s.data, tuple(int(x) for x in s.shape))


def _dense(name, x, ndim, dtype, *, rows=None, out=False):
    if not isinstance(x, np.ndarray):
        raise TypeError(f"{name}: expected a numpy array, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D array, got shape {x.shape}")
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype} like A.data, got {x.dtype}")
    if not x.flags.c_contiguous:
        raise ValueError(f"{name}: expected a C-contiguous (row-major) array (use np.ascontiguousarray)")
    if out and not x.flags.writeable:
        raise ValueError(f"{name}: array is read-only")
    if rows is not None and x.shape[0] != rows:
        raise ValueError(f"{name}: expected {rows} rows, got shape {x.shape}")
    return x


def _out(out, shape, dtype):
    if out is None:
        return np.empty(shape, dtype)
    _dense("out", out, len(shape), dtype, out=True)
    if out.shape != shape:
        raise ValueError(f"out: expected shape {shape}, got {out.shape}")
    return out


def _matrix(A):
    if not isinstance(A, CSRMatrix):
        raise TypeError(f"A: expected a CSRMatrix, got {type(A).__name__}")
    return A


def spmv(A, x, out=None):
    """y = A x for a CSRMatrix A [m, k] and a dense vector x [k]."""
    m, k = _matrix(A).shape
    _dense("x", x, 1, A.dtype, rows=k)
    y = _out(out, (m,), A.dtype)
    _kernels.spmv(A.indptr, A.indices, A.data, x, y)
    return y


def spmm(A, X, out=None):
    """Y = A X for a CSRMatrix A [m, k] and a dense row-major X [k, n]."""
    m, k = _matrix(A).shape
    _dense("X", X, 2, A.dtype, rows=k)
    Y = _out(out, (m, X.shape[1]), A.dtype)
    _kernels.spmm(A.indptr, A.indices, A.data, X, Y)
    return Y


def spmm_t(A, X, out=None):
    """Y = A^T X for a CSRMatrix A [m, k] and a dense row-major X [m, n], without forming A^T."""
    m, k = _matrix(A).shape
    _dense("X", X, 2, A.dtype, rows=m)
    Y = _out(out, (k, X.shape[1]), A.dtype)
    _kernels.spmm_t(A.indptr, A.indices, A.data, X, Y)
    return Y


def sddmm(A, U, V, out=None):
    """(U V^T)[r, c] for every nonzero (r, c) of A, in A's storage order: U [m, n], V [k, n] -> [nnz].

    A's values are not used, only its structure. This is the gradient of a sparse layer's values:
    for Y = A X, dL/dA at the nonzeros is sddmm(A, dL/dY, X).
    """
    m, k = _matrix(A).shape
    _dense("U", U, 2, A.dtype, rows=m)
    _dense("V", V, 2, A.dtype, rows=k)
    if U.shape[1] != V.shape[1]:
        raise ValueError(f"U, V: expected the same number of columns, got {U.shape[1]} and {V.shape[1]}")
    out = _out(out, (A.nnz,), A.dtype)
    _kernels.sddmm(A.indptr, A.indices, U, V, out)
    return out
