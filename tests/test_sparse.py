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


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_spmm_on_the_transpose_pattern_is_spmm_t_bit_for_bit(dtype):
    A, _ = random_csr(300, 170, 0.1, dtype, np.int64, seed=9)
    A = CSRMatrix(np.r_[A.indptr, A.nnz + 2], np.r_[A.indices, 5, 5], np.r_[A.data, 1.5, -2.0].astype(dtype),
                  (301, 170))  # a last row with a repeated column
    pattern, perm = A.transpose_pattern()
    At = pattern.with_data(A.data[perm])
    np.testing.assert_array_equal(At.to_dense(), A.to_dense().T)
    X = np.random.default_rng(0).standard_normal((301, 96)).astype(dtype)
    assert spmm(At, X).tobytes() == spmm_t(A, X).tobytes()


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


@pytest.mark.parametrize("cfg", [
    {"name": "gpt2", "vocab_size": 50, "hidden_size": 32, "num_hidden_layers": 2, "num_heads": 2,
     "max_position_embeddings": 16, "sparsity": 0.75},
    {"name": "fc_mlp", "input_size": 20, "hidden_sizes": [24, 16], "num_classes": 5, "activation": "gelu",
     "sparsity": 0.6, "sparsity_seed": 3},
])
def test_sparse_model_equals_the_dense_model_with_masked_weights(cfg):
    """Loss and every gradient of a sparse model equal the dense model's whose weights are the
    sparse ones expanded with zeros (float64), the sparse gradient being the dense one at the nonzeros."""
    from wse_core.models import build_model

    sparse = build_model(cfg)
    dense = build_model({k: v for k, v in cfg.items() if not k.startswith("sparsity")})
    assert sparse.structures and sparse.num_params() < dense.num_params()
    p = sparse.init_params(0, dtype=np.float64)
    pd = {k: (st.with_data(p[k]).to_dense() if (st := sparse.param_specs[k].structure) is not None else p[k])
          for k in dense.param_names}
    rng = np.random.default_rng(0)
    if cfg["name"] == "gpt2":
        ids = rng.integers(0, 50, (3, 16)).astype(np.int32)
        batch = {"input_ids": ids, "labels": np.roll(ids, -1, 1).astype(np.int32), "loss_mask": np.ones_like(ids)}
    else:
        batch = {"features": rng.standard_normal((7, 20)), "labels": rng.integers(0, 5, 7).astype(np.int32)}
    ls, _, ug, _ = sparse.forward_backward(p, batch)
    lsd, _, ugd, _ = dense.forward_backward(pd, batch)
    g, gd = sparse.combine_unit_grads(ug), dense.combine_unit_grads(ugd)
    assert abs(ls - lsd) < 1e-12 * abs(lsd)
    for k in dense.param_names:
        st = sparse.param_specs[k].structure
        want = gd[k][st.row_indices(), st.indices] if st is not None else gd[k]
        np.testing.assert_allclose(g[k], want, rtol=1e-10, atol=1e-14)
    for name, st in sparse.structures.items():  # row-balanced, deterministic masks
        counts = np.diff(st.indptr)
        assert counts.min() == counts.max() and st.density <= 1 - cfg["sparsity"] + 1.0 / st.shape[1]
        assert np.array_equal(st.indices, build_model(cfg).structures[name].indices)


def test_bad_sparsity_is_named():
    from wse_core.models import build_model

    with pytest.raises(ValueError, match=r"model.sparsity: expected a number in \[0, 1\), got 1"):
        build_model({"name": "fc_mlp", "input_size": 4, "num_classes": 2, "sparsity": 1})
