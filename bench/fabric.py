"""The PE-mesh simulator's speed, and BiCGSTAB cycles per iteration next to the SC20 figures.

    wse bench fabric [--json PATH] [--sizes 64x64,256x256,750x994] [--z 64] [--tile 16]
                     [--bicgstab_max_pes 65536]

For each fabric size: one 7-point stencil application (Z points per PE, the SC20 mapping), one
GEMV and one SpMV (10% dense) with a TILE x TILE tile of A per PE, each checked against numpy,
and (up to --bicgstab_max_pes PEs) two BiCGSTAB iterations for the stencil system. PE-cycles/s =
width x height x simulated cycles / wall seconds of the engine's run (building, compiling and
host copies excluded). The baseline is numpy computing the same stencil in the same run: what one
application costs when nothing is simulated. 750 x 994 is the WSE-2's usable program rectangle.

Cycles per BiCGSTAB iteration do not depend on the data (the same instructions run on the same
routes every iteration), and grow as a Z + b (W + H) + c: Z for the vector work on each PE's
column, W + H for the allreduce latency. The benchmark fits a, b, c on small meshes, checks the
fit on a fourth, and predicts an iteration on the SC20 paper's 600 x 595 x 1536 mesh.

It also calibrates the simulated-time model (wse_core.perf.calibration): the weight-streaming GEMM,
the mesh allreduce, and the GEMV and broadcast that decode runs on (perf.inference), on small
rectangles, each formula fitted and checked on sizes the fit did not see, and prints the fitted
constants next to those the model uses.
"""
import time

import numpy as np

from bench.harness import machine, table
from wse_core.errors import ConfigError

# One BiCGSTAB iteration per mesh point: two stencils (13 flops each), five dot products (2 each),
# the p, s, x and r updates (4 + 2 + 4 + 2): see wse_core.fabric.programs.bicgstab.bicgstab_program.
FLOPS_PER_POINT = 2 * 13 + 5 * 2 + 12
SC20 = {"width": 600, "height": 595, "z": 1536, "pflops": 0.86}
FIT_MESHES = [(8, 8, 32), (8, 8, 96), (24, 16, 32)]
CHECK_MESH = (16, 20, 64)


def add_arguments(parser):
    parser.add_argument("--sizes", default="64x64,256x256,750x994", help="comma-separated WxH fabric sizes")
    parser.add_argument("--z", type=int, default=64, help="stencil and BiCGSTAB points per PE")
    parser.add_argument("--tile", type=int, default=16, help="GEMV/SpMV tile of A per PE (TILE x TILE)")
    parser.add_argument("--bicgstab_max_pes", type=int, default=256 * 256,
                        help="run BiCGSTAB iterations on fabrics of at most this many PEs")


def _sizes(text):
    out = []
    for part in str(text).split(","):
        w, _, h = part.partition("x")
        if not (w.isdigit() and h.isdigit()) or int(w) < 1 or int(h) < 1:
            raise ConfigError(f"--sizes: expected WxH with positive integers, got {part!r}")
        out.append((int(w), int(h)))
    return out


def _speed(r, **more):
    return {"cycles": r.cycles, "engine_seconds": r.seconds, "pe_cycles_per_second": r.pe_cycles_per_second, **more}


def _stencil(w, h, z):
    from wse_core.fabric.programs.stencil7 import stencil7, stencil7_reference

    v, ref, r = stencil7(w, h, z)
    u = np.random.default_rng(0).standard_normal((z, h, w)).astype(np.float32)   # stencil7's input, seed 0
    t0 = time.perf_counter()
    stencil7_reference(u)
    numpy_seconds = time.perf_counter() - t0
    return _speed(r, max_abs_error=float(np.abs(v - ref).max()), numpy_seconds=numpy_seconds,
                  cycles_per_point=r.cycles / z, stalls=int(r.stall.sum()))


def _iteration_cycles(w, h, z):
    from wse_core.fabric.programs.bicgstab import bicgstab

    _, _, r = bicgstab(w, h, z, max_iter=1)
    return r.extra["cycles_per_iteration"]


def sc20_model():
    """Fit cycles per iteration = a Z + b (W + H) + c on FIT_MESHES, check it on CHECK_MESH, predict SC20's mesh."""
    X = np.array([[z, w + h, 1.0] for w, h, z in FIT_MESHES])
    y = np.array([_iteration_cycles(*m) for m in FIT_MESHES], np.float64)
    a, b, c = np.linalg.solve(X, y)
    w, h, z = CHECK_MESH
    measured = _iteration_cycles(w, h, z)
    predicted = a * z + b * (w + h) + c
    sc = a * SC20["z"] + b * (SC20["width"] + SC20["height"]) + c
    return {"a_per_z": a, "b_per_w_plus_h": b, "c": c, "check_mesh": list(CHECK_MESH), "check_measured": measured,
            "check_predicted": predicted, "sc20_cycles_per_iteration": sc,
            "sc20_flops_per_pe_cycle": FLOPS_PER_POINT * SC20["z"] / sc}


def run(args):
    from wse_core.fabric.programs.bicgstab import bicgstab
    from wse_core.fabric.programs.gemv import gemv
    from wse_core.fabric.programs.spmv import spmv

    if args.z < 1 or args.tile < 1:
        raise ConfigError(f"--z and --tile must be >= 1, got {args.z} and {args.tile}")
    result = {"benchmark": "fabric", "machine": machine(), "z": args.z, "tile": args.tile, "rows": [],
              "flops_per_point_per_iteration": FLOPS_PER_POINT}
    for w, h in _sizes(args.sizes):
        row = {"width": w, "height": h, "stencil7": _stencil(w, h, args.z)}
        y, ref, r = gemv(w, h, args.tile, args.tile)
        row["gemv"] = _speed(r, max_rel_error=float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)))
        y, ref, r = spmv(w, h, args.tile, args.tile, 0.1)
        row["spmv"] = _speed(r, max_rel_error=float(np.abs(y - ref).max() / max(np.abs(ref).max(), 1e-30)),
                             padding=r.extra["padding"])
        if w * h <= args.bicgstab_max_pes:
            _, _, r = bicgstab(w, h, args.z, max_iter=2)
            per = r.extra["cycles_per_iteration"]
            row["bicgstab"] = _speed(r, cycles_per_iteration=per,
                                     flops_per_pe_cycle=FLOPS_PER_POINT * args.z / per)
        result["rows"].append(row)
    result["sc20_model"] = sc20_model()
    from wse_core.perf.calibration import calibrate

    result["calibration"] = calibrate()
    return result


def report(result):
    m = result["machine"]
    rows = []
    for row in result["rows"]:
        s, g, sp, b = row["stencil7"], row["gemv"], row["spmv"], row.get("bicgstab")
        rows.append([f"{row['width']}x{row['height']}", s["cycles"], f"{s['cycles_per_point']:.2f}",
                     f"{s['engine_seconds']:.2f}", f"{s['pe_cycles_per_second']:.3g}", f"{s['max_abs_error']:.1e}",
                     f"{s['numpy_seconds'] * 1e3:.1f}", g["cycles"], f"{g['pe_cycles_per_second']:.3g}",
                     f"{g['max_rel_error']:.1e}", sp["cycles"], f"{sp['pe_cycles_per_second']:.3g}",
                     b["cycles_per_iteration"] if b else "-", f"{b['pe_cycles_per_second']:.3g}" if b else "-"])
    sc = result["sc20_model"]
    return "\n".join([
        f"PE-mesh simulator, Z = {result['z']}, tile {result['tile']}; {m['cpu']}, {m['cores']} cores",
        table(rows, ["fabric", "stencil cycles", "cycles/point", "engine s", "PE-cycles/s", "max err", "numpy ms",
                     "gemv cycles", "gemv PE-cycles/s", "gemv rel err", "spmv cycles", "spmv PE-cycles/s",
                     "bicgstab cycles/iter", "bicgstab PE-cycles/s"]),
        f"BiCGSTAB cycles per iteration = {sc['a_per_z']:.2f} Z + {sc['b_per_w_plus_h']:.2f} (W + H) + "
        f"{sc['c']:.0f} (fit on {len(FIT_MESHES)} meshes; on {'x'.join(map(str, sc['check_mesh']))} it predicts "
        f"{sc['check_predicted']:.0f}, measured {sc['check_measured']})",
        f"On SC20's 600 x 595 x 1536 mesh: {sc['sc20_cycles_per_iteration']:.0f} cycles per iteration, "
        f"{sc['sc20_flops_per_pe_cycle']:.2f} flops per PE-cycle ({result['flops_per_point_per_iteration']} flops "
        "per point); SC20 measured 0.86 PFLOPS, about a third of the machine's peak.",
        *_calibration_report(result["calibration"]),
    ])


def _calibration_report(cal):
    from wse_core.perf.calibration import ALLREDUCE_COEF, BROADCAST_COEF, GEMM_COEF, GEMV_COEF

    g, a, v, bc = cal["gemm"], cal["allreduce"], cal["gemv"], cal["broadcast"]
    lines = ["Simulated-time calibration (fit on {} sizes, checked on sizes not in the fit):".format(
        " + ".join(str(len(x["fit_sizes"])) for x in (g, a, v, bc)))]
    a1, a2, b, c, d = g["coef"]
    lines.append(f"  stream GEMM cycles = {a1:.4f} kb n mb + {a2:.4f} kb n + {b:.4f} mb n + {c:.3f} (W + H) "
                 f"{d:+.2f}   (model uses {', '.join(f'{x:g}' for x in GEMM_COEF)})")
    e, f, g0 = a["coef"]
    lines.append(f"  mesh allreduce cycles = {e:.3f} n + {f:.3f} (W + H) {g0:+.2f}   (model uses "
                 f"{', '.join(f'{x:g}' for x in ALLREDUCE_COEF)})")
    p1, p2, p3, p4, p5 = v["coef"]
    lines.append(f"  gemv cycles = {p1:.3f} b c + {p2:.3f} b + {p3:.3f} W + {p4:.3f} H {p5:+.2f}   (model uses "
                 f"{', '.join(f'{x:g}' for x in GEMV_COEF)})")
    q1, q2, q3 = bc["coef"]
    lines.append(f"  broadcast cycles = {q1:.3f} n + {q2:.3f} W {q3:+.2f}   (model uses "
                 f"{', '.join(f'{x:g}' for x in BROADCAST_COEF)})")
    rows = [[name, "x".join(map(str, r["size"])), r["cycles"], f"{r['predicted']:.0f}", f"{r['error']:+.2%}"]
            for name in ("gemm", "allreduce", "gemv", "broadcast") for r in cal[name]["check"]]
    lines.append(table(rows, ["program", "held-out size (W x H x ...)", "simulator cycles", "model", "error"]))
    return lines
