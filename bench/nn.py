"""Forward + backward of one GPT-2 block and of a small GPT-2: fused kernels against unfused numpy (and PyTorch, if installed).

    wse bench nn [--json PATH] [--repeats R] [--profile]

The block is hidden 256, 4 heads, sequence 256, batch 8, float32. The unfused baseline is the
same code with ``wse_core.nn.numpy_ops`` in place of the fused kernels (same GEMMs), so its
ratio measures what fusion buys. Where PyTorch is importable, the same block (same weights) runs
in PyTorch eager on the CPU, in a process of its own with PyTorch's default settings and as many
threads as the kernels use, and its output is checked against ours; ours is timed before and after
it, and the median of both reported. Our GEMMs run through
``wse_core.nn.gemm`` (BLAS pinned to one thread, parallel over fixed row chunks) so that results
are bit-identical for any thread count.

The block is also timed in mixed precision as we train in it (``mixed_precision`` with
``fp16_type: bfloat16``: weights, the block's output and its gradients rounded to bfloat16, every
product on bfloat16 operands with float32 accumulation; docs/design/numerics.md "Products in
bfloat16" and "Mixed precision") against PyTorch's CPU mixed precision, ``torch.autocast`` in
bfloat16 (its float16 autocast on this CPU took 2.5 s a block).

``--profile`` also says where the block's time goes: ours by function (cProfile's own time of
each, in the timing thread: ``gemm.matmul``'s BLAS calls show as its own time, or as a wait for its
worker threads where numpy's BLAS is not one the kernels call), PyTorch's by operator
(``torch.profiler``'s self CPU time, over its threads), per forward + backward, over the same
repeats; in float32, and in mixed precision against autocast.
"""
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from bench.harness import machine, median_seconds, seconds, table
from wse_core.errors import ConfigError, JobError
from wse_core.models import build_model
from wse_core.nn import TransformerBlock, numpy_ops
from wse_core.nn import ops as fused_ops
from wse_core.nn.model import Model

BLOCK = {"hidden": 256, "heads": 4, "seq": 256, "batch": 8}
SMALL_GPT2 = {"name": "gpt2", "vocab_size": 257, "hidden_size": 256, "num_hidden_layers": 4, "num_heads": 4,
              "max_position_embeddings": 256, "nonlinearity": "gelu_new"}


def add_arguments(parser):
    parser.add_argument("--repeats", type=int, default=7, help="timed repetitions (median reported)")
    parser.add_argument("--profile", action="store_true",
                        help="also break the block's time down by function (ours) and by operator (PyTorch's)")


def _block(ops):
    c = BLOCK["hidden"]
    # GPT-2's tanh GELU, as the PyTorch block: numpy has no erf for the unfused baseline.
    return TransformerBlock(0, c, BLOCK["heads"], 4 * c, 1e-5, num_layers=12, ops=ops, nonlinearity="gelu_new")


def _block_fwd_bwd(block, x, params, dy):
    y, saved = block.forward(x, params)
    block.backward(dy, saved, params)
    return y


def _mixed_fwd_bwd(model, x, weights, dy):
    """The block as a unit of a bfloat16 mixed-precision model (bfloat16 products; output and
    gradients rounded)."""
    y, saved = model.unit_forward(0, x, weights)
    model.unit_backward(0, dy, saved, weights)
    return y


def _products(repeats):
    """(bfloat16 kernel, BLAS path) seconds for the block's twelve dense products, in the layouts the
    layers use (x @ w.T forward; dy @ w and dy.T @ x backward), or None where the CPU has no
    AVX512-BF16 (the portable path is not what a bfloat16 run on this machine would be compared by)."""
    from wse_core.nn import _kernels
    from wse_core.nn.gemm import matmul

    if not _kernels.bf16_native():
        return None
    from wse_core import openmp_info

    rng = np.random.default_rng(1)
    n, c = BLOCK["batch"] * BLOCK["seq"], BLOCK["hidden"]
    cases = []
    for k, out in [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c)]:
        x = rng.standard_normal((n, k), dtype=np.float32)
        w = rng.standard_normal((out, k), dtype=np.float32)
        dy = rng.standard_normal((n, out), dtype=np.float32)
        cases += [(x, w.T), (dy, w), (dy.T, x)]
    outs = [np.empty((a.shape[0], b.shape[1]), np.float32) for a, b in cases]
    threads = openmp_info()["max_threads"]

    def bf16():
        for (a, b), o in zip(cases, outs):
            _kernels.gemm_bf16(a, b, o, threads)

    def blas():
        for a, b in cases:
            matmul(a, b)

    return median_seconds(bf16, repeats), median_seconds(blas, repeats)


def _profile(fn, repeats, top=12):
    """[(function, ms per call)] of ``fn``'s own time per function, the largest ``top`` and the rest."""
    import cProfile
    import pstats

    prof = cProfile.Profile()
    for _ in range(repeats):
        prof.runcall(fn)
    per = {}
    for (path, _, name), (_, _, tottime, _, _) in pstats.Stats(prof).stats.items():
        key = f"{'' if path == '~' else Path(path).stem + '.'}{name.strip('<>')}"
        # gemm.matmul's BLAS calls run inside _matmul (the kernels' threads), or, where numpy's BLAS is
        # not one the kernels can call, in worker threads while the timing thread waits on a lock.
        if key == "gemm._matmul" or "acquire' of '_thread.lock" in key:
            key = "GEMMs (gemm.matmul)"
        elif key == "gemm._matmul_bf16":
            key = "GEMMs (gemm.matmul, bfloat16 kernel)"
        per[key] = per.get(key, 0.0) + tottime
    rows = sorted(per.items(), key=lambda kv: -kv[1])
    rest = sum(v for _, v in rows[top:])
    return [(k, 1e3 * v / repeats) for k, v in rows[:top]] + [("everything else", 1e3 * rest / repeats)]


def _torch_block(params, x, dy, threads, repeats, profile=False):
    """Time the same block in PyTorch eager in a clean process; (seconds, bfloat16 autocast seconds,
    output, version, profile rows) or None."""
    if importlib.util.find_spec("torch") is None:
        return None
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "in.npz", Path(tmp) / "out.npz"
        np.savez(src, x=x, dy=dy, heads=BLOCK["heads"], **params)
        proc = subprocess.run([sys.executable, "-m", "bench._torch_block", str(src), str(dst), str(repeats),
                               str(threads), *(["profile"] if profile else [])], env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise JobError(f"the PyTorch block failed: {last}")
        out = np.load(dst)
        rows = {key: [(str(n), float(ms)) for n, ms in zip(out[f"ops{sfx}"], out[f"ms{sfx}"])]
                for key, sfx in (("torch", ""), ("torch autocast bfloat16", "_bf16"))} if profile else None
        return float(out["seconds"]), float(out["seconds_bf16"]), out["y"], str(out["version"]), rows


def run(args):
    if args.repeats < 1:
        raise ConfigError(f"--repeats must be >= 1, got {args.repeats}")
    from wse_core import openmp_info

    threads = openmp_info()["max_threads"]
    rng = np.random.default_rng(0)
    b, t, c = BLOCK["batch"], BLOCK["seq"], BLOCK["hidden"]
    fused = _block(fused_ops)
    params = Model({}, [fused]).init_params(seed=0)
    x = rng.standard_normal((b, t, c), dtype=np.float32)
    dy = rng.standard_normal((b, t, c), dtype=np.float32)
    unfused = _block(numpy_ops)

    mixed = Model({"mixed_precision": True, "fp16_type": "bfloat16"}, [fused])
    weights16 = mixed.compute_weights(params)

    def ours():
        return (seconds(lambda: _block_fwd_bwd(fused, x, params, dy), args.repeats),
                seconds(lambda: _mixed_fwd_bwd(mixed, x, weights16, dy), args.repeats))

    # Ours before and after PyTorch's process, the median of both: a shared machine drifts.
    (f1, m1), t_numpy = ours(), median_seconds(lambda: _block_fwd_bwd(unfused, x, params, dy), args.repeats)
    y_fused = _block_fwd_bwd(fused, x, params, dy)
    profile = getattr(args, "profile", False)
    torch_result = _torch_block(params, x, dy, threads, args.repeats, profile)
    f2, m2 = ours() if torch_result is not None else ([], [])
    t_fused, t_mixed = statistics.median(f1 + f2), statistics.median(m1 + m2)

    model = build_model(SMALL_GPT2)
    model_np = build_model(SMALL_GPT2, ops=numpy_ops)
    mp = model.init_params(seed=0)
    ids = rng.integers(0, SMALL_GPT2["vocab_size"], (b, t + 1)).astype(np.int32)
    batch = {"input_ids": ids[:, :-1].copy(), "labels": ids[:, 1:].copy(), "loss_mask": np.ones((b, t), np.int32)}
    m_fused = median_seconds(lambda: model.forward_backward(mp, batch), max(1, args.repeats // 2))
    m_numpy = median_seconds(lambda: model_np.forward_backward(mp, batch), max(1, args.repeats // 2))

    result = {
        "benchmark": "nn",
        "machine": machine(),
        "repeats": args.repeats,
        "block": dict(BLOCK, dtype="float32"),
        "model": dict(SMALL_GPT2, params=model.num_params(), seq=t, batch=b),
        "median_seconds": {"block_fused": t_fused, "block_numpy": t_numpy, "block_fused_bf16": t_mixed,
                           "model_fused": m_fused, "model_numpy": m_numpy},
        "block_speedup_vs_numpy": t_numpy / t_fused,
        "model_speedup_vs_numpy": m_numpy / m_fused,
        "block_tokens_per_s": b * t / t_fused,
        "model_tokens_per_s": b * t / m_fused,
    }
    products = _products(args.repeats)
    if products is not None:
        result["median_seconds"]["products_bf16"], result["median_seconds"]["products_blas"] = products
    if profile:
        result["profile"] = {"wse_core": _profile(lambda: _block_fwd_bwd(fused, x, params, dy), args.repeats),
                             "wse_core bfloat16": _profile(lambda: _mixed_fwd_bwd(mixed, x, weights16, dy),
                                                           args.repeats)}
    if torch_result is not None:
        t_torch, t_torch_bf16, y_torch, result["torch"], torch_rows = torch_result
        if profile:
            result["profile"].update(torch_rows)
        result["median_seconds"]["block_torch"] = t_torch
        result["median_seconds"]["block_torch_bf16"] = t_torch_bf16
        result["block_speedup_vs_torch"] = t_torch / t_fused
        result["block_bf16_speedup_vs_torch"] = t_torch_bf16 / t_mixed
        result["block_max_abs_diff_vs_torch"] = float(np.abs(y_torch - y_fused).max())
    return result


def report(result):
    t = result["median_seconds"]
    rows = [["GPT-2 block, fused (wse_core)", f"{t['block_fused'] * 1e3:.1f}", "1.00"],
            ["GPT-2 block, unfused numpy", f"{t['block_numpy'] * 1e3:.1f}",
             f"{t['block_numpy'] / t['block_fused']:.2f}"]]
    if "block_torch" in t:
        rows.append([f"GPT-2 block, PyTorch {result['torch']} eager", f"{t['block_torch'] * 1e3:.1f}",
                     f"{t['block_torch'] / t['block_fused']:.2f}"])
    rows.append(["GPT-2 block, fused, mixed precision (bfloat16)", f"{t['block_fused_bf16'] * 1e3:.1f}", "1.00"])
    if "block_torch_bf16" in t:
        rows.append(["GPT-2 block, PyTorch autocast bfloat16", f"{t['block_torch_bf16'] * 1e3:.1f}",
                     f"{t['block_torch_bf16'] / t['block_fused_bf16']:.2f}"])
    if "products_bf16" in t:
        rows += [["the block's 12 products, float32 through BLAS", f"{t['products_blas'] * 1e3:.1f}", "1.00"],
                 ["the block's 12 products, bfloat16 kernel (AVX512-BF16)", f"{t['products_bf16'] * 1e3:.1f}",
                  f"{t['products_bf16'] / t['products_blas']:.2f}"]]
    mdl = result["model"]
    rows += [[f"GPT-2 {mdl['num_hidden_layers']} layers ({mdl['params'] / 1e6:.1f}M), fused",
              f"{t['model_fused'] * 1e3:.1f}", "1.00"],
             [f"GPT-2 {mdl['num_hidden_layers']} layers, unfused numpy", f"{t['model_numpy'] * 1e3:.1f}",
              f"{t['model_numpy'] / t['model_fused']:.2f}"]]
    m = result["machine"]
    blk = result["block"]
    lines = [f"forward + backward, batch {blk['batch']} x seq {blk['seq']}, hidden {blk['hidden']}, "
             f"{blk['heads']} heads, float32; median of {result['repeats']}; {m['cpu']}, "
             f"{m['kernel_threads']} kernel threads",
             table(rows, ["", "ms", "time / fused time"]),
             f"block speedup vs numpy: {result['block_speedup_vs_numpy']:.2f}x; "
             f"model speedup vs numpy: {result['model_speedup_vs_numpy']:.2f}x; "
             f"block {result['block_tokens_per_s']:,.0f} tokens/s"]
    if "block_speedup_vs_torch" in result:
        lines.append(f"block speedup vs PyTorch: {result['block_speedup_vs_torch']:.2f}x "
                     f"(max |difference| of outputs {result['block_max_abs_diff_vs_torch']:.1e}); in mixed "
                     f"precision: {result['block_bf16_speedup_vs_torch']:.2f}x")
    for who, rows in result.get("profile", {}).items():
        lines.append(f"\nwhere the block's forward + backward goes, {who} (ms per call, own time):")
        lines.append(table([[name, f"{ms:.1f}"] for name, ms in rows],
                           ["function" if who.startswith("wse_core") else "operator", "ms"]))
    return "\n".join(lines)
