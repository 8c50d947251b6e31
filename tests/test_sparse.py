"""wse_core.sparse: every kernel against dense float64 (and scipy.sparse where installed)."""
import numpy as np
import pytest

from wse_core.sparse import CSRMatrix, sddmm, spmm, spmm_t, spmv

try:
    import scipy.sparse
except ImportError:
    scipy = None


def random_csr(m, k, density, dtype, index_dtype, seed, *, empty_rows=True):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal((m, k)) * (rng.random((m, k)) < density)
    if empty_rows and m > 2:
        a[1] = 0          # an empty row
        a[:, 0] = 0       # an empty column
    return CSRMatrix.from_dense(a.astype(dtype), index_dtype=index_dtype), a


CASES = [(37, 53, 0.2), (1, 40, 0.5), (64, 1, 0.5), (20, 30, 0.0), (300, 200, 0.03), (2000, 300, 0.05)]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("index_dtype", [np.int32, np.int64])
@pytest.mark.parametrize("m,k,density", CASES)
def test_kernels_match_dense_float64(m, k, density, dtype, index_dtype):
    A, a = random_csr(m, k, density, dtype, index_dtype, seed=m * k)
    a = A.to_dense().astype(np.float64)  # the values as stored (rounded to dtype)
    rng = np.random.default_rng(1)
    tol = 1e-5 if dtype == np.float32 else 1e-12
    for n in (1, 3, 70):
        x = rng.standard_normal(k).astype(dtype)
        X = rng.standard_normal((k, n)).astype(dtype)
        Xt = rng.standard_normal((m, n)).astype(dtype)
        scale = max(1.0, np.abs(a).sum(axis=1).max(initial=0) * 4)
        np.testing.assert_allclose(spmv(A, x), a @ x.astype(np.float64), atol=tol * scale, rtol=tol)
        np.testing.assert_allclose(spmm(A, X), a @ X.astype(np.float64), atol=tol * scale, rtol=tol)
        np.testing.assert_allclose(spmm_t(A, Xt), a.T @ Xt.astype(np.float64), atol=tol * scale * m, rtol=tol)
        U = rng.standard_normal((m, n)).astype(dtype)
        V = rng.standard_normal((k, n)).astype(dtype)
        rows = A.row_indices()
        expect = (U.astype(np.float64) @ V.astype(np.float64).T)[rows, A.indices]
        np.testing.assert_allclose(sddmm(A, U, V), expect, atol=tol * n, rtol=tol)
        assert spmv(A, x).dtype == dtype and sddmm(A, U, V).shape == (A.nnz,)


@pytest.mark.skipif(scipy is None, reason="scipy is not installed")
def test_against_scipy_and_conversions():
    A, _ = random_csr(500, 400, 0.05, np.float32, np.int32, seed=3)
    s = A.to_scipy()
    rng = np.random.default_rng(2)
    X = rng.standard_normal((400, 32)).astype(np.float32)
    np.testing.assert_allclose(spmm(A, X), s @ X, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(spmm_t(A, rng.standard_normal((500, 8)).astype(np.float32)).shape, (400, 8))
    B = CSRMatrix.from_scipy(scipy.sparse.random(50, 60, density=0.1, format="coo", random_state=1, dtype=np.float64))
    assert B.shape == (50, 60) and B.dtype == np.float64
    np.testing.assert_array_equal(B.to_dense(), B.to_scipy().toarray())


def test_unsorted_and_duplicate_columns_are_summed():
    # row 0: columns 3, 1, 3 (unsorted, 3 twice); row 1 empty; row 2: column 0
    A = CSRMatrix(np.array([0, 3, 3, 4]), np.array([3, 1, 3, 0]), np.array([1.0, 2.0, 4.0, 5.0]), (3, 4))
    dense = np.array([[0, 2.0, 0, 5.0], [0, 0, 0, 0], [5.0, 0, 0, 0]])
    np.testing.assert_array_equal(A.to_dense(), dense)
    x = np.arange(1.0, 5.0)
    np.testing.assert_allclose(spmv(A, x), dense @ x)
    X = np.arange(12.0).reshape(4, 3)
    np.testing.assert_allclose(spmm(A, X), dense @ X)
    np.testing.assert_allclose(spmm_t(A, X[:3]), dense.T @ X[:3])
    U, V = np.ones((3, 2)), np.arange(8.0).reshape(4, 2)
    np.testing.assert_allclose(sddmm(A, U, V), [V[3].sum(), V[1].sum(), V[3].sum(), V[0].sum()])


def test_same_bits_for_any_thread_count():
    from threadpoolctl import threadpool_limits

    A, _ = random_csr(3000, 2000, 0.05, np.float32, np.int32, seed=5, empty_rows=False)
    rng = np.random.default_rng(0)
    X, Xt = rng.standard_normal((2000, 256)).astype(np.float32), rng.standard_normal((3000, 256)).astype(np.float32)
    x = rng.standard_normal(2000).astype(np.float32)

    def run():
        return [spmv(A, x), spmm(A, X), spmm_t(A, Xt), sddmm(A, Xt, X)]

    many = run()
    with threadpool_limits(limits=1, user_api="openmp"):
        one = run()
    for a, b in zip(many, one):
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("args,message", [
    (([0, 2, 1, 3], [0, 1, 2], [1.0, 2, 3], (3, 3)), "indptr: decreases at row 1 (2 -> 1)"),
    (([0, 1, 2], [0, 5], [1.0, 2], (2, 3)), "indices: column 5 at position 1 is outside [0, 3)"),
    (([0, 1, 2], [0, -1], [1.0, 2], (2, 3)), "indices: column -1 at position 1 is outside [0, 3)"),
    (([0, 1], [0, 1], [1.0, 2], (1, 3)), "indptr: expected to start at 0 and end at nnz 2, got 0 .. 1"),
    (([0, 1, 2], [0, 1], [1.0], (2, 3)), "data: expected 2 values like indices, got 1"),
    (([0, 1], [0], [1.0], (2, 3)), "indptr: expected 3 entries for 2 rows, got 2"),
    (([0, 1], [0], [1], (1, 3)), "data: expected float32 or float64, got int64"),
])
def test_bad_structure_is_named(args, message):
    indptr, indices, data, shape = args
    with pytest.raises((ValueError, TypeError)) as e:
        CSRMatrix(np.array(indptr), np.array(indices), np.array(data), shape)
    assert str(e.value) == message


def test_bad_operands_are_named():
    A, _ = random_csr(10, 6, 0.5, np.float32, np.int32, seed=0)
    with pytest.raises(ValueError, match=r"X: expected 6 rows, got shape \(5, 2\)"):
        spmm(A, np.zeros((5, 2), np.float32))
    with pytest.raises(TypeError, match="x: expected float32 like A.data, got float64"):
        spmv(A, np.zeros(6))
    with pytest.raises(ValueError, match="X: expected a C-contiguous"):
        spmm(A, np.zeros((2, 6), np.float32).T)
    with pytest.raises(ValueError, match=r"out: expected shape \(10, 2\)"):
        spmm(A, np.zeros((6, 2), np.float32), out=np.zeros((10, 3), np.float32))
    with pytest.raises(ValueError, match="U, V: expected the same number of columns"):
        sddmm(A, np.zeros((10, 2), np.float32), np.zeros((6, 3), np.float32))
    with pytest.raises(ValueError, match="read-only"):
        A.indices[0] = 1
