"""Fused layer kernels against the plain numpy ops and against naive float64 formulas."""
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from wse_core.nn import numpy_ops, ops

DTYPES = [np.float32, np.float64]
TOL = {np.float32: 2e-5, np.float64: 1e-12}


def naive_gelu(x):
    return 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm_forward_and_backward(rng, dtype):
    x = (rng.standard_normal((67, 130)) * 3 + 1).astype(dtype)
    g, b = rng.standard_normal(130).astype(dtype), rng.standard_normal(130).astype(dtype)
    y, mean, rstd = ops.layernorm_forward(x, g, b, 1e-5)
    x64 = x.astype(np.float64)
    ref = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(x64.var(1, keepdims=True) + 1e-5) * g + b
    np.testing.assert_allclose(y, ref, rtol=TOL[dtype], atol=10 * TOL[dtype])
    dy = rng.standard_normal(x.shape).astype(dtype)
    got = ops.layernorm_backward(dy, x, g, mean, rstd)
    want = numpy_ops.layernorm_backward(dy.astype(np.float64), x64, g.astype(np.float64),
                                        x64.mean(1), 1 / np.sqrt(x64.var(1) + 1e-5))
    for a, w in zip(got, want):
        assert a.dtype == dtype
        np.testing.assert_allclose(a, w, rtol=10 * TOL[dtype], atol=100 * TOL[dtype])


def naive_exact_gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


# float32 tanh near -1 leaves about 1e-6 absolute error in 1 + tanh for large negative inputs.
GELU_ATOL = {(False, np.float32): 5e-6, (False, np.float64): 1e-12, (True, np.float32): 1e-6, (True, np.float64): 1e-13}


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_gelu(rng, dtype, exact):
    """Both forms: the tanh approximation (gelu_new) and Model Zoo's and torch's exact gelu (erf);
    forward against the formula, the saved pre-activation, backward against finite differences."""
    naive = naive_exact_gelu if exact else naive_gelu
    h = rng.standard_normal((33, 70)).astype(dtype) * 3
    bias = rng.standard_normal(70).astype(dtype)
    pre_ref = h.astype(np.float64) + bias
    h1 = h.copy()
    atol = GELU_ATOL[exact, dtype]
    np.testing.assert_allclose(ops.bias_gelu_forward(h1, bias, exact), naive(pre_ref), rtol=TOL[dtype], atol=atol)
    np.testing.assert_allclose(h1, pre_ref, rtol=TOL[dtype])
    dy = rng.standard_normal(h.shape).astype(dtype)
    eps = 1e-6
    fd = (naive(pre_ref + eps) - naive(pre_ref - eps)) / (2 * eps)
    np.testing.assert_allclose(ops.gelu_backward(h1, dy.copy(), exact), dy * fd, rtol=1e-4, atol=max(atol, 1e-8))
    assert not np.allclose(naive_exact_gelu(pre_ref), naive_gelu(pre_ref), rtol=0, atol=1e-6)  # they differ


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_relu(rng, dtype):
    h = rng.standard_normal((33, 70)).astype(dtype) * 3
    bias = rng.standard_normal(70).astype(dtype)
    h2 = h.copy()
    np.testing.assert_array_equal(ops.bias_relu_forward(h2, bias), np.maximum(h.astype(dtype) + bias, 0))
    dy = rng.standard_normal(h.shape).astype(dtype)
    np.testing.assert_array_equal(ops.relu_backward(h2, dy.copy()), np.where(h2 > 0, dy, 0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_causal_softmax(rng, dtype):
    s = rng.standard_normal((5, 17, 17)).astype(dtype) * 4
    p = ops.causal_softmax_forward(s.copy(), 0.25)
    ref = np.zeros_like(s, dtype=np.float64)
    for n in range(5):
        for i in range(17):
            row = 0.25 * s[n, i, : i + 1].astype(np.float64)
            e = np.exp(row - row.max())
            ref[n, i, : i + 1] = e / e.sum()
    np.testing.assert_allclose(p, ref, rtol=TOL[dtype], atol=TOL[dtype])
    dp = rng.standard_normal(s.shape).astype(dtype)
    got = ops.causal_softmax_backward(p, dp.copy(), 0.25)
    want = numpy_ops.causal_softmax_backward(ref, dp.astype(np.float64), 0.25)
    np.testing.assert_allclose(got, want, rtol=10 * TOL[dtype], atol=10 * TOL[dtype])
    assert np.all(np.triu(got[0], k=1) == 0)
    # a [t, L] block is the last t rows of the square one, bit for bit (a KV cache's step)
    np.testing.assert_array_equal(ops.causal_softmax_forward(s[:, 13:].copy(), 0.25), p[:, 13:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_cross_entropy(rng, dtype):
    logits = rng.standard_normal((40, 29)).astype(dtype) * 3
    labels = rng.integers(0, 29, 40).astype(np.int32)
    mask = (rng.random(40) < 0.7).astype(np.int32)
    l64 = logits.astype(np.float64)
    lse = np.log(np.exp(l64 - l64.max(1, keepdims=True)).sum(1)) + l64.max(1)
    want_loss = float(((lse - l64[np.arange(40), labels]) * mask).sum())
    want_grad = (np.exp(l64 - lse[:, None]) - np.eye(29)[labels]) * mask[:, None]
    loss, grad = ops.cross_entropy(logits.copy(), labels, mask)
    assert loss == pytest.approx(want_loss, rel=TOL[dtype])
    np.testing.assert_allclose(grad, want_grad, rtol=TOL[dtype], atol=TOL[dtype])


def test_cross_entropy_rejects_label_outside_vocab():
    with pytest.raises(ValueError, match=r"labels: id 9 at row 1 is outside the vocabulary \[0, 5\)"):
        ops.cross_entropy(np.zeros((3, 5)), np.array([0, 9, 1], np.int32), np.ones(3, np.int32))
    # A masked-out row may carry any label (padding).
    loss, _ = ops.cross_entropy(np.zeros((2, 5)), np.array([0, 99], np.int32), np.array([1, 0], np.int32))
    assert loss == pytest.approx(math.log(5))


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_sum_and_embedding_backward(rng, dtype):
    a = rng.standard_normal((300, 150)).astype(dtype)
    np.testing.assert_allclose(ops.column_sum(a), a.astype(np.float64).sum(0), rtol=TOL[dtype], atol=TOL[dtype])
    ids = rng.integers(0, 11, 300).astype(np.int32)
    want = np.zeros((11, 150))
    np.add.at(want, ids, a.astype(np.float64))
    np.testing.assert_allclose(ops.embedding_backward(ids, a, 11), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"ids: expected ids in \[0, 5\)"):
        ops.embedding_backward(ids, a, 5)


def test_wrappers_reject_bad_arrays():
    x = np.zeros((4, 8), np.float32)
    with pytest.raises(ValueError, match="gamma: expected length 8, got 7"):
        ops.layernorm_forward(x, np.ones(7, np.float32), np.zeros(8, np.float32), 1e-5)
    with pytest.raises(TypeError, match="beta: expected float32, got float64"):
        ops.layernorm_forward(x, np.ones(8, np.float32), np.zeros(8), 1e-5)
    with pytest.raises(ValueError, match="h: expected a C-contiguous array"):
        ops.bias_gelu_forward(np.zeros((8, 4), np.float32).T, np.zeros(8, np.float32))
    with pytest.raises(ValueError, match=r"scores: expected blocks \[n, t, L\] with t <= L, got shape \(2, 4, 3\)"):
        ops.causal_softmax_forward(np.zeros((2, 4, 3), np.float32), 1.0)
    with pytest.raises(TypeError, match="labels: expected an int32 array"):
        ops.cross_entropy(np.zeros((2, 3)), np.zeros(2, np.int64), np.ones(2, np.int32))


@pytest.mark.parametrize("mixed", ["", ", mixed_precision=True, fp16_type='bfloat16'"], ids=["float32", "bfloat16"])
def test_gradients_same_bits_for_any_thread_count(mixed):
    """A GPT-2 micro-batch gradient is bit-identical with 1 and 2 OpenMP and BLAS threads (in float32,
    and in bfloat16 mixed precision, whose products are the kernels' own)."""
    code = """
import hashlib, numpy as np
from wse_core.models import build_model
m = build_model(dict(name="gpt2", vocab_size=97, hidden_size=64, num_hidden_layers=2, num_heads=4,
                     max_position_embeddings=128MIXED))
p = m.init_params(3)
ids = np.random.default_rng(5).integers(0, 97, (4, 129)).astype(np.int32)
b = {"input_ids": ids[:, :-1].copy(), "labels": ids[:, 1:].copy(), "loss_mask": np.ones((4, 128), np.int32)}
loss, n, g, _ = m.forward_backward(p, b)
h = hashlib.sha256(repr(loss).encode())
for unit in g:
    for k in sorted(unit):
        h.update(unit[k].tobytes())
print(h.hexdigest())
"""
    digests = set()
    for threads in ("1", "2"):
        env = dict(os.environ, OMP_NUM_THREADS=threads, OPENBLAS_NUM_THREADS=threads)
        digests.add(subprocess.run([sys.executable, "-c", code.replace("MIXED", mixed)], env=env, check=True,
                                   capture_output=True, text=True).stdout.strip())
    assert len(digests) == 1


def _dense_attention(q, k, v, scale, mask, dout):
    """Causal attention and its gradients, in float64 with the whole [t, t] product."""
    q, k, v, dout = (x.astype(np.float64) for x in (q, k, v, dout))
    t = q.shape[2]
    s = q @ k.transpose(0, 1, 3, 2) * scale
    s[:, :, np.triu(np.ones((t, t), bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    used = p if mask is None else p * mask
    dused = dout @ v.transpose(0, 1, 3, 2)
    dp = dused if mask is None else dused * mask
    ds = p * (dp - (p * dp).sum(-1, keepdims=True)) * scale
    return used @ v, p, (ds @ k, ds.transpose(0, 1, 3, 2) @ q, used.transpose(0, 1, 3, 2) @ dout)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("t", [5, 64, 100, 200])
@pytest.mark.parametrize("dropout", [False, True])
def test_blocked_causal_attention_is_dense_attention_and_both_paths_agree_bit_for_bit(rng, dtype, t, dropout):
    """Attention in blocks of query rows (wse_core.nn.attention: t a multiple of the block or not)
    equals the whole masked product; the kernels' own BLAS calls give the bits of the same blocks
    through numpy (the path where numpy's BLAS is not one the kernels can call)."""
    from wse_core.nn import attention, gemm

    q, k, v, dout = (rng.standard_normal((2, 3, t, 16)).astype(dtype) for _ in range(4))
    mask = (rng.random((2, 3, t, t)) > 0.2).astype(dtype) * 1.25 if dropout else None
    out, probs = attention.forward(q, k, v, 0.3, ops, mask)
    grads = attention.backward(dout, q, k, v, probs, 0.3, ops, mask)
    want_out, want_probs, want_grads = _dense_attention(q, k, v, 0.3, mask, dout)
    for got, want in [(out, want_out), (probs, want_probs), *zip(grads, want_grads)]:
        np.testing.assert_allclose(got, want, rtol=TOL[dtype], atol=TOL[dtype])
    if not gemm.blas_in_kernels():
        pytest.skip("numpy's BLAS is not one the kernels call: only the numpy path runs here")
    try:
        gemm._state["blas"] = False
        out2, probs2 = attention.forward(q, k, v, 0.3, ops, mask)
        grads2 = attention.backward(dout, q, k, v, probs2, 0.3, ops, mask)
    finally:
        gemm._state["blas"] = None
    for a, b in [(out, out2), (probs, probs2), *zip(grads, grads2)]:
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("dropout", [False, True])
@pytest.mark.parametrize("t, block", [(100, None), (650, 300)])
def test_attention_in_bfloat16_products_has_the_same_bits_on_both_paths(rng, monkeypatch, dropout, t, block):
    """In bfloat16 products, the attention kernel's own products give the bits of the same blocks through
    gemm.matmul (the path where numpy's BLAS is not one the kernels can call), gradients added to dk and
    dv as matmul's results are (also blocks of more than 256 rows, whose added products go through a
    temporary); and the values are attention in float64 to bfloat16's error."""
    from wse_core.nn import attention, gemm

    if not gemm.blas_in_kernels():
        pytest.skip("numpy's BLAS is not one the kernels call: only the numpy path runs here")
    if block is not None:
        monkeypatch.setattr(attention, "BLOCK", block)
    q, k, v, dout = (rng.standard_normal((2, 3, t, 16)).astype(np.float32) for _ in range(4))
    mask = (rng.random((2, 3, t, t)) > 0.2).astype(np.float32) * 1.25 if dropout else None
    results = []
    for kernels in (None, False):
        try:
            gemm._state["blas"] = kernels
            with gemm.products_in("bfloat16"):
                out, probs = attention.forward(q, k, v, 0.3, ops, mask)
                results.append([out, probs, *attention.backward(dout, q, k, v, probs, 0.3, ops, mask)])
        finally:
            gemm._state["blas"] = None
    for a, b in zip(*results):
        assert a.tobytes() == b.tobytes()
    want_out, want_probs, want_grads = _dense_attention(q, k, v, 0.3, mask, dout)
    for got, want in [(results[0][0], want_out), *zip(results[0][2:], want_grads)]:
        np.testing.assert_allclose(got, want, rtol=0.05, atol=0.05)
    assert np.abs(results[0][0] - want_out).max() > 1e-5   # bfloat16 operands, not float32's


def test_matmul_through_the_kernels_gives_numpys_bits(rng):
    """A 2-D product's row chunks called from the kernels' threads give the bits of the same calls
    made by numpy (transposed operands and sample boundaries included)."""
    from wse_core.nn import gemm

    if not gemm.blas_in_kernels():
        pytest.skip("numpy's BLAS is not one the kernels call")
    a = rng.standard_normal((700, 300)).astype(np.float32)
    w = rng.standard_normal((200, 300)).astype(np.float32)
    cases = [(a, w.T, 350), (a.T, a, None), (a[:, :64], w[:, :64].T, None)]
    got = [gemm.matmul(x, y, rows) for x, y, rows in cases]
    try:
        gemm._state["blas"] = False
        want = [gemm.matmul(x, y, rows) for x, y, rows in cases]
    finally:
        gemm._state["blas"] = None
    for g, w_ in zip(got, want):
        assert g.tobytes() == w_.tobytes()


@pytest.mark.parametrize("products", [None, "bfloat16"])
def test_a_bias_added_by_the_product_has_the_bits_of_adding_it_after(rng, products):
    """matmul(a, b, bias=...) is ``out = matmul(a, b); out += bias`` bit for bit, whether the kernels'
    threads add it after their calls, numpy's pool does, or the bfloat16 kernel adds it in its store
    (and its portable emulation after a row); a bias of another dtype is numpy's add."""
    from wse_core.nn import _kernels, gemm

    a = rng.standard_normal((300, 70)).astype(np.float32)
    w = rng.standard_normal((90, 70)).astype(np.float32)
    bias = rng.standard_normal(90).astype(np.float32)
    with gemm.products_in(products):
        want = gemm.matmul(a, w.T, 150)
        want += bias
        for blas in (None, False):
            try:
                gemm._state["blas"] = blas
                assert gemm.matmul(a, w.T, 150, bias=bias).tobytes() == want.tobytes()
            finally:
                gemm._state["blas"] = None
        wide = gemm.matmul(a, w.T, 150)
        wide += bias.astype(np.float64)
        assert gemm.matmul(a, w.T, 150, bias=bias.astype(np.float64)).tobytes() == wide.tobytes()
    if products:
        got = np.empty_like(want)
        _kernels.gemm_bf16(a, w.T, got, 1, portable=True, bias=bias)
        assert got.tobytes() == want.tobytes()


def test_a_product_merged_into_fewer_calls_keeps_its_canonical_bits(rng):
    """Where the kernels call BLAS, a 2-D product's canonical calls (a sample's chunks of CHUNK_ROWS
    rows) are merged into one run a worker only if a trial of that shape and layout gave every bit
    the same (remembered); either way the result is that of the canonical calls, sample by sample."""
    from wse_core.nn import _kernels, gemm

    if not gemm.blas_in_kernels():
        pytest.skip("numpy's BLAS is not one the kernels call")
    x = rng.standard_normal((8 * 128, 96)).astype(np.float32)
    w = rng.standard_normal((160, 96)).astype(np.float32)
    got = gemm.matmul(x, w.T, sample_rows=128)
    canonical = np.empty_like(got)
    bounds = np.array(gemm._row_chunks(x.shape[0], 128), np.intp)
    _kernels.gemm_rows(x, w.T, canonical, bounds, *gemm._layout(x), *gemm._layout(w.T), 1)
    assert got.tobytes() == canonical.tobytes()
    for s in range(8):  # and each sample alone, as a batch of one
        alone = gemm.matmul(x[s * 128:(s + 1) * 128], w.T, sample_rows=128)
        assert alone.tobytes() == got[s * 128:(s + 1) * 128].tobytes()
    assert any(key[1] == x.shape and key[2] == (96, 160) for key in gemm._state["merges"])


def _bf16(x):
    """float64 of x rounded to bfloat16 (nearest, ties to even), as the product kernel reads it."""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32)
    return ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).view(np.float32).astype(np.float64)


@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (5, 3, 7), (9, 300, 65), (40, 67, 70), (130, 256, 100)])
def test_bfloat16_products_are_the_instructions_arithmetic_on_every_path(rng, m, k, n):
    """The bfloat16 product kernel (AVX512-BF16 where the CPU has it) gives the bits of the element-by-
    element emulation of bf16_gemm.h, for operands in any layout, with NaN, infinities, float32
    subnormals and overflow among them; with 1 or 2 threads; and a row's bits do not depend on the
    rows around it. Its values are the float64 products of the rounded operands, to float32's
    accumulation error."""
    from wse_core.nn import _kernels

    a = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal((k, n)).astype(np.float32)
    exact = _bf16(a) @ _bf16(b)
    tol = 4 * k * np.finfo(np.float32).eps * (np.abs(_bf16(a)) @ np.abs(_bf16(b)))
    got = np.empty((m, n), np.float32)
    _kernels.gemm_bf16(a, b, got, 2)
    assert (np.abs(got - exact) <= tol).all()
    assert np.abs(got - a.astype(np.float64) @ b).max() > 0 or k < 3  # the operands were rounded
    a.flat[::11], a.flat[::17], b.flat[::13], b.flat[::19] = np.nan, 3.4e38, 1e-39, -np.inf
    want = np.empty((m, n), np.float32)
    _kernels.gemm_bf16(a, b, want, 1, portable=True)
    for x, y in [(a, b), (np.asfortranarray(a), b), (a, np.asfortranarray(b))]:
        out = np.empty((m, n), np.float32)
        for threads in (1, 2):
            _kernels.gemm_bf16(x, y, out, threads)
            assert out.tobytes() == want.tobytes()
    out = np.empty((n, m), np.float32)
    _kernels.gemm_bf16(b.T, a.T, out, 2)   # the same values; a NaN may take the other operand's sign
    assert np.array_equal(out.T, want, equal_nan=True)
    rows = np.empty((m - m // 2, n), np.float32)
    _kernels.gemm_bf16(a[m // 2:], b, rows, 2)
    assert rows.tobytes() == want[m // 2:].tobytes()


def test_a_bfloat16_model_multiplies_bfloat16_operands(rng):
    """In a bfloat16 mixed-precision model a unit's products round both operands (activations too, not
    only the streamed weights) and accumulate in float32: a linear layer's output is the float64
    product of the rounded operands to float32's error, and not the product of float32 operands."""
    from wse_core.nn import layers
    from wse_core.nn.gemm import matmul, products_in
    from wse_core.nn.precision import Precision

    assert Precision("bfloat16").products == "bfloat16"
    assert Precision("float16").products is None and Precision(None).products is None
    x = rng.standard_normal((64, 96)).astype(np.float32)
    w = rng.standard_normal((48, 96)).astype(np.float32)
    with products_in("bfloat16"):
        y = layers.linear_forward(x, w, None)
        batched = matmul(x.reshape(4, 16, 96), w.T)
    exact = _bf16(x) @ _bf16(w).T
    np.testing.assert_allclose(y, exact, rtol=1e-5, atol=1e-4)
    assert np.abs(y - x.astype(np.float64) @ w.T.astype(np.float64)).max() > 1e-2
    assert batched.tobytes() == y.reshape(4, 16, 48).tobytes()
    assert matmul(x, w.T).tobytes() != y.tobytes()   # outside the context: float32 operands
    with pytest.raises(ValueError, match="float16"):
        with products_in("float16"):
            pass


@pytest.mark.parametrize("dtype", DTYPES)
def test_exact_gelu_and_its_derivative_are_within_float_rounding_of_erf(dtype):
    """The exact GELU's float32 erf (wse_math.h: Abramowitz & Stegun 7.1.26, vectorised) is within
    5e-7 of glibc's, forward and backward; float64 uses libm's erf."""
    x = np.linspace(-9, 9, 20001).astype(dtype).reshape(1, -1)
    y = ops.bias_gelu_forward(x.copy(), np.zeros(x.shape[1], dtype), exact=True)
    dy = ops.gelu_backward(x, np.ones_like(x), exact=True)
    erf = np.vectorize(math.erf)(x.astype(np.float64) / math.sqrt(2))
    want = 0.5 * x * (1 + erf)
    want_d = 0.5 * (1 + erf) + x * np.exp(-0.5 * x.astype(np.float64) ** 2) / math.sqrt(2 * math.pi)
    tol = 5e-7 * np.maximum(1, np.abs(x)) if dtype == np.float32 else 1e-13
    assert (np.abs(y - want) <= tol).all() and (np.abs(dy - want_d) <= tol).all()
