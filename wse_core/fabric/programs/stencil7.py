"""``stencil7``: the 7-point stencil v = 6 u - (the six neighbours of u), zero outside the domain, on
a W x H x Z grid mapped as in the SC20 wafer-scale stencil paper: PE (x, y) holds the z-column
u[:, y, x] in its memory. Each PE streams its column to its four neighbours on microthreads (the
SDK's async DSD ops) while its task computes the centre and z terms from memory, then adds each
incoming column as it reads it from the fabric. Colors alternate with the sender's parity along
the axis, so a PE never sends and receives on one color: east 0/1, west 2/3, south 4/5, north 6/7.
"""
import numpy as np

from wse_core.fabric.isa import fin, fout, mem, ops
from wse_core.fabric.program import Fabric, Program
from wse_core.fabric.programs.entry import Entry, Option
from wse_core.fabric.programs.grid import grid

CENTER, NEIGHBOUR = 6.0, -1.0
_SEND = {"E": 0, "W": 2, "S": 4, "N": 6}
_FROM = {"W": "E", "E": "W", "N": "S", "S": "N"}   # a column from my west neighbour was sent east


def stencil7_reference(u):
    """numpy: v = 6 u - neighbours (zero outside), u as [Z, H, W]; float64."""
    u = u.astype(np.float64)
    v = CENTER * u
    p = np.pad(u, 1)
    v += NEIGHBOUR * (p[:-2, 1:-1, 1:-1] + p[2:, 1:-1, 1:-1] + p[1:-1, :-2, 1:-1] + p[1:-1, 2:, 1:-1]
                      + p[1:-1, 1:-1, :-2] + p[1:-1, 1:-1, 2:])
    return v


def stencil_routes(prog, W, H):
    """Colors 0-7: each PE sends its column to each neighbour and receives theirs (parity-alternating)."""
    for x in range(W):
        col = prog.region(x, 0, 1, H)
        if x < W - 1:
            prog.route(col, _SEND["E"] + x % 2, rx=["RAMP"], tx=["E"])
            prog.route(col, _SEND["W"] + (x + 1) % 2, rx=["E"], tx=["RAMP"])
        if x > 0:
            prog.route(col, _SEND["W"] + x % 2, rx=["RAMP"], tx=["W"])
            prog.route(col, _SEND["E"] + (x - 1) % 2, rx=["W"], tx=["RAMP"])
    for y in range(H):
        row = prog.region(0, y, W, 1)
        if y < H - 1:
            prog.route(row, _SEND["S"] + y % 2, rx=["RAMP"], tx=["S"])
            prog.route(row, _SEND["N"] + (y + 1) % 2, rx=["S"], tx=["RAMP"])
        if y > 0:
            prog.route(row, _SEND["N"] + y % 2, rx=["RAMP"], tx=["N"])
            prog.route(row, _SEND["S"] + (y - 1) % 2, rx=["N"], tx=["RAMP"])


def stencil_body(u, v, k, z, nb, px, py):
    """v = 6 u - neighbours on one PE: send u to each neighbour on a microthread, centre and z terms
    from memory (k holds the two coefficients, read as stride-0 scalars), then each neighbour's
    column as it arrives. u must not change until the neighbours have read it."""
    parity = {"E": px, "W": px, "S": py, "N": py}
    body = [ops.FMOV(fout(_SEND[d] + parity[d], z), mem(u)).asynchronous() for d in "EWSN" if nb[d]]
    body.append(ops.FMUL(mem(v), mem(u), mem(k, 0, z, 0)))
    if z > 1:
        body.append(ops.FMAC(mem(v, 0, z - 1), mem(u, 1, z - 1), mem(k, 1, z - 1, 0)))
        body.append(ops.FMAC(mem(v, 1, z - 1), mem(u, 0, z - 1), mem(k, 1, z - 1, 0)))
    for d in "WENS":
        if nb[d]:   # the neighbour on side d sent towards me; its parity differs from mine
            color = _SEND[_FROM[d]] + 1 - parity[d]
            body.append(ops.FMAC(mem(v), fin(color, z), mem(k, 1, z, 0)))
    return body


def stencil7_program(width, height, z, *, fabric=None):
    """The program and its symbols: (program, u, v, k). Copy u and k = (6, -1) in, launch "start", run, copy v out."""
    prog = Program(fabric or Fabric(width, height))
    stencil_routes(prog, width, height)
    for region, nb, px, py in grid(prog, width, height):
        u = prog.alloc(region, "u", z)
        v = prog.alloc(region, "v", z)
        k = prog.alloc(region, "k", 2)
        prog.task(region, "start", stencil_body(u, v, k, z, nb, px, py))
    return prog, u, v, k


def stencil7(width, height, z, *, seed=0, fabric=None):
    """Run one stencil application on random u; returns (v from the fabric [Z, H, W], reference, Result)."""
    prog, u_sym, v_sym, k_sym = stencil7_program(width, height, z, fabric=fabric)
    c = prog.compile()
    full = prog.region(0, 0, width, height)
    u = np.random.default_rng(seed).standard_normal((z, height, width)).astype(np.float32)
    c.memcpy_h2d(u_sym, full, u.transpose(1, 2, 0))
    c.memcpy_h2d(k_sym, full, np.array([CENTER, NEIGHBOUR], np.float32))   # the coefficients, on every PE
    c.launch("start")
    result = c.run()
    v = c.memcpy_d2h(v_sym, full).transpose(2, 0, 1)
    return v, stencil7_reference(u), result


PROGRAM = Entry("stencil7", stencil7, (Option("z", ("z",), int, 32, "points along z in each PE's memory"),),
                report=lambda result, kw: {"cycles_per_point": result.cycles / kw["z"]})
