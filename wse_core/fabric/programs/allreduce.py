"""``allreduce``: rows sum westward, column 0 northward, PE (0, 0) broadcasts the total back; every
PE runs it inline in its task (``allreduce_body``), so a program can call it as often as it needs
on the same colors (``bicgstab`` does). ``row_reduce`` is also the westward sum of ``gemv``'s tiles.
"""
import numpy as np

from wse_core.fabric.isa import fin, fout, mem, ops
from wse_core.fabric.program import Fabric, Program
from wse_core.fabric.programs.entry import Entry, Option
from wse_core.fabric.programs.grid import grid


def allreduce_reference(vec):
    """The sum the mesh computes, in its order (float32): each row east to west, then column 0 south to north."""
    h, w, n = vec.shape
    rows = np.empty((h, n), np.float32)
    for y in range(h):
        s = vec[y, w - 1].copy()
        for x in range(w - 2, -1, -1):
            s = s + vec[y, x]
        rows[y] = s
    t = rows[h - 1].copy()
    for y in range(h - 2, -1, -1):
        t = t + rows[y]
    return t


def row_reduce(prog, W, H, base=0):
    """Routes of a westward reduce along every row (colors base + 0/1 by the sender's x parity; column
    0 receives on base + 1), and the code regions east of column 0: [(region, "east" or "mid", x parity)]."""
    for x in range(1, W):
        col = prog.region(x, 0, 1, H)
        prog.route(col, base + x % 2, rx=["RAMP"], tx=["W"])
        if x < W - 1:
            prog.route(col, base + (x + 1) % 2, rx=["E"], tx=["RAMP"])
    groups = []
    if W > 1:
        prog.route(prog.region(0, 0, 1, H), base + 1, rx=["E"], tx=["RAMP"])
        groups.append((prog.region(W - 1, 0, 1, H), "east", (W - 1) % 2))
        for px in range(2):
            xa = 1 + (px - 1) % 2
            if xa <= W - 2:
                groups.append((prog.region(xa, 0, W - 1 - xa, H, step=(2, 1)), "mid", px))
    return groups


def allreduce_routes(prog, W, H, base):
    """Colors base + 0/1 row reduce, + 2/3 column 0 reduce (by the sender's y parity), + 4 column 0
    broadcast from PE (0, 0), + 5 row broadcasts from column 0."""
    row_reduce(prog, W, H, base)
    for x in range(1, W):
        prog.route(prog.region(x, 0, 1, H), base + 5, rx=["W"], tx=["E", "RAMP"] if x < W - 1 else ["RAMP"])
    if W > 1:
        prog.route(prog.region(0, 0, 1, H), base + 5, rx=["RAMP"], tx=["E"])
    for y in range(1, H):
        pe = prog.region(0, y, 1, 1)
        prog.route(pe, base + 2 + y % 2, rx=["RAMP"], tx=["N"])
        if y < H - 1:
            prog.route(pe, base + 2 + (y + 1) % 2, rx=["S"], tx=["RAMP"])
        prog.route(pe, base + 4, rx=["N"], tx=["S", "RAMP"] if y < H - 1 else ["RAMP"])
    if H > 1:
        prog.route(prog.region(0, 0, 1, 1), base + 3, rx=["S"], tx=["RAMP"])
        prog.route(prog.region(0, 0, 1, 1), base + 4, rx=["RAMP"], tx=["S"])


def allreduce_body(d, res, acc, n, nb, px, py, base):
    """Instructions that sum the first n words of d over the mesh into res on every PE (acc: scratch
    on column 0), in the order of ``allreduce_reference``. Every PE reads its inputs inline, so the
    task stalls until its part arrives; calls follow each other in order on the same colors."""
    row, col, down, along = base, base + 2, base + 4, base + 5
    if nb["W"]:   # east of column 0: pass the row's partial sum west, then wait for the total
        send = fout(row + px, n)
        first = ops.FADD(send, fin(row + 1 - px, n), mem(d, 0, n)) if nb["E"] else ops.FMOV(send, mem(d, 0, n))
        return [first, ops.FMOV(mem(res, 0, n), fin(along, n))]
    body = [ops.FADD(mem(acc, 0, n), fin(row + 1, n), mem(d, 0, n)) if nb["E"] else ops.FMOV(mem(acc, 0, n), mem(d, 0, n))]
    if nb["N"]:   # column 0 below the root
        send = fout(col + py, n)
        body.append(ops.FADD(send, fin(col + 1 - py, n), mem(acc, 0, n)) if nb["S"] else ops.FMOV(send, mem(acc, 0, n)))
        body.append(ops.FMOV(mem(res, 0, n), fin(down, n)))
    else:         # PE (0, 0): the total, then down column 0
        body.append(ops.FADD(mem(res, 0, n), fin(col + 1, n), mem(acc, 0, n)) if nb["S"]
                    else ops.FMOV(mem(res, 0, n), mem(acc, 0, n)))
        if nb["S"]:
            body.append(ops.FMOV(fout(down, n), mem(res, 0, n)))
    if nb["E"]:
        body.append(ops.FMOV(fout(along, n), mem(res, 0, n)))
    return body


def allreduce(width, height, n, *, seed=0, fabric=None):
    """Sum a vector of n values over every PE and give every PE the sum (colors 0-5, see
    ``allreduce_routes``). Returns (what every PE holds [H, W, n], the float64 sum, Result)."""
    W, H = width, height
    prog = Program(fabric or Fabric(W, H))
    allreduce_routes(prog, W, H, 0)
    for region, nb, px, py in grid(prog, W, H):
        vec = prog.alloc(region, "vec", n)
        res = prog.alloc(region, "res", n)
        acc = prog.alloc(region, "acc", n)
        prog.task(region, "start", allreduce_body(vec, res, acc, n, nb, px, py, 0))
    c = prog.compile()
    full = prog.region(0, 0, W, H)
    x = np.random.default_rng(seed).standard_normal((H, W, n)).astype(np.float32)
    c.memcpy_h2d(vec, full, x)
    c.launch("start")
    result = c.run()
    return c.memcpy_d2h(res, full), x.astype(np.float64).sum(axis=(0, 1)), result



PROGRAM = Entry("allreduce", allreduce, (Option("n", ("n",), int, 64, "vector length"),))
