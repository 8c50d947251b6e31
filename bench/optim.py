"""Fused AdamW against plain numpy and against memory-copy bandwidth, in the same run.

    wse bench optim [--json PATH] [--size N] [--repeats R]

Bytes are counted as read + written: the fused AdamW update reads param, grad, exp_avg and
exp_avg_sq and writes param, exp_avg and exp_avg_sq (7 arrays); a copy reads one and writes one.
The copy baseline is the faster of numpy's copy (memcpy, one thread) and a copy on the kernels'
OpenMP threads, so the fraction of copy bandwidth is never flattered by a slow baseline.
"""
import math

import numpy as np

from bench.harness import machine, median_seconds, table
from wse_core._openmp import parallel_copy
from wse_core.errors import ConfigError
from wse_core.optim import AdamW

HPARAMS = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def numpy_adamw(param, grad, exp_avg, exp_avg_sq, *, step, lr, betas, eps, weight_decay):
    """The AdamW formula in plain numpy, in place where numpy allows: the baseline."""
    beta1, beta2 = betas
    param *= 1.0 - lr * weight_decay
    exp_avg *= beta1
    exp_avg += (1.0 - beta1) * grad
    exp_avg_sq *= beta2
    exp_avg_sq += (1.0 - beta2) * grad * grad
    step_size = lr / (1.0 - beta1 ** step)
    denom = np.sqrt(exp_avg_sq) / math.sqrt(1.0 - beta2 ** step)
    denom += eps
    param -= step_size * (exp_avg / denom)


def add_arguments(parser):
    parser.add_argument("--size", type=int, default=16 * 2**20,
                        help="parameters per array (default: 16M float32, 64 MiB per array)")
    parser.add_argument("--repeats", type=int, default=15, help="timed repetitions (median reported)")


def run(args):
    n, repeats = args.size, args.repeats
    if n < 1 or repeats < 1:
        raise ConfigError(f"--size and --repeats must be >= 1, got {n} and {repeats}")
    rng = np.random.default_rng(0)
    dtype = np.float32
    itemsize = np.dtype(dtype).itemsize

    def fresh():
        p = rng.standard_normal(n, dtype=dtype)
        g = rng.standard_normal(n, dtype=dtype)
        return p, g, np.zeros(n, dtype), np.zeros(n, dtype)

    opt = AdamW(**HPARAMS)
    p, g, m, v = fresh()
    state = {"exp_avg": m, "exp_avg_sq": v}
    counter = iter(range(1, 10**9))
    t_fused = median_seconds(lambda: opt.update(p, g, state, step=next(counter)), repeats)

    p2, g2, m2, v2 = fresh()
    counter2 = iter(range(1, 10**9))
    t_numpy = median_seconds(
        lambda: numpy_adamw(p2, g2, m2, v2, step=next(counter2), **HPARAMS), repeats)

    src, dst = rng.standard_normal(n, dtype=dtype), np.empty(n, dtype)
    t_copy_numpy = median_seconds(lambda: np.copyto(dst, src), repeats)
    t_copy_omp = median_seconds(lambda: parallel_copy(dst, src), repeats)

    gbs = lambda nbytes, t: nbytes / t / 1e9  # noqa: E731
    fused_bw = gbs(7 * n * itemsize, t_fused)
    copy_bw = max(gbs(2 * n * itemsize, t_copy_numpy), gbs(2 * n * itemsize, t_copy_omp))
    return {
        "benchmark": "optim",
        "machine": machine(),
        "size": n,
        "dtype": "float32",
        "repeats": repeats,
        "median_seconds": {
            "fused_adamw": t_fused,
            "numpy_adamw": t_numpy,
            "copy_numpy": t_copy_numpy,
            "copy_openmp": t_copy_omp,
        },
        "bandwidth_gb_per_s": {
            "fused_adamw": fused_bw,
            "copy_numpy": gbs(2 * n * itemsize, t_copy_numpy),
            "copy_openmp": gbs(2 * n * itemsize, t_copy_omp),
        },
        "speedup_vs_numpy": t_numpy / t_fused,
        "fraction_of_copy_bandwidth": fused_bw / copy_bw,
    }


def report(result):
    t, bw = result["median_seconds"], result["bandwidth_gb_per_s"]
    rows = [
        ["fused AdamW (wse_core)", f"{t['fused_adamw'] * 1e3:.2f}", f"{bw['fused_adamw']:.2f}"],
        ["numpy AdamW", f"{t['numpy_adamw'] * 1e3:.2f}", ""],
        ["copy, numpy (1 thread)", f"{t['copy_numpy'] * 1e3:.2f}", f"{bw['copy_numpy']:.2f}"],
        ["copy, OpenMP", f"{t['copy_openmp'] * 1e3:.2f}", f"{bw['copy_openmp']:.2f}"],
    ]
    m = result["machine"]
    return "\n".join([
        f"AdamW update of {result['size']:,} float32 parameters; median of {result['repeats']} runs; "
        f"{m['cpu']}, {m['cores']} cores, {m['kernel_threads']} kernel threads",
        table(rows, ["", "ms", "GB/s (read+written)"]),
        f"speedup vs numpy:           {result['speedup_vs_numpy']:.2f}x",
        f"fraction of copy bandwidth: {result['fraction_of_copy_bandwidth']:.2f}",
    ])
