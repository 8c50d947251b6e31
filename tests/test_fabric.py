"""The PE-mesh simulator: results, cycle counts on patterns with a known answer, and program errors."""
import numpy as np
import pytest

from wse_core.fabric import Fabric, FabricError, Program, fin, fout, imm, mem, ops


def stream(n, hops, latency=1, depth=2):
    """PE 0 streams n values east over `hops` hops to a PE that stores them."""
    prog = Program(Fabric(hops + 1, 1, hop_latency=latency, queue_depth=depth))
    src, dst = prog.region(0, 0, 1, 1), prog.region(hops, 0, 1, 1)
    a, b = prog.alloc(src, "a", n), prog.alloc(dst, "b", n)
    prog.route(src, 0, rx=["RAMP"], tx=["E"])
    if hops > 1:
        prog.route(prog.region(1, 0, hops - 1, 1), 0, rx=["W"], tx=["E"])
    prog.route(dst, 0, rx=["W"], tx=["RAMP"])
    prog.task(src, "send", [ops.FMOV(fout(0, n), mem(a))])
    prog.task(dst, "recv", [ops.FMOV(mem(b), fin(0, n))], color=0)
    c = prog.compile()
    c.memcpy_h2d(a, src, np.arange(n) * 0.5)
    c.launch("send")
    r = c.run()
    np.testing.assert_array_equal(c.memcpy_d2h(b, dst).ravel(), np.arange(n, dtype=np.float32) * 0.5)
    return r


@pytest.mark.parametrize("n,hops", [(1, 1), (10, 1), (10, 5), (100, 20)])
def test_stream_of_n_wavelets_over_h_hops(n, hops):
    # Element i leaves the sender's core at cycle i, crosses one router per cycle, reaches the
    # receiver's core queue after h + 1 router steps and is stored one cycle later: n + h + 2 cycles.
    r = stream(n, hops)
    assert r.cycles == n + hops + 2
    assert r.report()["wavelet_hops"] == n * hops and r.busy.sum() == 2 * n and r.stall.sum() == 0


def test_hop_latency_and_queue_depth():
    assert stream(10, 5, latency=3, depth=4).cycles == 10 + 3 * 5 + 2   # deep enough queues: full rate
    assert stream(10, 5, latency=3, depth=2).cycles > 10 + 3 * 5 + 2    # shallow: backpressure slows the stream


def test_row_broadcast_reaches_every_pe():
    w, n = 9, 12
    prog = Program(Fabric(w, 1))
    src, mid, last = prog.region(0, 0, 1, 1), prog.region(1, 0, w - 2, 1), prog.region(w - 1, 0, 1, 1)
    a = prog.alloc(src, "a", n)
    rest = prog.region(1, 0, w - 1, 1)
    b = prog.alloc(rest, "b", n)
    prog.route(src, 0, rx=["RAMP"], tx=["E"])
    prog.route(mid, 0, rx=["W"], tx=["E", "RAMP"])     # multicast: forward and deliver
    prog.route(last, 0, rx=["W"], tx=["RAMP"])
    prog.task(src, "send", [ops.FMOV(fout(0, n), mem(a))])
    prog.task(rest, "recv", [ops.FMOV(mem(b), fin(0, n))], color=0)
    c = prog.compile()
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    c.memcpy_h2d(a, src, x)
    c.launch("send")
    r = c.run()
    np.testing.assert_array_equal(c.memcpy_d2h(b, rest), np.broadcast_to(x, (1, w - 1, n)))
    assert r.cycles == n + (w - 1) + 2
    assert r.report()["ramp_deliveries"] == n * (w - 1)


def test_reduce_chain_sums_in_order_with_three_cycles_per_hop():
    w, n = 6, 16
    prog = Program(Fabric(w, 1))
    x = {}
    for q in range(w):
        pe = prog.region(q, 0, 1, 1)
        x[q] = prog.alloc(pe, "x", n)
        if q > 0:
            prog.route(pe, q % 2, rx=["RAMP"], tx=["W"])
        if q < w - 1:
            prog.route(pe, (q + 1) % 2, rx=["E"], tx=["RAMP"])
        if q == w - 1:
            prog.task(pe, "start", [ops.FMOV(fout(q % 2, n), mem(x[q]))])
        elif q > 0:
            prog.task(pe, "add", [ops.FADD(fout(q % 2, n), fin((q + 1) % 2, n), mem(x[q]))], color=(q + 1) % 2)
        else:
            out = prog.alloc(pe, "out", n)
            prog.task(pe, "add", [ops.FADD(mem(out), fin(1, n), mem(x[q]))], color=1)
    c = prog.compile()
    vals = np.random.default_rng(1).standard_normal((w, n)).astype(np.float32)
    for q in range(w):
        c.memcpy_h2d(x[q], prog.region(q, 0, 1, 1), vals[q])
    c.launch("start")
    r = c.run()
    expect = vals[w - 1].copy()
    for q in range(w - 2, -1, -1):
        expect = expect + vals[q]          # float32, east to west: the order the chain adds in
    np.testing.assert_array_equal(c.memcpy_d2h(out, prog.region(0, 0, 1, 1)).ravel(), expect)
    # Per hop: router step, ramp into the core, the core's add; the first element reaches PE 0 at
    # cycle 3 (w - 1), the last n - 1 cycles later.
    assert r.cycles == 3 * (w - 1) + n
    again = prog.compile()
    for q in range(w):
        again.memcpy_h2d(x[q], prog.region(q, 0, 1, 1), vals[q])
    again.launch("start")
    assert again.run().cycles == r.cycles   # same inputs, same cycle count


def test_a_task_waiting_forever_is_a_deadlock_named_by_pe():
    prog = Program(Fabric(3, 1))
    src, dst = prog.region(0, 0, 1, 1), prog.region(2, 0, 1, 1)
    a, b = prog.alloc(src, "a", 5), prog.alloc(dst, "b", 10)
    prog.route(src, 3, rx=["RAMP"], tx=["E"])
    prog.route(prog.region(1, 0, 1, 1), 3, rx=["W"], tx=["E"])
    prog.route(dst, 3, rx=["W"], tx=["RAMP"])
    prog.task(src, "send", [ops.FMOV(fout(3, 5), mem(a))])
    prog.task(dst, "recv", [ops.FMOV(mem(b), fin(3, 10))], color=3)   # expects 10, gets 5
    c = prog.compile()
    c.launch("send")
    with pytest.raises(FabricError, match=r"deadlock at cycle \d+: PE \(2, 0\) task 'recv' waits forever"):
        c.run()


def test_program_errors_name_the_pe():
    prog = Program(Fabric(4, 2))
    prog.route(prog.region(3, 0, 1, 1), 0, rx=["RAMP"], tx=["E"])
    with pytest.raises(FabricError, match=r"PE \(3, 0\) color 0: routes E off the edge of the fabric"):
        prog.compile()
    prog = Program(Fabric(4, 2))
    prog.route(prog.region(0, 0, 1, 1), 0, rx=["RAMP"], tx=["S"])
    with pytest.raises(FabricError, match=r"PE \(0, 0\) color 0: routes S to PE \(0, 1\), whose route for color 0 "
                                          r"does not accept N"):
        prog.compile()
    prog = Program(Fabric(4, 2))
    prog.route(prog.region(0, 0, 2, 1), 1, rx=["W"], tx=["E"])
    with pytest.raises(FabricError, match=r"PE \(1, 0\) color 1: routed twice in conflicting ways"):
        prog.route(prog.region(1, 0, 1, 1), 1, rx=["N"], tx=["E"])
    prog = Program(Fabric(4, 2))
    r = prog.region(0, 0, 2, 2)
    prog.alloc(r, "big", 10000)
    with pytest.raises(FabricError, match="more than the 49152 bytes of a PE's memory"):
        prog.alloc(r, "more", 3000)
    with pytest.raises(FabricError, match=r"region \(3, 1, 2, 1\): outside the 4 x 2 fabric"):
        prog.region(3, 1, 2, 1)


def test_unread_wavelets_are_reported():
    prog = Program(Fabric(2, 1))
    src, dst = prog.region(0, 0, 1, 1), prog.region(1, 0, 1, 1)
    a = prog.alloc(src, "a", 1)
    prog.alloc(dst, "b", 1)
    prog.route(src, 2, rx=["RAMP"], tx=["E"])
    prog.route(dst, 2, rx=["W"], tx=["RAMP"])
    prog.task(src, "send", [ops.FMOV(fout(2, 1), mem(a))])
    c = prog.compile()
    c.launch("send")
    with pytest.raises(FabricError, match=r"PE \(1, 0\): 1 wavelet\(s\) of color 2 reached the core and no task reads them"):
        c.run()


@pytest.mark.parametrize("w,h,z", [(1, 1, 4), (2, 3, 5), (5, 4, 8), (7, 6, 1), (12, 9, 16)])
def test_stencil7_matches_numpy(w, h, z):
    from wse_core.fabric.programs.stencil7 import stencil7

    v, ref, r = stencil7(w, h, z, seed=w * h)
    np.testing.assert_allclose(v, ref, rtol=0, atol=1e-5)
    assert r.cycles > 0 and r.busy.shape == (h, w)
    v2, _, r2 = stencil7(w, h, z, seed=w * h)
    assert r2.cycles == r.cycles and v2.tobytes() == v.tobytes()


def test_broadcast_kernel_and_cli(tmp_path):
    import json
    import subprocess
    import sys

    from wse_core.fabric.programs.broadcast import broadcast

    got, expected, r = broadcast(9, 4, 12)
    np.testing.assert_array_equal(got, expected)
    assert r.cycles == 12 + 8 + 2
    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "fabric", "run", "stencil7", "--width", "6",
                           "--height", "5", "--z", "8", "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["max_abs_error"] < 1e-5 and rep["cycles"] > 0 and rep["cycles_per_point"] == rep["cycles"] / 8
    proc = subprocess.run([sys.executable, "-m", "pyapi.cli", "fabric", "run", "stencil7", "--width", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == "wse fabric: error: Fabric.width: expected a positive integer, got 0"


@pytest.mark.parametrize("w,h", [(1, 1), (2, 1), (1, 2), (3, 2), (4, 5), (7, 6)])
def test_allreduce_gives_every_pe_the_sum(w, h):
    from wse_core.fabric.programs.allreduce import allreduce, allreduce_reference

    got, ref, r = allreduce(w, h, 8, seed=1)
    x = np.random.default_rng(1).standard_normal((h, w, 8)).astype(np.float32)
    np.testing.assert_array_equal(got, np.broadcast_to(allreduce_reference(x), (h, w, 8)))  # the mesh's order, exactly
    np.testing.assert_allclose(got[0, 0], ref, atol=1e-5)


@pytest.mark.parametrize("w,h,b,c", [(1, 1, 4, 3), (2, 1, 4, 3), (3, 2, 5, 4), (8, 6, 16, 8)])
def test_gemv_on_a_checkerboard_matches_numpy(w, h, b, c):
    from wse_core.fabric.programs.gemv import gemv

    got, ref, r = gemv(w, h, b, c, seed=2)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.sqrt(w * c))
    # Local products take c FMACs of b elements; the row reduce adds about 3 cycles per hop.
    assert r.cycles >= b * c + 3 * (w - 1)


def test_indexed_dsd_gathers_and_scatter_adds_in_element_order():
    n, m = 12, 5
    prog = Program(Fabric(1, 1))
    pe = prog.region(0, 0, 1, 1)
    x = prog.alloc(pe, "x", m)
    y = prog.alloc(pe, "y", m)
    a = prog.alloc(pe, "a", n)
    gi = prog.alloc(pe, "gi", n, dtype="int32")
    si = prog.alloc(pe, "si", n, dtype="int32")
    prog.task(pe, "start", [ops.FMAC(mem(y, index=mem(si)), mem(a), mem(x, index=mem(gi)))])
    c = prog.compile()
    rng = np.random.default_rng(4)
    xv, av = rng.standard_normal(m).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    g, s = rng.integers(0, m, n), rng.integers(0, m, n)      # repeated indices on both sides
    for sym, v in ((x, xv), (a, av), (gi, g), (si, s)):
        c.memcpy_h2d(sym, pe, v)
    c.launch("start")
    assert c.run().cycles == n
    expect = np.zeros(m, np.float32)
    for k in range(n):
        expect[s[k]] = expect[s[k]] + av[k] * xv[g[k]]
    np.testing.assert_array_equal(c.memcpy_d2h(y, pe).ravel(), expect)
    np.testing.assert_array_equal(c.memcpy_d2h(gi, pe).ravel(), g)     # int32 words read back as written
    c.memcpy_h2d(gi, pe, np.r_[g[:-1], m])                             # one index past the end of x
    c.launch("start")
    with pytest.raises(FabricError, match=r"^PE \(0, 0\): index 5 \(element 11\) is outside the 5 words it indexes$"):
        c.run()
    with pytest.raises(FabricError, match="symbol 'gi' is int32, got float"):
        c.memcpy_h2d(gi, pe, np.zeros(n))
    with pytest.raises(FabricError, match="expected a memory DSD of an int32 symbol"):
        mem(x, index=mem(a))
    prog.task(pe, "bad", [ops.FMOV(mem(x), mem(gi, 0, m))])
    with pytest.raises(FabricError, match="symbol 'gi' is int32; use it as the index= of a memory DSD"):
        prog.compile()


def test_fdiv_and_scalar_operands():
    prog = Program(Fabric(1, 1))
    pe = prog.region(0, 0, 1, 1)
    a = prog.alloc(pe, "a", 4)
    q = prog.alloc(pe, "q", 4)
    prog.task(pe, "start", [ops.FDIV(mem(q), imm(1.0), mem(a)), ops.FDIV(mem(q, 3, 1), mem(a, 0, 1), mem(a, 1, 1))])
    c = prog.compile()
    c.memcpy_h2d(a, pe, np.array([3.0, 0.0, -2.0, 7.0], np.float32))
    c.launch("start")
    c.run()
    with np.errstate(divide="ignore"):
        expect = np.float32(1) / np.array([3.0, 0.0, -2.0], np.float32)
    np.testing.assert_array_equal(c.memcpy_d2h(q, pe).ravel(), np.r_[expect, np.float32(np.inf)])


@pytest.mark.parametrize("w,h,b,c,density", [(1, 1, 4, 3, 0.5), (3, 2, 5, 4, 0.2), (8, 6, 16, 8, 0.1), (4, 4, 6, 6, 0.0)])
def test_spmv_on_a_checkerboard_matches_numpy(w, h, b, c, density):
    from wse_core.fabric.programs.spmv import spmv

    got, ref, r = spmv(w, h, b, c, density, seed=5)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.sqrt(w * c))
    assert r.extra["nnz"] <= r.extra["slots_per_pe"] * w * h
    # One FMAC per padded nonzero slot, then the row reduce.
    assert r.cycles >= r.extra["slots_per_pe"] + 3 * (w - 1)


@pytest.mark.parametrize("w,h,z", [(1, 1, 6), (3, 2, 5), (8, 6, 12)])
def test_bicgstab_on_the_mesh_reaches_the_scipy_residual(w, h, z):
    sp = pytest.importorskip("scipy.sparse")
    from scipy.sparse.linalg import bicgstab as scipy_bicgstab

    from wse_core.fabric.programs.bicgstab import bicgstab
    from wse_core.fabric.programs.stencil7 import stencil7_reference

    x, x_np, r = bicgstab(w, h, z, tol=1e-5, seed=6)

    def lap(n):
        return sp.diags([-np.ones(n - 1), -np.ones(n - 1)], [-1, 1])

    A = (6 * sp.identity(w * h * z) + sp.kronsum(sp.kronsum(lap(w), lap(h)), lap(z))).tocsr()   # x fastest
    b = np.random.default_rng(6).standard_normal((z, h, w)).astype(np.float32).astype(np.float64)
    xs, info = scipy_bicgstab(A, b.ravel(), rtol=1e-5)
    scipy_res = np.linalg.norm(b.ravel() - A @ xs) / np.linalg.norm(b)
    assert info == 0 and r.extra["converged"]
    np.testing.assert_allclose(A @ x.astype(np.float64).ravel(), stencil7_reference(x).ravel(), atol=1e-9)
    assert r.extra["relative_residual"] <= max(2 * scipy_res, 1.2e-5)
    np.testing.assert_allclose(x, xs.reshape(z, h, w), atol=1e-4 * np.abs(xs).max())
    np.testing.assert_allclose(x, x_np, atol=1e-4 * np.abs(x_np).max())
    # Every iteration runs the same instructions on the same routes: the same cycles each time.
    assert r.extra["cycles_per_iteration_spread"] == 0 and r.extra["cycles_per_iteration"] > 2 * 7 * z
    if min(w, h) >= 3:   # two stencils, the vector work, three allreduces at 4 cycles per hop (README)
        assert r.extra["cycles_per_iteration"] == 28 * z + 12 * (w + h) + 14
    x2, _, r2 = bicgstab(w, h, z, tol=1e-5, seed=6)
    assert x2.tobytes() == x.tobytes() and r2.cycles == r.cycles


def test_memory_only_instructions_take_one_cycle_per_element_even_when_run_at_once():
    n = 12
    prog = Program(Fabric(2, 1))
    src, dst = prog.region(0, 0, 1, 1), prog.region(1, 0, 1, 1)
    u = prog.alloc(src, "u", n)
    w = prog.alloc(src, "w", n)
    b = prog.alloc(dst, "b", n)
    prog.route(src, 0, rx=["RAMP"], tx=["E"])
    prog.route(dst, 0, rx=["W"], tx=["RAMP"])
    # The send reads u while the task updates u: the engine must go element by element here
    # (each element is sent before the task changes it). FMUL on w touches nothing the send
    # reads, so it may run at once; either way it costs n cycles.
    prog.task(src, "start", [ops.FMOV(fout(0, n), mem(u)).asynchronous(), ops.FADD(mem(u), mem(u), imm(1.0)),
                             ops.FMUL(mem(w), mem(w), imm(2.0))])
    prog.task(dst, "recv", [ops.FMOV(mem(b), fin(0, n))], color=0)
    uv = np.arange(n, dtype=np.float32)
    c = prog.compile()
    c.memcpy_h2d(u, src, uv)
    c.memcpy_h2d(w, src, uv)
    c.launch("start")
    r = c.run()
    np.testing.assert_array_equal(c.memcpy_d2h(b, dst).ravel(), uv)          # sent before each update
    np.testing.assert_array_equal(c.memcpy_d2h(u, src).ravel(), uv + 1)
    np.testing.assert_array_equal(c.memcpy_d2h(w, src).ravel(), 2 * uv)
    # Cycle 0 hands the send off; FADD runs in cycles 1..n, FMUL n+1..2n; the last wavelet
    # (sent at cycle n) is stored by the receiver 3 cycles later.
    assert r.cycles == 2 * n + 1 and r.busy[0, 0] == 3 * n + 1


def test_a_task_waiting_on_its_input_counts_one_stall_per_cycle():
    # The receiver's task starts at cycle 0 and waits for the stream: the engine lets it sleep
    # until its router delivers, and must still count a stall for every cycle it waited.
    n, hops = 6, 4
    prog = Program(Fabric(hops + 1, 1))
    src, dst = prog.region(0, 0, 1, 1), prog.region(hops, 0, 1, 1)
    a, b = prog.alloc(src, "a", n), prog.alloc(dst, "b", n)
    prog.route(src, 0, rx=["RAMP"], tx=["E"])
    prog.route(prog.region(1, 0, hops - 1, 1), 0, rx=["W"], tx=["E"])
    prog.route(dst, 0, rx=["W"], tx=["RAMP"])
    prog.task(src, "start", [ops.FMOV(fout(0, n), mem(a))])
    prog.task(dst, "start", [ops.FMOV(mem(b), fin(0, n))])
    c = prog.compile()
    c.memcpy_h2d(a, src, np.arange(n))
    c.launch("start")
    r = c.run()
    np.testing.assert_array_equal(c.memcpy_d2h(b, dst).ravel(), np.arange(n))
    # The first wavelet reaches the receiver's queue at cycle hops + 1 and may be read at hops + 2.
    assert r.cycles == n + hops + 2 and r.stall[0, hops] == hops + 2 and r.stall.sum() == hops + 2


@pytest.mark.parametrize("piece", [1, 3, 10**6])
def test_stepping_the_engine_in_pieces_gives_the_run_of_one_call(piece):
    """Engine.step(n) piece by piece ends with the cycles, counters and memory of Compiled.run()."""
    from wse_core.fabric.engine import Outcome
    from wse_core.fabric.programs.stencil7 import CENTER, NEIGHBOUR, stencil7_program

    def compiled():
        prog, u, v, k = stencil7_program(5, 4, 6)
        c, full = prog.compile(), prog.region(0, 0, 5, 4)
        c.memcpy_h2d(u, full, np.random.default_rng(0).standard_normal((4, 5, 6)))
        c.memcpy_h2d(k, full, np.array([CENTER, NEIGHBOUR], np.float32))
        c.launch("start")
        return c, v, full

    c, v, full = compiled()
    r = c.run()
    s, sv, _ = compiled()
    engine = s.engine()
    outcomes = [engine.step(piece)]
    while outcomes[-1] is Outcome.RUNNING:
        outcomes.append(engine.step(piece))
    assert outcomes[-1] is Outcome.DONE and engine.step(1) is Outcome.DONE and engine.cycles == r.cycles
    assert len(outcomes) == r.cycles // piece + 1
    np.testing.assert_array_equal(engine.busy.reshape(4, 5), r.busy)
    np.testing.assert_array_equal(engine.stall.reshape(4, 5), r.stall)
    np.testing.assert_array_equal(engine.link.reshape(4, 5, 5), r.link)
    np.testing.assert_array_equal(s.memcpy_d2h(sv, full), c.memcpy_d2h(v, full))


def test_run_names_its_outcome():
    """A run that hits max_cycles ends as Outcome.CYCLE_LIMIT and can be stepped on to its end."""
    from wse_core.fabric.engine import Outcome

    prog = Program(Fabric(1, 1))
    pe = prog.region(0, 0, 1, 1)
    a = prog.alloc(pe, "a", 8)
    prog.task(pe, "t", [ops.FNEG(mem(a), mem(a)), ops.FADD(mem(a, 0, 1), mem(a, 1, 1), mem(a, 2, 1))])
    c = prog.compile()
    c.launch("t")
    engine = c.engine()
    assert engine.run(max_cycles=1) is Outcome.CYCLE_LIMIT and engine.cycles == 1
    assert engine.run() is Outcome.DONE and Outcome.DONE.is_terminal() and not Outcome.RUNNING.is_terminal()
