"""The PE-mesh simulator's speed: simulated PE-cycles per wall second for the stencil, GEMV and a broadcast.

    wse bench fabric [--json PATH] [--sizes 64x64,256x256,750x994] [--z 64] [--tile 16]

For each fabric size: one 7-point stencil application (Z points per PE, the SC20 mapping), one
GEMV with a TILE x TILE tile of A per PE (a 12k x 16k matrix on the full wafer), and one row
broadcast of Z values, each checked against numpy. PE-cycles/s = width x height x simulated
cycles / wall seconds of the engine's run (compile and host copies reported apart). The numpy
evaluation of the same stencil, in the same run, is the baseline: what one stencil costs when
nothing is simulated. 750 x 994 is the WSE-2's usable program rectangle.
"""
import time

import numpy as np

from bench.harness import machine, table


def add_arguments(parser):
    parser.add_argument("--sizes", default="64x64,256x256,750x994", help="comma-separated WxH fabric sizes")
    parser.add_argument("--z", type=int, default=64, help="stencil points per PE (and broadcast length)")
    parser.add_argument("--tile", type=int, default=16, help="GEMV tile of A per PE (TILE x TILE)")


def _sizes(text):
    out = []
    for part in str(text).split(","):
        w, _, h = part.partition("x")
        if not (w.isdigit() and h.isdigit()) or int(w) < 1 or int(h) < 1:
            raise ValueError(f"--sizes: expected WxH with positive integers, got {part!r}")
        out.append((int(w), int(h)))
    return out


def _stencil(w, h, z):
    from wse_core.fabric.kernels import stencil7_program, stencil7_reference

    t0 = time.perf_counter()
    prog, u_sym, v_sym, k_sym = stencil7_program(w, h, z)
    c = prog.compile()
    full = prog.region(0, 0, w, h)
    u = np.random.default_rng(0).standard_normal((z, h, w)).astype(np.float32)
    c.memcpy_h2d(u_sym, full, u.transpose(1, 2, 0))
    c.memcpy_h2d(k_sym, full, np.array([6.0, -1.0], np.float32))
    c.launch("start")
    t1 = time.perf_counter()
    r = c.run()
    t2 = time.perf_counter()
    v = c.memcpy_d2h(v_sym, full).transpose(2, 0, 1)
    t3 = time.perf_counter()
    ref = stencil7_reference(u)
    t4 = time.perf_counter()
    return {"cycles": r.cycles, "run_seconds": t2 - t1, "setup_seconds": t1 - t0 + t3 - t2,
            "numpy_seconds": t4 - t3, "max_abs_error": float(np.abs(v - ref).max()),
            "pe_cycles_per_second": w * h * r.cycles / (t2 - t1), "cycles_per_point": r.cycles / z,
            **r.report()}


def run(args):
    from wse_core.fabric.kernels import broadcast, gemv

    if args.z < 1:
        raise ValueError(f"--z must be >= 1, got {args.z}")
    result = {"benchmark": "fabric", "machine": machine(), "z": args.z, "rows": []}
    for w, h in _sizes(args.sizes):
        row = {"width": w, "height": h, "stencil7": _stencil(w, h, args.z)}
        t0 = time.perf_counter()
        got, expected, r = broadcast(w, h, args.z)
        wall = time.perf_counter() - t0
        row["broadcast"] = {"cycles": r.cycles, "seconds_with_setup": wall, "correct": bool(np.array_equal(got, expected)),
                            "pe_cycles_per_second": w * h * r.cycles / wall}
        t0 = time.perf_counter()
        y, ref, r = gemv(w, h, args.tile, args.tile)
        wall = time.perf_counter() - t0
        row["gemv"] = {"cycles": r.cycles, "seconds_with_setup": wall, "pe_cycles_per_second": w * h * r.cycles / wall,
                       "max_rel_error": float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30))}
        result["rows"].append(row)
    return result


def report(result):
    m = result["machine"]
    rows = []
    for row in result["rows"]:
        s, b, g = row["stencil7"], row["broadcast"], row["gemv"]
        rows.append([f"{row['width']}x{row['height']}", s["cycles"], f"{s['cycles_per_point']:.2f}",
                     f"{s['run_seconds']:.2f}", f"{s['pe_cycles_per_second']:.3g}", f"{s['max_abs_error']:.1e}",
                     f"{s['numpy_seconds'] * 1e3:.1f}", g["cycles"], f"{g['pe_cycles_per_second']:.3g}",
                     f"{g['max_rel_error']:.1e}", b["cycles"], f"{b['pe_cycles_per_second']:.3g}",
                     "yes" if b["correct"] else "NO"])
    return "\n".join([
        f"PE-mesh simulator, Z = {result['z']}; {m['cpu']}, {m['cores']} cores (the engine runs on one)",
        table(rows, ["fabric", "stencil cycles", "cycles/point", "run s", "PE-cycles/s", "max err", "numpy ms",
                     "gemv cycles", "gemv PE-cycles/s", "gemv rel err", "bcast cycles", "bcast PE-cycles/s",
                     "bcast ok"]),
        "PE-cycles/s of gemv and broadcast include building and compiling the program.",
    ])
