"""``bicgstab``: BiCGSTAB for the ``stencil7`` system, every step on the mesh: the stencil's
``stencil_body`` applies the matrix (colors 0-7) and ``allreduce_body`` sums each dot product
(colors 8-13); the host launches one iteration at a time."""
import numpy as np

from wse_core.fabric.isa import FabricError, imm, mem, ops
from wse_core.fabric.program import Fabric, Program
from wse_core.fabric.programs.allreduce import allreduce_body, allreduce_routes
from wse_core.fabric.programs.entry import Entry, Option
from wse_core.fabric.programs.grid import grid
from wse_core.fabric.programs.stencil7 import CENTER, NEIGHBOUR, stencil7_reference, stencil_body, stencil_routes
from wse_core.fabric.run import Result

AR = 8   # first of the six allreduce colors when a program also runs the stencil (colors 0-7)


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
    r^, p, v, s, t; the matrix is applied with ``stencil_body`` (colors 0-7) and every dot product
    is a local FMAC into a stride-0 accumulator followed by ``allreduce_body`` (colors 8-13); every
    PE then computes the same scalars (FDIV on one-word DSDs). Task "init" computes rho = (r^, r)
    and |r|^2; each launch of "iter" is one iteration, ending with the new rho and |r|^2 ("sc" words
    _RHO_NEW and _RR). Returns (program, symbols: dict name -> Symbol)."""
    W, H = width, height
    prog = Program(fabric or Fabric(W, H))
    stencil_routes(prog, W, H)
    allreduce_routes(prog, W, H, AR)
    syms = {}
    for region, nb, px, py in grid(prog, W, H):
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
            return out + allreduce_body(syms["d"], syms["res"], syms["acc"], n, nb, px, py, AR)

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
            *stencil_body(syms["p"], syms["v"], syms["k"], z, nb, px, py),                      # v = A p
            *dots([(syms["rhat"], syms["v"])]),
            ops.FDIV(s1(_ALPHA), s1(_RHO), mem(syms["res"], 0, 1)),                         # alpha = rho / (r^, v)
            ops.FNEG(s1(_NEG), s1(_ALPHA)),
            ops.FMOV(mem(syms["s"]), mem(syms["r"])),
            ops.FMAC(mem(syms["s"]), mem(syms["v"]), sz(_NEG)),                                # s = r - alpha v
            ops.FMAC(mem(syms["x"]), mem(syms["p"]), sz(_ALPHA)),                              # x += alpha p
            *stencil_body(syms["s"], syms["t"], syms["k"], z, nb, px, py),                      # t = A s
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



PROGRAM = Entry("bicgstab", bicgstab, (Option("z", ("z",), int, 32, "points along z in each PE's memory"),
                                       Option("tol", ("tol",), float, 1e-5, "stop when |r| <= TOL |b|"),
                                       Option("max_iter", ("max_iter",), int, 200, "iterations at most")))
