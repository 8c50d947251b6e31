"""Dense matrix products whose bits do not depend on the number of threads.

OpenBLAS gives different bits for the same product with 1 and 2 threads (measured here on
x @ W.T, [512, 64] x [64, 192] float32), which would break the promise that the cluster and the
reference step agree bit for bit whatever the threads per rank. So BLAS runs on one thread:
for good once ``pin_blas()`` was called (``wse_core.configure_process`` does, in the ranks and the
CLI), else for the duration of each product (threadpoolctl, about 11 us a call measured here,
restoring the caller's setting after). ``matmul`` parallelises on its own: a 2-D product is split
into fixed chunks of ``CHUNK_ROWS`` rows of the left operand, a batched product into groups of whole
matrices. The chunking depends only on the shapes, so the result is the same for any number of
workers; the workers are the kernels' OpenMP thread count.

Where numpy's BLAS is its own OpenBLAS wheel (scipy-openblas, 64-bit integers: numpy's Linux
wheels), a 2-D product's chunks are BLAS calls made from the kernels' OpenMP threads
(``_kernels.gemm_rows``), as ``wse_core.nn.attention``'s are; elsewhere numpy makes them from a pool
of Python threads. Both make one call per chunk; dispatching them in Python cost 10-25% of the
block's products (docs/benchmarks.md, "Where the block's time goes").

A BLAS's result for one row may depend on how many rows share the call and on the row's place
among them: OpenBLAS 0.3.31 gives other bits for a row of a 5-row and of a 15-row product
(SkylakeX kernel: small-matrix code below some size), and its Haswell kernel other bits for rows
6-11 than 0-5 of every 12 in a 128-row product (measured here). So a product whose rows are the
tokens of samples is told the rows per sample (``sample_rows``) and is cut at the samples'
boundaries too: a sample's rows meet BLAS in the same calls at the same places whatever else is
in the batch, and its values do not depend on the batch (docs/design.md section 5, (c)). When the
sample length is a multiple of ``CHUNK_ROWS`` the calls are the ones an uncut product makes.

Those chunks are the product's canonical calls, and its bits are theirs. Each call packs the
whole right operand (a layer's weights) again, which cost a CS-2 rank 11% of its time (perf, the
peers GPT-2: OpenBLAS's ``sgemm_itcopy`` and ``incopy``). So where the kernels call BLAS, a product
whose canonical calls can be merged into fewer without changing a bit is: the first product of each
shape and layout (rows, columns, inner size, transposes, leading dimensions, samples, workers) is
made both ways on random operands of that shape and layout, and merged calls, one run of whole
chunks a worker, are used for that shape if every bit agrees (``_merges``). A BLAS's order of
operations for a call depends on its shape, layout and threads, not on the values (an assumption:
OpenBLAS's kernels branch on sizes, never on data), so the check on random values stands for every
product of the shape; where it fails (a small-matrix path for
the chunks, say), the canonical calls are made. Forward products of the peers GPT-2's block ran
15-20% faster merged, backward 4-9% (docs/benchmarks.md).

Inside ``products_in("bfloat16")`` (a bfloat16 mixed-precision unit) the products are the kernels'
own instead: bfloat16 operands, float32 accumulation, each element one fixed chain whatever the
rows or threads (``_kernels.gemm_bf16``, ``bf16_gemm.h``), so none of the above chunking is needed.
"""
import contextlib
import contextvars
import ctypes
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import ThreadpoolController

from wse_core._openmp import openmp_info
from wse_core.nn import _kernels

#: Rows of the left operand per task of a 2-D product (fixed: it decides the bits).
CHUNK_ROWS = 128

_state = {"pool": None, "workers": None, "controller": None, "pinned": None, "blas": None, "merges": {}}

#: The format float32 products' operands are rounded to inside ``products_in`` (None: float32).
_products = contextvars.ContextVar("wse_products", default=None)


@contextlib.contextmanager
def products_in(fmt):
    """Within: ``matmul``'s float32 products take both operands rounded to ``fmt`` and accumulate
    exact products in float32 (``"bfloat16"``: ``_kernels.gemm_bf16``, AVX512-BF16's arithmetic; None:
    float32 operands through BLAS). A mixed-precision bfloat16 model computes its units inside one
    (docs/design/numerics.md "Products in bfloat16")."""
    if fmt not in (None, "bfloat16"):
        raise ValueError(f"products_in: no {fmt} products (bfloat16 or None)")
    token = _products.set(fmt)
    try:
        yield
    finally:
        _products.reset(token)


def _controller():
    if _state["controller"] is None:
        _state["controller"] = ThreadpoolController()
    return _state["controller"]


def products():
    """The format of the products' operands here and now (``products_in``): "bfloat16" or None."""
    return _products.get()


def pin_blas():
    """Run BLAS on one thread for the rest of the process (kept: restoring it would change bits)."""
    if _state["pinned"] is None:
        _state["pinned"] = _controller().limit(limits=1, user_api="blas")


def blas_in_kernels():
    """Whether the kernels call numpy's BLAS themselves (found and handed over on first use)."""
    if _state["blas"] is None:
        _state["blas"] = _find_blas()
    return _state["blas"]


def _find_blas():
    blas = np.show_config(mode="dicts").get("Build Dependencies", {}).get("blas", {})
    if blas.get("name") != "scipy-openblas" or "USE64BITINT" not in blas.get("openblas configuration", ""):
        return False
    for lib in _controller().select(internal_api="openblas").lib_controllers:
        if "numpy" not in lib.filepath:
            continue
        dll = ctypes.CDLL(lib.filepath)
        try:
            sgemm, dgemm = dll.scipy_cblas_sgemm64_, dll.scipy_cblas_dgemm64_
        except AttributeError:
            return False
        _kernels.set_blas(ctypes.cast(sgemm, ctypes.c_void_p).value, ctypes.cast(dgemm, ctypes.c_void_p).value)
        return True
    return False


def _pool():
    if _state["workers"] is None:
        _state["workers"] = openmp_info()["max_threads"]
        if _state["workers"] > 1:
            _state["pool"] = ThreadPoolExecutor(_state["workers"], thread_name_prefix="wse-gemm")
    return _state["pool"], _state["workers"]


def matmul(a, b, sample_rows=None, bias=None):
    """a @ b for 2-D a, or for stacks of matrices (numpy broadcasting rules), thread-count independent.

    ``sample_rows``: a 2-D ``a`` holds samples of that many rows each (tokens); each sample's rows
    get the same BLAS calls whatever the other samples (see the module's docstring). ``bias``: added
    to every row, the bits of ``out = matmul(a, b); out += bias``; for a 2-D product of the bias's
    dtype, by the threads that made the rows, after each call (numpy's add is a pass over memory on
    one thread: 1.3 ms of the GPT-2 block's 70).
    """
    if bias is not None and (a.ndim != 2 or b.ndim != 2 or bias.dtype != np.result_type(a, b)):
        out = matmul(a, b, sample_rows)  # numpy's add: another dtype's bias computes in the wider one
        out += bias
        return out
    if _products.get() is not None and a.dtype == np.float32 and b.dtype == np.float32:
        return _matmul_bf16(a, b, bias)
    if _state["pinned"] is None:
        with _controller().limit(limits=1, user_api="blas"):
            return _matmul(a, b, sample_rows, bias)
    return _matmul(a, b, sample_rows, bias)


def _matmul_bf16(a, b, bias=None):
    """``matmul`` in bfloat16 products: one kernel call a matrix. Every element is its own fixed
    chain of additions (bf16_gemm.h), so no chunking is needed for bits independent of threads,
    rows or batch."""
    workers = _pool()[1]
    if a.ndim == 2 and b.ndim == 2:
        out = np.empty((a.shape[0], b.shape[1]), np.float32)
        _kernels.gemm_bf16(a, b, out, workers, bias=None if bias is None else np.ascontiguousarray(bias))
        return out
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = np.broadcast_to(a, shape + a.shape[-2:])
    b = np.broadcast_to(b, shape + b.shape[-2:])
    out = np.empty(shape + (a.shape[-2], b.shape[-1]), np.float32)
    for i in np.ndindex(*shape):
        _kernels.gemm_bf16(a[i], b[i], out[i], workers)
    return out


def _row_chunks(m, sample_rows):
    """Row ranges of the BLAS calls of a 2-D product: ``CHUNK_ROWS`` at a time, within each sample."""
    period = m if sample_rows is None else sample_rows
    if m % period:
        raise ValueError(f"a: {m} rows are not whole samples of sample_rows={period}")
    return [(s + lo, s + min(lo + CHUNK_ROWS, period)) for s in range(0, m, period)
            for lo in range(0, period, CHUNK_ROWS)]


def _layout(x):
    """(transposed, leading dimension) of a 2-D float array BLAS can read in place, else None."""
    if x.dtype not in (np.float32, np.float64):
        return None
    item = x.itemsize
    if x.strides[1] == item and x.strides[0] >= max(1, x.shape[1]) * item and x.strides[0] % item == 0:
        return False, x.strides[0] // item
    if x.strides[0] == item and x.strides[1] >= max(1, x.shape[0]) * item and x.strides[1] % item == 0:
        return True, x.strides[1] // item
    return None


def _like(x, lay, rng):
    """Random values in an array of ``x``'s shape, dtype and layout (transposed, leading dimension)."""
    transposed, ld = lay
    rows, cols = x.shape[::-1] if transposed else x.shape
    y = rng.standard_normal((rows, ld)).astype(x.dtype)[:, :cols]
    return y.T if transposed else y


def _merges(a, b, lay_a, lay_b, bounds, runs, workers):
    """Whether BLAS gives a product of this shape and layout the same bits in the calls ``runs`` as
    in its canonical calls ``bounds`` (the module's docstring): tried once per shape, on random
    operands, and remembered."""
    key = (a.dtype.str, a.shape, b.shape, lay_a, lay_b, tuple(bounds), workers)
    merges = _state["merges"]
    if key not in merges:
        rng = np.random.default_rng(0)
        x, y = _like(a, lay_a, rng), _like(b, lay_b, rng)
        outs = [np.empty((a.shape[0], b.shape[1]), a.dtype) for _ in range(2)]
        for calls, o in zip((bounds, runs), outs):
            _kernels.gemm_rows(x, y, o, np.array(calls, np.intp), *lay_a, *lay_b, workers)
        merges[key] = outs[0].tobytes() == outs[1].tobytes()
    return merges[key]


def _run_chunks(a, b, out, bounds, bias=None):
    for lo, hi in bounds:
        np.matmul(a[lo:hi], b, out=out[lo:hi])
        if bias is not None:
            out[lo:hi] += bias


def _share(bounds, workers):
    """``bounds`` cut into at most ``workers`` consecutive runs of about equal rows."""
    total = bounds[-1][1] - bounds[0][0]
    parts, start, done = [], 0, 0
    for i, (lo, hi) in enumerate(bounds):
        done += hi - lo
        if done * workers >= total * (len(parts) + 1) or i == len(bounds) - 1:
            parts.append(bounds[start:i + 1])
            start = i + 1
    return parts


def _matmul(a, b, sample_rows, bias=None):
    pool, workers = _pool()
    if a.ndim == 2:
        m = a.shape[0]
        out = np.empty((m, b.shape[-1]), np.result_type(a, b))
        bounds = _row_chunks(m, sample_rows) if m else []
        lay_a, lay_b = _layout(a), _layout(b)
        if bounds and a.shape[1] and b.shape[1] and lay_a and lay_b and a.dtype == b.dtype and blas_in_kernels():
            runs = [(part[0][0], part[-1][1]) for part in _share(bounds, workers)]
            if len(runs) < len(bounds) and _merges(a, b, lay_a, lay_b, bounds, runs, workers):
                bounds = runs
            _kernels.gemm_rows(a, b, out, np.array(bounds, np.intp), *lay_a, *lay_b, workers,
                               bias=None if bias is None else np.ascontiguousarray(bias))
            return out
        if pool is None or len(bounds) < 2:
            _run_chunks(a, b, out, bounds, bias)
        else:
            # One task per worker, each a run of whole chunks: which worker makes a call changes no
            # bits, and a task per chunk cost 10-25% of these products in dispatch (measured).
            list(pool.map(lambda part: _run_chunks(a, b, out, part, bias), _share(bounds, workers)))
        return out
    # Batched: every matrix of the stack is its own BLAS call, so grouping them changes no bits.
    shape = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    a = np.broadcast_to(a, shape + a.shape[-2:])
    b = np.broadcast_to(b, shape + b.shape[-2:])
    out = np.empty(shape + (a.shape[-2], b.shape[-1]), np.result_type(a, b))
    n = int(np.prod(shape))
    a3, b3, o3 = a.reshape(n, *a.shape[-2:]), b.reshape(n, *b.shape[-2:]), out.reshape(n, *out.shape[-2:])
    if pool is None or n < 2:
        np.matmul(a3, b3, out=o3)
    else:
        step = -(-n // workers)
        list(pool.map(lambda lo: np.matmul(a3[lo:lo + step], b3[lo:lo + step], out=o3[lo:lo + step]),
                      range(0, n, step)))
    return out
