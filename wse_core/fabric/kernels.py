"""Reference programs for the PE mesh, each with its numpy reference.

``stencil7``: the 7-point stencil v = 6 u - (the six neighbours of u), zero outside the domain, on
a W x H x Z grid mapped as in the SC20 wafer-scale stencil paper: PE (x, y) holds the z-column
u[:, y, x] in its memory. Each PE streams its column to its four neighbours on microthreads (the
SDK's async DSD ops) while its task computes the centre and z terms from memory, then adds each
incoming column as it reads it from the fabric. Colors alternate with the sender's parity along
the axis, so a PE never sends and receives on one color: east 0/1, west 2/3, south 4/5, north 6/7.

``allreduce``: rows sum westward, column 0 northward, PE (0, 0) broadcasts the total back; every
PE runs it inline in its task (``_allreduce_body``), so a program can call it as often as it needs
on the same colors. ``bicgstab`` solves the stencil system with both, all on the mesh.

Programs whose PEs differ only by which neighbours they have and the parity of x and y use one
code region per such class (``_grid``: at most 36 strided regions, whatever the fabric size).
"""
import numpy as np

from wse_core.fabric.program import Fabric, FabricError, Program, fin, fout, imm, mem, ops

CENTER, NEIGHBOUR = 6.0, -1.0
_SEND = {"E": 0, "W": 2, "S": 4, "N": 6}
_FROM = {"W": "E", "E": "W", "N": "S", "S": "N"}   # a column from my west neighbour was sent east
AR = 8   # first of the six allreduce colors when a program also runs the stencil (colors 0-7)


def _spans(n):
    """Contiguous index ranges with the same neighbours: (start, stop, has_low, has_high)."""
    if n == 1:
        return [(0, 1, False, False)]
    if n == 2:
        return [(0, 1, False, True), (1, 2, True, False)]
    return [(0, 1, False, True), (1, n - 1, True, True), (n - 1, n, True, False)]


def _grid(prog, W, H):
    """Code regions by neighbourhood and parity: [(region, {"W": has_w, "E": .., "N": .., "S": ..}, px, py)]."""
    out = []
    for (x0, x1, has_w, has_e) in _spans(W):
        for (y0, y1, has_n, has_s) in _spans(H):
            for px in range(2):
                for py in range(2):
                    xa, ya = x0 + (px - x0) % 2, y0 + (py - y0) % 2
                    if xa < x1 and ya < y1:
                        out.append((prog.region(xa, ya, x1 - xa, y1 - ya, step=(2, 2)),
                                    {"W": has_w, "E": has_e, "N": has_n, "S": has_s}, px, py))
    return out


def stencil7_reference(u):
    """numpy: v = 6 u - neighbours (zero outside), u as [Z, H, W]; float64."""
    u = u.astype(np.float64)
    v = CENTER * u
    p = np.pad(u, 1)
    v += NEIGHBOUR * (p[:-2, 1:-1, 1:-1] + p[2:, 1:-1, 1:-1] + p[1:-1, :-2, 1:-1] + p[1:-1, 2:, 1:-1]
                      + p[1:-1, 1:-1, :-2] + p[1:-1, 1:-1, 2:])
    return v


def _stencil_routes(prog, W, H):
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


def _stencil_body(u, v, k, z, nb, px, py):
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
    _stencil_routes(prog, width, height)
    for region, nb, px, py in _grid(prog, width, height):
        u = prog.alloc(region, "u", z)
        v = prog.alloc(region, "v", z)
        k = prog.alloc(region, "k", 2)
        prog.task(region, "start", _stencil_body(u, v, k, z, nb, px, py))
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


def _row_reduce(prog, W, H, base=0):
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


def _allreduce_routes(prog, W, H, base):
    """Colors base + 0/1 row reduce, + 2/3 column 0 reduce (by the sender's y parity), + 4 column 0
    broadcast from PE (0, 0), + 5 row broadcasts from column 0."""
    _row_reduce(prog, W, H, base)
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


def _allreduce_body(d, res, acc, n, nb, px, py, base):
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
    ``_allreduce_routes``). Returns (what every PE holds [H, W, n], the float64 sum, Result)."""
    W, H = width, height
    prog = Program(fabric or Fabric(W, H))
    _allreduce_routes(prog, W, H, 0)
    for region, nb, px, py in _grid(prog, W, H):
        vec = prog.alloc(region, "vec", n)
        res = prog.alloc(region, "res", n)
        acc = prog.alloc(region, "acc", n)
        prog.task(region, "start", _allreduce_body(vec, res, acc, n, nb, px, py, 0))
    c = prog.compile()
    full = prog.region(0, 0, W, H)
    x = np.random.default_rng(seed).standard_normal((H, W, n)).astype(np.float32)
    c.memcpy_h2d(vec, full, x)
    c.launch("start")
    result = c.run()
    return c.memcpy_d2h(res, full), x.astype(np.float64).sum(axis=(0, 1)), result


KERNELS["allreduce"] = allreduce


def _tiles(fabric, b, local):
    """A program in which PE (j, i) computes a partial y tile (b words, symbol y) with
    ``local(prog, region, y)`` -> (symbols, instructions), and the partials of each row sum westward
    into column 0. Returns (compiled program, program, symbols, the symbol holding y on column 0)."""
    W, H = fabric.width, fabric.height
    prog = Program(fabric)
    groups = [(prog.region(0, 0, 1, H), "west", 0)] + _row_reduce(prog, W, H)
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

    comp, prog, (a_sym, x_sym), y_out = _tiles(fabric or Fabric(W, H), b, local)
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


KERNELS["gemv"] = gemv


def stream_gemm(width, height, tokens_per_pe, k_per_pe, n, *, seed=0, fabric=None):
    """Y = X W as weight streaming computes it: activations resident, weights streaming in.

    A (width + 1) x height fabric. Column 0 stands for the wafer's west edge, where the weights
    arrive: PE (0, i) sends the rows of W's K-slice i (``k_per_pe`` rows of n values) east, and they
    are multicast along row i. Compute PE (1 + j, i) holds X's tile (tokens j, K-slice i) [tokens_per_pe,
    k_per_pe] in its memory; for each weight row k it receives, it stores the row (n cycles) and adds
    X[m, k] times it to its partial output row m (one FMAC of n elements per token, the X element as
    a stride-0 scalar). The partial outputs [tokens_per_pe, n] are then summed northward along each
    column (colors by the sender's row parity, as ``_row_reduce`` does westward), so row 0 holds Y's
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
    for (y0, y1, has_n, has_s) in _spans(H):
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


KERNELS["stream_gemm"] = stream_gemm


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

    comp, prog, (a_sym, r_sym, c_sym, x_sym), y_out = _tiles(fabric or Fabric(W, H), b, local)
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


KERNELS["spmv"] = spmv


def bicgstab_reference(b, tol=1e-5, max_iter=500):
    """numpy float64 BiCGSTAB for stencil7_reference(x) = b (b as [Z, H, W]); returns (x, iterations)."""
    b = b.astype(np.float64)
    x = np.zeros_like(b)
    r = b.copy()
    rhat, p, v = r.copy(), np.zeros_like(b), np.zeros_like(b)
    rho = alpha = omega = 1.0
    stop = tol * np.linalg.norm(b)
    for it in range(1, max_iter + 1):
        rho_new = np.vdot(rhat, r)
        p = r + (rho_new / rho) * (alpha / omega) * (p - omega * v)
        rho = rho_new
        v = stencil7_reference(p)
        alpha = rho / np.vdot(rhat, v)
        s = r - alpha * v
        t = stencil7_reference(s)
        omega = np.vdot(t, s) / np.vdot(t, t)
        x += alpha * p + omega * s
        r = s - omega * t
        if np.linalg.norm(r) <= stop:
            return x, it
    return x, max_iter


# Scalars of the solver, words of the "sc" symbol on every PE.
_RHO, _RHO_NEW, _ALPHA, _OMEGA, _BETA, _TMP, _NEG, _RR = range(8)


def bicgstab_program(width, height, z, *, fabric=None):
    """BiCGSTAB for the stencil7 system, every step on the mesh: each PE holds the z-columns of x, r,
    r^, p, v, s, t; the matrix is applied with ``_stencil_body`` (colors 0-7) and every dot product
    is a local FMAC into a stride-0 accumulator followed by ``_allreduce_body`` (colors 8-13); every
    PE then computes the same scalars (FDIV on one-word DSDs). Task "init" computes rho = (r^, r)
    and |r|^2; each launch of "iter" is one iteration, ending with the new rho and |r|^2 ("sc" words
    _RHO_NEW and _RR). Returns (program, symbols: dict name -> Symbol)."""
    W, H = width, height
    prog = Program(fabric or Fabric(W, H))
    _stencil_routes(prog, W, H)
    _allreduce_routes(prog, W, H, AR)
    syms = {}
    for region, nb, px, py in _grid(prog, W, H):
        for name in ("x", "r", "rhat", "p", "v", "s", "t"):
            syms[name] = prog.alloc(region, name, z)
        for name, n in (("k", 2), ("sc", 8), ("d", 2), ("res", 2), ("acc", 2)):
            syms[name] = prog.alloc(region, name, n)
        sc = syms["sc"]

        def s1(i):   # one scalar
            return mem(sc, i, 1)

        def sz(i):   # a scalar as a z-long operand
            return mem(sc, i, z, 0)

        def dots(pairs):
            """d[i] = sum over the column of a_i * b_i, then summed over the mesh into res."""
            n = len(pairs)
            out = [ops.FMOV(mem(syms["d"], 0, n), imm(0))]
            out += [ops.FMAC(mem(syms["d"], i, z, 0), mem(a), mem(bb)) for i, (a, bb) in enumerate(pairs)]
            return out + _allreduce_body(syms["d"], syms["res"], syms["acc"], n, nb, px, py, AR)

        rho_rr = dots([(syms["rhat"], syms["r"]), (syms["r"], syms["r"])]) + [
            ops.FMOV(s1(_RHO_NEW), mem(syms["res"], 0, 1)), ops.FMOV(s1(_RR), mem(syms["res"], 1, 1))]
        prog.task(region, "init", rho_rr)
        body = [
            # beta = (rho_new / rho) (alpha / omega); p = r + beta (p - omega v)
            ops.FDIV(s1(_BETA), s1(_RHO_NEW), s1(_RHO)),
            ops.FDIV(s1(_TMP), s1(_ALPHA), s1(_OMEGA)),
            ops.FMUL(s1(_BETA), s1(_BETA), s1(_TMP)),
            ops.FMOV(s1(_RHO), s1(_RHO_NEW)),
            ops.FNEG(s1(_NEG), s1(_OMEGA)),
            ops.FMAC(mem(syms["p"]), mem(syms["v"]), sz(_NEG)),
            ops.FMUL(mem(syms["p"]), mem(syms["p"]), sz(_BETA)),
            ops.FADD(mem(syms["p"]), mem(syms["p"]), mem(syms["r"])),
            *_stencil_body(syms["p"], syms["v"], syms["k"], z, nb, px, py),                      # v = A p
            *dots([(syms["rhat"], syms["v"])]),
            ops.FDIV(s1(_ALPHA), s1(_RHO), mem(syms["res"], 0, 1)),                         # alpha = rho / (r^, v)
            ops.FNEG(s1(_NEG), s1(_ALPHA)),
            ops.FMOV(mem(syms["s"]), mem(syms["r"])),
            ops.FMAC(mem(syms["s"]), mem(syms["v"]), sz(_NEG)),                                # s = r - alpha v
            ops.FMAC(mem(syms["x"]), mem(syms["p"]), sz(_ALPHA)),                              # x += alpha p
            *_stencil_body(syms["s"], syms["t"], syms["k"], z, nb, px, py),                      # t = A s
            *dots([(syms["t"], syms["s"]), (syms["t"], syms["t"])]),
            ops.FDIV(s1(_OMEGA), mem(syms["res"], 0, 1), mem(syms["res"], 1, 1)),              # omega = (t, s) / (t, t)
            ops.FMAC(mem(syms["x"]), mem(syms["s"]), sz(_OMEGA)),                              # x += omega s
            ops.FNEG(s1(_NEG), s1(_OMEGA)),
            ops.FMOV(mem(syms["r"]), mem(syms["s"])),
            ops.FMAC(mem(syms["r"]), mem(syms["t"]), sz(_NEG)),                                # r = s - omega t
            *rho_rr,
        ]
        prog.task(region, "iter", body)
    return prog, syms


def bicgstab(width, height, z, *, tol=1e-5, max_iter=200, seed=0, fabric=None):
    """Solve stencil7(x) = b for a random b on the mesh; the host launches one iteration at a time
    and stops when the |r| the mesh reports is at most tol |b|. Returns (x [Z, H, W], the float64
    numpy BiCGSTAB solution, Result summed over the runs, with ``extra``: iterations, the median
    cycles of an iteration and their spread, the true relative residual of x computed in float64)."""
    from wse_core.fabric.run import Result

    if not tol > 0 or max_iter < 0:
        raise FabricError(f"bicgstab: expected tol > 0 and max_iter >= 0, got tol={tol}, max_iter={max_iter}")
    prog, syms = bicgstab_program(width, height, z, fabric=fabric)
    c = prog.compile()
    full = prog.region(0, 0, width, height)
    b = np.random.default_rng(seed).standard_normal((z, height, width)).astype(np.float32)
    cols = b.transpose(1, 2, 0)
    c.memcpy_h2d(syms["r"], full, cols)      # x0 = 0: r0 = b, and r^ = r0
    c.memcpy_h2d(syms["rhat"], full, cols)
    c.memcpy_h2d(syms["k"], full, np.array([CENTER, NEIGHBOUR], np.float32))
    sc = np.zeros(8, np.float32)
    sc[[_RHO, _ALPHA, _OMEGA]] = 1
    c.memcpy_h2d(syms["sc"], full, sc)
    origin = prog.region(0, 0, 1, 1)
    runs = []

    def step(task):
        c.launch(task)
        runs.append(c.run())
        return float(c.memcpy_d2h(syms["sc"], origin)[0, 0, _RR])

    rr0 = step("init")
    rr, iters = rr0, 0
    while iters < max_iter and not rr <= tol * tol * rr0:   # `not <=`: a nan residual stops too
        rr = step("iter")
        iters += 1
        if not np.isfinite(rr):
            raise FabricError(f"bicgstab: breakdown at iteration {iters} (|r|^2 = {rr})")
    x = c.memcpy_d2h(syms["x"], full).transpose(2, 0, 1)
    bb = b.astype(np.float64)
    residual = float(np.linalg.norm(bb - stencil7_reference(x)) / np.linalg.norm(bb))
    total = Result(sum(r.cycles for r in runs), sum(r.busy for r in runs), sum(r.stall for r in runs),
                   sum(r.link for r in runs), seconds=sum(r.seconds for r in runs))
    per_iter = [r.cycles for r in runs[1:]]
    total.extra = {"iterations": iters, "converged": bool(rr <= tol * tol * rr0), "relative_residual": residual,
                   "init_cycles": runs[0].cycles,
                   "cycles_per_iteration": int(np.median(per_iter)) if per_iter else 0,
                   "cycles_per_iteration_spread": int(max(per_iter) - min(per_iter)) if per_iter else 0}
    return x, bicgstab_reference(b, tol, max_iter)[0], total


KERNELS["bicgstab"] = bicgstab
