"""``gemv``: y = A x on a checkerboard of tiles, the partial tiles summed westward along each row
(``tile_program``, which ``spmv`` shares)."""
import numpy as np

from wse_core.fabric.isa import fin, fout, mem, ops
from wse_core.fabric.program import Fabric, Program
from wse_core.fabric.programs.allreduce import row_reduce
from wse_core.fabric.programs.entry import Entry, Option

#: What ``--tile`` means for gemv and spmv.
TILE_HELP = "each PE's tile of A is TILE x TILE"


def tile_program(fabric, b, local):
    """A program in which PE (j, i) computes a partial y tile (b words, symbol y) with
    ``local(prog, region, y)`` -> (symbols, instructions), and the partials of each row sum westward
    into column 0. Returns (compiled program, program, symbols, the symbol holding y on column 0)."""
    W, H = fabric.width, fabric.height
    prog = Program(fabric)
    groups = [(prog.region(0, 0, 1, H), "west", 0)] + row_reduce(prog, W, H)
    for region, role, px in groups:
        y = prog.alloc(region, "y", b)
        syms, body = local(prog, region, y)
        out = y
        if role == "east":
            body = body + [ops.FMOV(fout(px, b), mem(y))]
        elif role == "mid":
            body = body + [ops.FADD(fout(px, b), fin((px + 1) % 2, b), mem(y))]
        elif W > 1:
            out = prog.alloc(region, "ytotal", b)
            body = body + [ops.FADD(mem(out), fin(1, b), mem(y))]
        prog.task(region, "start", body)
        if role == "west":
            y_out = out
    return prog.compile(), prog, syms, y_out


def gemv(width, height, rows_per_pe, cols_per_pe, *, seed=0, fabric=None):
    """y = A x on a checkerboard of tiles: PE (j, i) holds A's tile (i, j) [rows_per_pe, cols_per_pe]
    (row-major) and x's tile j, computes its partial y with one FMAC per tile column (the x element
    as a stride-0 scalar), and the partials are summed westward along each row.
    Returns (y gathered from column 0 [height * rows_per_pe], the float64 A @ x, Result).
    """
    W, H, b, c = width, height, rows_per_pe, cols_per_pe

    def local(prog, region, y):
        a = prog.alloc(region, "A", b * c)
        xs = prog.alloc(region, "x", c)
        return (a, xs), [ops.FMAC(mem(y), mem(a, k, b, c), mem(xs, k, b, 0)) for k in range(c)]

    comp, prog, (a_sym, x_sym), y_out = tile_program(fabric or Fabric(W, H), b, local)
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((H * b, W * c)).astype(np.float32)
    xv = rng.standard_normal(W * c).astype(np.float32)
    full = prog.region(0, 0, W, H)
    comp.memcpy_h2d(a_sym, full, A.reshape(H, b, W, c).transpose(0, 2, 1, 3).reshape(H, W, b * c))
    comp.memcpy_h2d(x_sym, full, np.broadcast_to(xv.reshape(1, W, c), (H, W, c)))   # x tile j on column j
    comp.launch("start")
    result = comp.run()
    got = comp.memcpy_d2h(y_out, prog.region(0, 0, 1, H)).reshape(-1)
    return got, A.astype(np.float64) @ xv.astype(np.float64), result



PROGRAM = Entry("gemv", gemv, (Option("tile", ("rows_per_pe", "cols_per_pe"), int, 16, TILE_HELP),))
