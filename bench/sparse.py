"""Sparse kernels on transformer-sized weights: GFLOP/s against scipy.sparse and dense numpy, spmv against copy bandwidth.

    wse bench sparse [--json PATH] [--size M] [--n 256,1024] [--densities 0.01,0.05,0.1,0.2,0.5] [--repeats R]

A is M x M float32 (default 4096) with a uniformly random pattern (scipy.sparse.random's, when
scipy is installed; the same draw otherwise), X is dense [M, n]. GFLOP/s count the useful work,
2 * nnz * n (2 * nnz for spmv). Baselines in the same run: scipy.sparse CSR products
(single-threaded; spmm_t as ``A.T @ X``); for sddmm, which scipy lacks, a numpy gather
``(U[rows] * V[cols]).sum(1)`` in blocks; and the dense numpy (BLAS, all cores) product of the same
shapes. spmv's bandwidth counts the bytes it must move (values, indices, row pointers, x, y)
against the OpenMP copy of the same number of bytes. The sparse layer is one forward and
backward of y = x W^T with W [M, M] and n tokens, as ``wse_core.nn`` runs it: spmm forward, spmm
on W^T's kept pattern for the input gradient (the same bits as spmm_t), sddmm for the weight
gradient; against the dense layer's three GEMMs. The crossover is the largest density measured
at which the sparse layer is faster.
"""
import importlib.util
from pathlib import Path

import numpy as np

from bench.harness import machine, median_seconds, numbers, table
from wse_core.errors import ConfigError
from wse_core.sparse import CSRMatrix, sddmm, spmm, spmm_t, spmv


def _floats(text, flag):
    return numbers(text, flag, float)


def add_arguments(parser):
    parser.add_argument("--size", type=int, default=4096, help="rows and columns of A")
    parser.add_argument("--n", default="256,1024", help="comma-separated widths of the dense operand")
    parser.add_argument("--densities", default="0.01,0.05,0.1,0.2,0.5", help="comma-separated densities")
    parser.add_argument("--repeats", type=int, default=3, help="timed repetitions (median reported)")


def _llc_bytes():
    """Size of the last-level cache from sysfs (None if unknown)."""
    best = None
    for idx in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024**2}.get(text[-1], 1)
        size = int(text.rstrip("KM")) * mult
        best = size if best is None else max(best, size)
    return best


def _matrix(m, density, seed):
    try:
        import scipy.sparse

        s = scipy.sparse.random(m, m, density=density, format="csr", dtype=np.float32, random_state=seed)
        s.sort_indices()
        return CSRMatrix.from_scipy(s), s
    except ImportError:
        rng = np.random.default_rng(seed)
        a = np.where(rng.random((m, m)) < density, rng.random((m, m), dtype=np.float32), 0).astype(np.float32)
        return CSRMatrix.from_dense(a), None


def _gather_sddmm(rows, cols, U, V, out, block=1 << 16):
    for lo in range(0, len(rows), block):
        out[lo:lo + block] = np.einsum("ij,ij->i", U[rows[lo:lo + block]], V[cols[lo:lo + block]])


def _copy_seconds(nbytes, repeats):
    """Median time of the OpenMP copy of ``nbytes`` bytes (the bandwidth baseline)."""
    from wse_core._openmp import parallel_copy

    src = np.ones(nbytes // 4, np.float32)
    dst = np.empty_like(src)
    return median_seconds(lambda: parallel_copy(dst, src), repeats)


def run(args):
    m, r = args.size, args.repeats
    widths, densities = [int(x) for x in _floats(args.n, "--n")], _floats(args.densities, "--densities")
    if m < 1 or r < 1 or not widths or not densities or not all(0 < d <= 1 for d in densities):
        raise ConfigError("--size and --repeats must be >= 1, densities in (0, 1]")
    from threadpoolctl import threadpool_limits

    have_scipy = importlib.util.find_spec("scipy") is not None
    rng = np.random.default_rng(0)
    result = {"benchmark": "sparse", "machine": machine(), "size": m, "repeats": r, "scipy": have_scipy,
              "llc_bytes": _llc_bytes(), "rows": []}
    for d in densities:
        A, s = _matrix(m, d, seed=1)
        rows_idx = A.row_indices()
        dense = A.to_dense()
        x = rng.standard_normal(m, dtype=np.float32)
        # spmv: bytes it must move, against a copy of as many bytes
        t = median_seconds(lambda: spmv(A, x), r * 3)
        nbytes = A.nnz * (4 + A.indices.itemsize) + (m + 1) * A.indptr.itemsize + 2 * m * 4
        t_copy = _copy_seconds(nbytes, r * 3)
        row = {"density": d, "nnz": A.nnz, "spmv": {"gflops": 2 * A.nnz / t / 1e9, "gb_per_s": nbytes / t / 1e9,
                                                    "copy_gb_per_s": 2 * nbytes / t_copy / 1e9,
                                                    "bytes": nbytes}}
        row["spmv"]["fraction_of_copy_bandwidth"] = row["spmv"]["gb_per_s"] / row["spmv"]["copy_gb_per_s"]
        if have_scipy:
            row["spmv"]["vs_scipy"] = median_seconds(lambda: s @ x, r) / t
        for n in widths:
            X = rng.standard_normal((m, n), dtype=np.float32)
            U = rng.standard_normal((m, n), dtype=np.float32)
            flops = 2 * A.nnz * n
            times = {"spmm": median_seconds(lambda: spmm(A, X), r),
                     "spmm_t": median_seconds(lambda: spmm_t(A, X), r),
                     "sddmm": median_seconds(lambda: sddmm(A, U, X), r)}
            base = {}
            if have_scipy:
                with threadpool_limits(1):
                    base["spmm"] = median_seconds(lambda: s @ X, r, warmup=1)
                    base["spmm_t"] = median_seconds(lambda: s.T @ X, r, warmup=1)
            out = np.empty(A.nnz, np.float32)
            base["sddmm"] = median_seconds(lambda: _gather_sddmm(rows_idx, A.indices, U, X, out), r, warmup=1)
            dense_t = {"spmm": median_seconds(lambda: dense @ X, r),
                       "spmm_t": median_seconds(lambda: dense.T @ X, r),
                       "sddmm": median_seconds(lambda: U @ X.T, r)}
            entry = {"n": n}
            for k, v in times.items():
                entry[k] = {"seconds": v, "gflops": flops / v / 1e9, "dense_seconds": dense_t[k],
                            "vs_dense": dense_t[k] / v}
                if k in base:
                    entry[k]["baseline_seconds"] = base[k]
                    entry[k]["vs_baseline"] = base[k] / v
            pattern, perm = A.transpose_pattern()
            At = pattern.with_data(A.data[perm])
            t_at = median_seconds(lambda: spmm(At, X), r)
            entry["spmm_transposed_pattern_seconds"] = t_at
            entry["layer_sparse_seconds"] = times["spmm"] + t_at + times["sddmm"]
            entry["layer_dense_seconds"] = sum(dense_t.values())
            row.setdefault("widths", []).append(entry)
        result["rows"].append(row)
    result["crossover_density"] = {}
    for n in widths:
        wins = [row["density"] for row in result["rows"] for e in row["widths"]
                if e["n"] == n and e["layer_sparse_seconds"] < e["layer_dense_seconds"]]
        result["crossover_density"][str(n)] = max(wins) if wins else None
    return result


def report(result):
    m = result["machine"]
    rows = []
    for row in result["rows"]:
        for e in row["widths"]:
            rows.append([f"{row['density']:.0%}", e["n"], *(f"{e[k]['gflops']:.1f}" for k in ("spmm", "spmm_t", "sddmm")),
                         *(f"{e[k].get('vs_baseline', float('nan')):.2f}" for k in ("spmm", "spmm_t", "sddmm")),
                         *(f"{e[k]['vs_dense']:.2f}" for k in ("spmm", "spmm_t", "sddmm")),
                         f"{e['layer_sparse_seconds'] * 1e3:.0f} / {e['layer_dense_seconds'] * 1e3:.0f}"])
    llc = result["llc_bytes"]
    spmv_rows = [[f"{row['density']:.0%}", f"{row['nnz']:,}", f"{row['spmv']['bytes'] / 1e6:.0f}"
                  + (" (> LLC)" if llc and row["spmv"]["bytes"] > llc else ""),
                  f"{row['spmv']['gflops']:.2f}", f"{row['spmv']['gb_per_s']:.1f}",
                  f"{row['spmv']['copy_gb_per_s']:.1f}", f"{row['spmv']['fraction_of_copy_bandwidth']:.2f}",
                  f"{row['spmv'].get('vs_scipy', float('nan')):.2f}"] for row in result["rows"]]
    base = "scipy.sparse, 1 thread" if result["scipy"] else "scipy not installed"
    cross = ", ".join(f"n={n}: {'<= ' + format(d, '.0%') if d else 'none measured'}"
                      for n, d in result["crossover_density"].items())
    return "\n".join([
        f"A: {result['size']} x {result['size']} float32, random pattern; median of {result['repeats']}; "
        f"{m['cpu']}, {m['cores']} cores, {m['kernel_threads']} kernel threads",
        f"GFLOP/s (2 nnz n), x baseline (spmm, spmm_t: {base}; sddmm: numpy gather), x dense numpy of the same shape",
        table(rows, ["density", "n", "spmm", "spmm_t", "sddmm", "x base", "x base", "x base", "x dense", "x dense",
                     "x dense", "layer ms sparse / dense"]),
        "",
        table(spmv_rows, ["density", "nnz", "MB moved", "spmv GFLOP/s", "GB/s", "copy GB/s", "of copy", "x scipy"]),
        f"sparse layer (forward + backward) faster than dense at densities {cross}",
    ])
