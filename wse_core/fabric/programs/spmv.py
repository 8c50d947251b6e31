"""``spmv``: y = A x for a random sparse A on ``gemv``'s checkerboard, each tile's nonzeros in
coordinate form, read through indexed memory DSDs."""
import numpy as np

from wse_core.fabric.isa import FabricError, mem, ops
from wse_core.fabric.program import Fabric
from wse_core.fabric.programs.entry import Entry, Option
from wse_core.fabric.programs.gemv import TILE_HELP, tile_program


def spmv(width, height, rows_per_pe, cols_per_pe, density=0.1, *, seed=0, fabric=None):
    """y = A x for a random sparse A (each entry nonzero with probability ``density``) on the GEMV
    checkerboard: PE (j, i) holds tile (i, j)'s nonzeros in coordinate form (values, tile row and
    column indices, padded with zeros to the largest tile's count, since every PE of a region runs
    the same code) and does y[row[k]] += a[k] * x[col[k]] with one FMAC over indexed memory DSDs;
    the partial tiles sum westward along each row. Returns (y [height * rows_per_pe], the float64
    A @ x, Result); the Result's ``extra`` gives nnz and the padded slots.
    """
    W, H, b, c = width, height, rows_per_pe, cols_per_pe
    if not 0 <= density <= 1:
        raise FabricError(f"spmv: density must be in [0, 1], got {density}")
    rng = np.random.default_rng(seed)
    A = np.where(rng.random((H * b, W * c)) < density, rng.standard_normal((H * b, W * c)), 0).astype(np.float32)
    xv = rng.standard_normal(W * c).astype(np.float32)
    tiles = A.reshape(H, b, W, c).transpose(0, 2, 1, 3)           # [i, j, row, col]
    counts = (tiles != 0).sum(axis=(2, 3))
    slots = max(int(counts.max()), 1)

    def local(prog, region, y):
        a = prog.alloc(region, "vals", slots)
        rows = prog.alloc(region, "rows", slots, dtype="int32")
        cols = prog.alloc(region, "cols", slots, dtype="int32")
        xs = prog.alloc(region, "x", c)
        return (a, rows, cols, xs), [ops.FMAC(mem(y, index=mem(rows)), mem(a), mem(xs, index=mem(cols)))]

    comp, prog, (a_sym, r_sym, c_sym, x_sym), y_out = tile_program(fabric or Fabric(W, H), b, local)
    vals = np.zeros((H, W, slots), np.float32)
    ri = np.zeros((H, W, slots), np.int32)
    ci = np.zeros((H, W, slots), np.int32)
    i, j, r, q = np.nonzero(tiles)          # tile by tile, row-major inside each: the order the FMAC adds in
    first = np.concatenate([[0], np.cumsum(counts.ravel())[:-1]])
    k = np.arange(len(i)) - first[i * W + j]   # slot of each nonzero in its tile
    vals[i, j, k], ri[i, j, k], ci[i, j, k] = tiles[i, j, r, q], r, q
    full = prog.region(0, 0, W, H)
    for sym, data in ((a_sym, vals), (r_sym, ri), (c_sym, ci)):
        comp.memcpy_h2d(sym, full, data)
    comp.memcpy_h2d(x_sym, full, np.broadcast_to(xv.reshape(1, W, c), (H, W, c)))
    comp.launch("start")
    result = comp.run()
    result.extra = {"nnz": int(counts.sum()), "slots_per_pe": slots, "padding": float(1 - counts.sum() / (slots * W * H))}
    got = comp.memcpy_d2h(y_out, prog.region(0, 0, 1, H)).reshape(-1)
    return got, A.astype(np.float64) @ xv.astype(np.float64), result



PROGRAM = Entry("spmv", spmv, (Option("tile", ("rows_per_pe", "cols_per_pe"), int, 16, TILE_HELP),
                               Option("density", ("density",), float, 0.1, "fraction of A's entries that are nonzero")))
