"""Reference programs for the PE mesh, each with its numpy reference.

``stencil7``: the 7-point stencil v = 6 u - (the six neighbours of u), zero outside the domain, on
a W x H x Z grid mapped as in the SC20 wafer-scale stencil paper: PE (x, y) holds the z-column
u[:, y, x] in its memory. Each PE streams its column to its four neighbours on microthreads (the
SDK's async DSD ops) while its task computes the centre and z terms from memory; each incoming
column is added by a data task bound to its color. Colors alternate with the sender's parity
along the axis, so a PE never sends and receives on one color: east 0/1, west 2/3, south 4/5,
north 6/7.
"""
import numpy as np

from wse_core.fabric.program import Fabric, Program, fin, fout, mem, ops

CENTER, NEIGHBOUR = 6.0, -1.0
_SEND = {"E": 0, "W": 2, "S": 4, "N": 6}


def _spans(n):
    """Contiguous index ranges with the same neighbours: (start, stop, has_low, has_high)."""
    if n == 1:
        return [(0, 1, False, False)]
    if n == 2:
        return [(0, 1, False, True), (1, 2, True, False)]
    return [(0, 1, False, True), (1, n - 1, True, True), (n - 1, n, True, False)]


def stencil7_reference(u):
    """numpy: v = 6 u - neighbours (zero outside), u as [Z, H, W]; float64."""
    u = u.astype(np.float64)
    v = CENTER * u
    p = np.pad(u, 1)
    v += NEIGHBOUR * (p[:-2, 1:-1, 1:-1] + p[2:, 1:-1, 1:-1] + p[1:-1, :-2, 1:-1] + p[1:-1, 2:, 1:-1]
                      + p[1:-1, 1:-1, :-2] + p[1:-1, 1:-1, 2:])
    return v


def stencil7_program(width, height, z, *, fabric=None):
    """The program and its symbols: (program, u, v, k). Copy u and k = (6, -1) in, launch "start", run, copy v out."""
    f = fabric or Fabric(width, height)
    prog = Program(f)
    # Routes: every column/row range gets the routes of its parity; ranges are single columns/rows.
    for x in range(width):
        col = prog.region(x, 0, 1, height)
        if x < width - 1:
            prog.route(col, _SEND["E"] + x % 2, rx=["RAMP"], tx=["E"])
            prog.route(col, _SEND["W"] + (x + 1) % 2, rx=["E"], tx=["RAMP"])
        if x > 0:
            prog.route(col, _SEND["W"] + x % 2, rx=["RAMP"], tx=["W"])
            prog.route(col, _SEND["E"] + (x - 1) % 2, rx=["W"], tx=["RAMP"])
    for y in range(height):
        row = prog.region(0, y, width, 1)
        if y < height - 1:
            prog.route(row, _SEND["S"] + y % 2, rx=["RAMP"], tx=["S"])
            prog.route(row, _SEND["N"] + (y + 1) % 2, rx=["S"], tx=["RAMP"])
        if y > 0:
            prog.route(row, _SEND["N"] + y % 2, rx=["RAMP"], tx=["N"])
            prog.route(row, _SEND["S"] + (y - 1) % 2, rx=["N"], tx=["RAMP"])
    u = v = k = None
    # Code: one region per neighbourhood (corner, edge or interior span) and parity pair (the
    # colors a PE uses depend on the parity of x and y): strided regions, at most 36 codes.
    for (x0, x1, has_w, has_e) in _spans(width):
        for (y0, y1, has_n, has_s) in _spans(height):
            for px in range(2):
                for py in range(2):
                    xa, ya = x0 + (px - x0) % 2, y0 + (py - y0) % 2
                    if xa >= x1 or ya >= y1:
                        continue
                    region = prog.region(xa, ya, x1 - xa, y1 - ya, step=(2, 2))
                    u, v, k = _stencil_code(prog, region, z, px, py, has_w, has_e, has_n, has_s)
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


def _stencil_code(prog, region, z, px, py, has_w, has_e, has_n, has_s):
    u = prog.alloc(region, "u", z)
    v = prog.alloc(region, "v", z)
    k = prog.alloc(region, "k", 2)   # the two coefficients, read as scalars (stride 0)
    center, nb = mem(k, 0, z, 0), mem(k, 1, z, 0)
    body = []
    sends = {"E": has_e, "W": has_w, "S": has_s, "N": has_n}
    parity = {"E": px, "W": px, "S": py, "N": py}
    for d, ok in sends.items():
        if ok:
            body.append(ops.FMOV(fout(_SEND[d] + parity[d], z), mem(u)).asynchronous())
    body.append(ops.FMUL(mem(v), mem(u), center))
    if z > 1:
        body.append(ops.FMAC(mem(v, 0, z - 1), mem(u, 1, z - 1), mem(k, 1, z - 1, 0)))
        body.append(ops.FMAC(mem(v, 1, z - 1), mem(u, 0, z - 1), mem(k, 1, z - 1, 0)))
    prog.task(region, "start", body)
    # Incoming columns: from the west neighbour's east send (its parity is 1 - px), etc.
    recv = {"W": (has_w, _SEND["E"] + 1 - px), "E": (has_e, _SEND["W"] + 1 - px),
            "N": (has_n, _SEND["S"] + 1 - py), "S": (has_s, _SEND["N"] + 1 - py)}
    for d, (ok, color) in recv.items():
        if ok:
            prog.task(region, f"from_{d}", [ops.FMAC(mem(v), fin(color, z), nb)], color=color)
    return u, v, k


def broadcast(width, height, n, *, seed=0, fabric=None):
    """Column 0 multicasts a vector of n values along its row: every PE of the row stores it.

    Returns (what every PE holds [H, W, n], the expected values, Result).
    """
    f = fabric or Fabric(width, height)
    prog = Program(f)
    src = prog.region(0, 0, 1, height)
    a = prog.alloc(src, "a", n)
    prog.route(src, 0, rx=["RAMP"], tx=["E"] if width > 1 else [])
    prog.task(src, "send", [ops.FMOV(fout(0, n), mem(a))] if width > 1 else [])
    b = None
    if width > 1:
        rest = prog.region(1, 0, width - 1, height)
        if width > 2:
            prog.route(prog.region(1, 0, width - 2, height), 0, rx=["W"], tx=["E", "RAMP"])
        prog.route(prog.region(width - 1, 0, 1, height), 0, rx=["W"], tx=["RAMP"])
        b = prog.alloc(rest, "b", n)
        prog.task(rest, "recv", [ops.FMOV(mem(b), fin(0, n))], color=0)
    c = prog.compile()
    x = np.random.default_rng(seed).standard_normal((height, 1, n)).astype(np.float32)
    c.memcpy_h2d(a, src, x)
    c.launch("send")
    result = c.run()
    got = np.empty((height, width, n), np.float32)
    got[:, :1] = c.memcpy_d2h(a, src)
    if b is not None:
        got[:, 1:] = c.memcpy_d2h(b, prog.region(1, 0, width - 1, height))
    return got, np.broadcast_to(x, (height, width, n)), result


KERNELS = {"stencil7": stencil7, "broadcast": broadcast}


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


def _row_reduce(prog, W, H):
    """Routes of a westward reduce along every row (colors 0/1 by the sender's x parity; column 0
    receives on color 1), and the code regions east of column 0: [(region, "east" or "mid", x parity)]."""
    for x in range(1, W):
        col = prog.region(x, 0, 1, H)
        prog.route(col, x % 2, rx=["RAMP"], tx=["W"])
        if x < W - 1:
            prog.route(col, (x + 1) % 2, rx=["E"], tx=["RAMP"])
    groups = []
    if W > 1:
        prog.route(prog.region(0, 0, 1, H), 1, rx=["E"], tx=["RAMP"])
        groups.append((prog.region(W - 1, 0, 1, H), "east", (W - 1) % 2))
        for px in range(2):
            xa = 1 + (px - 1) % 2
            if xa <= W - 2:
                groups.append((prog.region(xa, 0, W - 1 - xa, H, step=(2, 1)), "mid", px))
    return groups


def allreduce(width, height, n, *, seed=0, fabric=None):
    """Sum a vector of n values over every PE and give every PE the sum.

    Rows reduce westward along chains (each PE adds its vector to the stream passing through),
    column 0 reduces northward, PE (0, 0) broadcasts the total down column 0 and every PE of
    column 0 along its row. Colors: 0/1 row reduce (sender's x parity), 2/3 column reduce (sender's
    y parity), 4 column broadcast, 5 row broadcast. Returns (what every PE holds [H, W, n], the
    float64 sum, Result).
    """
    W, H = width, height
    prog = Program(fabric or Fabric(W, H))
    row_groups = _row_reduce(prog, W, H)
    for x in range(1, W):
        prog.route(prog.region(x, 0, 1, H), 5, rx=["W"], tx=["E", "RAMP"] if x < W - 1 else ["RAMP"])
    if W > 1:
        prog.route(prog.region(0, 0, 1, H), 5, rx=["RAMP"], tx=["E"])
    for y in range(1, H):
        pe = prog.region(0, y, 1, 1)
        prog.route(pe, 2 + y % 2, rx=["RAMP"], tx=["N"])
        if y < H - 1:
            prog.route(pe, 2 + (y + 1) % 2, rx=["S"], tx=["RAMP"])
        prog.route(pe, 4, rx=["N"], tx=["S", "RAMP"] if y < H - 1 else ["RAMP"])
    if H > 1:
        prog.route(prog.region(0, 0, 1, 1), 3, rx=["S"], tx=["RAMP"])
        prog.route(prog.region(0, 0, 1, 1), 4, rx=["RAMP"], tx=["S"])
    # Code regions and their tasks.
    # (region, x role, y role, x parity, y parity)
    groups = [(region, role, None, px, 0) for region, role, px in row_groups]
    for y0, y1, role in ([(0, 1, "north")] + ([(1, H - 1, "mid")] if H > 2 else []) + ([(H - 1, H, "south")] if H > 1 else [])):
        for py in range(2):
            ya = y0 + (py - y0) % 2
            if ya < y1:
                groups.append((prog.region(0, ya, 1, y1 - ya, step=(1, 2)), "west", role, 0, py))
    vec = res = None
    for region, xrole, yrole, px, py in groups:
        vec = prog.alloc(region, "vec", n)
        res = prog.alloc(region, "res", n)
        if xrole == "east":
            prog.task(region, "start", [ops.FMOV(fout(px, n), mem(vec))])
        elif xrole == "mid":
            prog.task(region, "row", [ops.FADD(fout(px, n), fin((px + 1) % 2, n), mem(vec))], color=(px + 1) % 2)
        if xrole in ("east", "mid"):
            prog.task(region, "bcast", [ops.FMOV(mem(res), fin(5, n))], color=5)
            continue
        acc = prog.alloc(region, "acc", n)
        if W > 1:
            prog.task(region, "row", [ops.FADD(mem(acc), fin(1, n), mem(vec)), ops.ACTIVATE("col")], color=1)
        else:
            prog.task(region, "start", [ops.FMOV(mem(acc), mem(vec)), ops.ACTIVATE("col")])
        along_row = [ops.FMOV(fout(5, n), mem(res))] if W > 1 else []
        if yrole == "south":
            prog.task(region, "col", [ops.FMOV(fout(2 + py, n), mem(acc))])
        elif yrole == "mid":
            prog.task(region, "col", [ops.FADD(fout(2 + py, n), fin(2 + (py + 1) % 2, n), mem(acc))])
        else:  # PE (0, 0): the total, then broadcast it down column 0 and along row 0
            total = [ops.FADD(mem(res), fin(3, n), mem(acc))] if H > 1 else [ops.FMOV(mem(res), mem(acc))]
            down = [ops.FMOV(fout(4, n), mem(res))] if H > 1 else []
            prog.task(region, "col", total + down + along_row)
        if yrole != "north":
            prog.task(region, "bcast", [ops.FMOV(mem(res), fin(4, n))] + along_row, color=4)
    c = prog.compile()
    full = prog.region(0, 0, W, H)
    x = np.random.default_rng(seed).standard_normal((H, W, n)).astype(np.float32)
    c.memcpy_h2d(vec, full, x)
    c.launch("start")
    result = c.run()
    return c.memcpy_d2h(res, full), x.astype(np.float64).sum(axis=(0, 1)), result


KERNELS["allreduce"] = allreduce


def gemv(width, height, rows_per_pe, cols_per_pe, *, seed=0, fabric=None):
    """y = A x on a checkerboard of tiles: PE (j, i) holds A's tile (i, j) [rows_per_pe, cols_per_pe]
    (row-major) and x's tile j, computes its partial y with one FMAC per tile column (the x element
    as a stride-0 scalar), and the partials are summed westward along each row, as in ``allreduce``.
    Returns (y gathered from column 0 [height * rows_per_pe], the float64 A @ x, Result).
    """
    W, H, b, c = width, height, rows_per_pe, cols_per_pe
    prog = Program(fabric or Fabric(W, H))
    groups = [(prog.region(0, 0, 1, H), "west", 0)] + _row_reduce(prog, W, H)
    syms = None
    for region, role, px in groups:
        a = prog.alloc(region, "A", b * c)
        xs = prog.alloc(region, "x", c)
        y = prog.alloc(region, "y", b)
        syms = (a, xs, y)
        local = [ops.FMAC(mem(y), mem(a, k, b, c), mem(xs, k, b, 0)) for k in range(c)]
        if role == "east":
            prog.task(region, "start", local + [ops.FMOV(fout(px, b), mem(y))])
        elif role == "mid":
            prog.task(region, "start", local + [ops.ACTIVATE("pass")])
            prog.task(region, "pass", [ops.FADD(fout(px, b), fin((px + 1) % 2, b), mem(y))])
        elif W > 1:
            yt = prog.alloc(region, "ytotal", b)
            prog.task(region, "start", local + [ops.ACTIVATE("sum")])
            prog.task(region, "sum", [ops.FADD(mem(yt), fin(1, b), mem(y))])
            syms = syms + (yt,)
        else:
            prog.task(region, "start", local)
        if role == "west":
            out = syms[3] if W > 1 else y
    comp = prog.compile()
    rng = np.random.default_rng(seed)
    A = rng.standard_normal((H * b, W * c)).astype(np.float32)
    xv = rng.standard_normal(W * c).astype(np.float32)
    full = prog.region(0, 0, W, H)
    a_sym, x_sym, y_sym = syms[:3]
    comp.memcpy_h2d(a_sym, full, A.reshape(H, b, W, c).transpose(0, 2, 1, 3).reshape(H, W, b * c))
    comp.memcpy_h2d(x_sym, full, np.broadcast_to(xv.reshape(1, W, c), (H, W, c)))   # x tile j on column j
    comp.launch("start")
    result = comp.run()
    got = comp.memcpy_d2h(out, prog.region(0, 0, 1, H)).reshape(-1)
    return got, A.astype(np.float64) @ xv.astype(np.float64), result


KERNELS["gemv"] = gemv
