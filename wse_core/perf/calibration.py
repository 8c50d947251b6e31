"""The compute model's constants, fitted to the fabric simulator's cycles and checked on sizes the
fit did not see (docs/design/time-model.md "Calibration").

GEMM (``wse_core.fabric.programs.stream_gemm``: X resident, W's rows streaming in from the west
edge and multicast along the PE rows, partial sums reduced northward) on a W x H rectangle with
``mb`` tokens and ``kb`` weight rows per PE and n output columns:

    cycles = a1 kb n mb + a2 kb n + b mb n + c (W + H) + d

a1: one FMAC element per cycle; a2: storing each arriving weight row; b: the reduce, one element
per cycle; c: hops to the far corner; d: start-up. Mesh allreduce (``allreduce``, a vector of n per
PE, rows west, column 0 north, and the sum broadcast back):

    cycles = e n + f (W + H) + g

which has the form of the published near-optimal wafer reduce, T = max(C, E/N + L) + (2 T_R + 1) D,
with its bandwidth term E/N here e n (this chain pays four passes of n: row, column, and the two
broadcasts, where the optimal reduce overlaps them) and its depth term D = W + H.

Decode (``perf.inference``) keeps the weights on the wafer and multiplies them by one activation
vector per sequence: ``gemv`` (A's tile [b rows, c columns] resident on each PE of a W x H
checkerboard, one FMAC per tile column, the partial y tiles summed westward along each row):

    cycles = p1 b c + p2 b + p3 W + p4 H + p5

p1: the tile's FMACs; p2: the last partial tile into column 0; p3: the reduce's three cycles a hop
(receive, add, send); p4: rows never talk, so the fit finds 0; p5: start-up. The vector x reaches
its columns as ``broadcast`` carries it (column 0 multicasting n values along its row):

    cycles = q1 n + q2 W + q3

q1: one wavelet a cycle; q2: one cycle a hop; q3: start-up.

The constants below are what ``calibrate()`` fits (``wse bench fabric`` prints the fit and the
check; a test fits again and holds both to these values and to 10% on the held-out sizes).
"""
import numpy as np

#: (W, H, mb, kb, n) the GEMM constants are fitted on, and the held-out sizes they are checked on.
GEMM_FIT = [(2, 2, 2, 4, 16), (4, 2, 4, 8, 32), (2, 4, 8, 4, 64), (6, 3, 2, 16, 32), (3, 6, 6, 6, 48),
            (8, 8, 4, 8, 16), (2, 3, 1, 12, 40), (5, 2, 12, 2, 24)]
GEMM_CHECK = [(12, 10, 8, 12, 40), (5, 16, 3, 20, 24), (16, 4, 12, 6, 96), (24, 24, 6, 10, 32)]
#: (W, H, n) for the allreduce.
ALLREDUCE_FIT = [(2, 2, 16), (4, 4, 32), (8, 2, 64), (3, 7, 16)]
ALLREDUCE_CHECK = [(10, 12, 48), (16, 3, 100), (20, 20, 8)]
#: (W, H, b, c) for the GEMV: W >= 2, since one column has no reduce (its cycles are b c alone).
GEMV_FIT = [(2, 2, 4, 4), (4, 2, 8, 4), (2, 5, 4, 8), (6, 3, 5, 7), (3, 6, 12, 2), (8, 8, 2, 16), (5, 2, 16, 3),
            (2, 3, 1, 12)]
GEMV_CHECK = [(12, 10, 8, 12), (5, 16, 20, 6), (16, 4, 6, 24), (24, 24, 10, 10)]
#: (W, H, n) for the broadcast.
BROADCAST_FIT = [(2, 2, 16), (4, 1, 32), (8, 3, 8), (3, 5, 64)]
BROADCAST_CHECK = [(10, 12, 48), (16, 3, 100), (30, 2, 8)]

#: Fitted (rounded): a1, a2, b, c, d of the GEMM formula; e, f, g of the allreduce.
GEMM_COEF = (1.0026, 0.9973, 0.9961, 1.958, -1.971)
ALLREDUCE_COEF = (4.0, 4.0, -4.0)
#: Fitted: p1..p5 of the GEMV formula; q1, q2, q3 of the broadcast.
GEMV_COEF = (1.0, 1.0, 3.0, 0.0, -3.0)
BROADCAST_COEF = (1.0, 1.0, 1.0)


def gemm_features(W, H, mb, kb, n):
    return [kb * n * mb, kb * n, mb * n, W + H, 1.0]


def allreduce_features(W, H, n):
    return [n, W + H, 1.0]


def gemv_features(W, H, b, c):
    return [b * c, b, W, H, 1.0]


def broadcast_features(W, H, n):
    return [n, W, 1.0]


def _fit_and_check(run, features, fit, check):
    X = np.array([features(*s) for s in fit], np.float64)
    y = np.array([run(*s) for s in fit], np.float64)
    coef = np.linalg.lstsq(X, y, rcond=None)[0]
    rows = []
    for s in check:
        measured = run(*s)
        predicted = float(np.dot(features(*s), coef))
        rows.append({"size": list(s), "cycles": int(measured), "predicted": predicted,
                     "error": (predicted - measured) / measured})
    return {"coef": [float(c) for c in coef], "fit_sizes": [list(s) for s in fit], "check": rows,
            "max_check_error": max(abs(r["error"]) for r in rows)}


def calibrate():
    """Run the fabric programs, fit each formula, check it on the held-out sizes (a second or two)."""
    from wse_core.fabric.programs.allreduce import allreduce
    from wse_core.fabric.programs.broadcast import broadcast
    from wse_core.fabric.programs.gemv import gemv
    from wse_core.fabric.programs.stream_gemm import stream_gemm

    def checked(program, what):
        def cycles(*s):
            got, ref, r = program(*s)
            if not np.allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max()):
                raise AssertionError(f"{program.__name__}{s}: wrong {what}")
            return r.cycles
        return cycles

    return {"gemm": _fit_and_check(checked(stream_gemm, "product"), gemm_features, GEMM_FIT, GEMM_CHECK),
            "allreduce": _fit_and_check(checked(allreduce, "sum"), allreduce_features, ALLREDUCE_FIT, ALLREDUCE_CHECK),
            "gemv": _fit_and_check(checked(gemv, "product"), gemv_features, GEMV_FIT, GEMV_CHECK),
            "broadcast": _fit_and_check(checked(broadcast, "copy"), broadcast_features, BROADCAST_FIT,
                                        BROADCAST_CHECK)}
