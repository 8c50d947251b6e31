"""``stream_gemm``: Y = X W as weight streaming computes it, activations resident and the weights
streaming in from the west edge; the core that ``perf.calibration`` fits the compute model on."""
import numpy as np

from wse_core.fabric.isa import FabricError, fin, fout, mem, ops
from wse_core.fabric.program import Fabric, Program
from wse_core.fabric.programs.entry import Entry, Option
from wse_core.fabric.programs.grid import spans


def stream_gemm(width, height, tokens_per_pe, k_per_pe, n, *, seed=0, fabric=None):
    """Y = X W as weight streaming computes it: activations resident, weights streaming in.

    A (width + 1) x height fabric. Column 0 stands for the wafer's west edge, where the weights
    arrive: PE (0, i) sends the rows of W's K-slice i (``k_per_pe`` rows of n values) east, and they
    are multicast along row i. Compute PE (1 + j, i) holds X's tile (tokens j, K-slice i) [tokens_per_pe,
    k_per_pe] in its memory; for each weight row k it receives, it stores the row (n cycles) and adds
    X[m, k] times it to its partial output row m (one FMAC of n elements per token, the X element as
    a stride-0 scalar). The partial outputs [tokens_per_pe, n] are then summed northward along each
    column (colors by the sender's row parity, as ``row_reduce`` does westward), so row 0 holds Y's
    token block j. Returns (Y [width * tokens_per_pe, n], the float64 X @ W, Result); the Result's
    ``extra`` gives the multiply-adds and the FMAC lanes' utilisation.
    """
    W, H, mb, kb = width, height, tokens_per_pe, k_per_pe
    if min(W, H, mb, kb, n) < 1:
        raise FabricError(f"stream_gemm: sizes must be positive, got {width}, {height}, {mb}, {kb}, {n}")
    prog = Program(fabric or Fabric(W + 1, H))
    # The weight stream: color 0 along every row, from the edge column to the last compute column.
    prog.route(prog.region(0, 0, 1, H), 0, rx=["RAMP"], tx=["E"])
    if W > 1:
        prog.route(prog.region(1, 0, W - 1, H), 0, rx=["W"], tx=["E", "RAMP"])
    prog.route(prog.region(W, 0, 1, H), 0, rx=["W"], tx=["RAMP"])
    # The reduce: row y >= 1 sends north on color 2 + y % 2; row y < H - 1 receives from the south.
    for y in range(H):
        row = prog.region(1, y, W, 1)
        if y >= 1:
            prog.route(row, 2 + y % 2, rx=["RAMP"], tx=["N"])
        if y < H - 1:
            prog.route(row, 2 + (y + 1) % 2, rx=["S"], tx=["RAMP"])
    edge = prog.region(0, 0, 1, H)
    w_sym = prog.alloc(edge, "w", kb * n)
    prog.task(edge, "start", [ops.FMOV(fout(0, kb * n), mem(w_sym))])
    out = None
    for (y0, y1, has_n, has_s) in spans(H):
        for py in range(2):
            ya = y0 + (py - y0) % 2
            if ya >= y1:
                continue
            region = prog.region(1, ya, W, y1 - ya, step=(1, 2))
            xs = prog.alloc(region, "x", mb * kb)
            wrow = prog.alloc(region, "wrow", n)
            yp = prog.alloc(region, "ypart", mb * n)
            body = []
            for k in range(kb):
                body.append(ops.FMOV(mem(wrow), fin(0, n)))
                body += [ops.FMAC(mem(yp, m * n, n), mem(wrow), mem(xs, k * mb + m, n, 0)) for m in range(mb)]
            if has_n and has_s:
                body.append(ops.FADD(fout(2 + py, mb * n), fin(3 - py, mb * n), mem(yp)))
            elif has_n:
                body.append(ops.FMOV(fout(2 + py, mb * n), mem(yp)))
            elif has_s:
                out = prog.alloc(region, "y", mb * n)
                body.append(ops.FADD(mem(out), fin(3, mb * n), mem(yp)))
            else:
                out = yp
            prog.task(region, "start", body)
            if ya == 0 and y0 == 0:
                x_sym = xs
    comp = prog.compile()
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((W * mb, H * kb)).astype(np.float32)
    Wm = rng.standard_normal((H * kb, n)).astype(np.float32)
    comp.memcpy_h2d(w_sym, edge, Wm.reshape(H, 1, kb * n))
    # PE (1 + j, i) gets tile (j, i) stored k-major: x[k * mb + m] = X[j * mb + m, i * kb + k].
    tiles = X.reshape(W, mb, H, kb).transpose(2, 0, 3, 1).reshape(H, W, kb * mb)
    comp.memcpy_h2d(x_sym, prog.region(1, 0, W, H), tiles)
    comp.launch("start")
    result = comp.run()
    macs = W * mb * H * kb * n
    result.extra = {"macs": macs, "fmac_utilisation": macs / (W * H * result.cycles)}
    got = comp.memcpy_d2h(out, prog.region(1, 0, W, 1)).reshape(W * mb, n)
    return got, X.astype(np.float64) @ Wm.astype(np.float64), result



PROGRAM = Entry("stream_gemm", stream_gemm, (Option("tile", ("tokens_per_pe", "k_per_pe"), int, 16,
                                                    "tokens and weight rows per PE"),
                                             Option("n", ("n",), int, 64, "output columns")))
