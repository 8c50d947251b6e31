"""``broadcast``: column 0 multicasts a vector along its row, every PE of the row storing it."""
import numpy as np

from wse_core.fabric.isa import fin, fout, mem, ops
from wse_core.fabric.program import Fabric, Program
from wse_core.fabric.programs.entry import Entry, Option


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



PROGRAM = Entry("broadcast", broadcast, (Option("n", ("n",), int, 64, "vector length"),))
