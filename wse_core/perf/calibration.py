"""The compute model's constants, fitted to the fabric simulator's cycles and checked on sizes the
fit did not see (docs/design.md section 8).

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

#: Fitted (rounded): a1, a2, b, c, d of the GEMM formula; e, f, g of the allreduce.
GEMM_COEF = (1.0026, 0.9973, 0.9961, 1.958, -1.971)
ALLREDUCE_COEF = (4.0, 4.0, -4.0)


def gemm_features(W, H, mb, kb, n):
    return [kb * n * mb, kb * n, mb * n, W + H, 1.0]


def allreduce_features(W, H, n):
    return [n, W + H, 1.0]


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
    """Run the fabric programs, fit both formulas, check them on the held-out sizes (a second or two)."""
    from wse_core.fabric.programs.allreduce import allreduce
    from wse_core.fabric.programs.stream_gemm import stream_gemm

    def gemm_cycles(*s):
        y, ref, r = stream_gemm(*s)
        if not np.allclose(y, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max()):
            raise AssertionError(f"stream_gemm{s}: wrong product")
        return r.cycles

    def allreduce_cycles(*s):
        got, ref, r = allreduce(*s)
        if not np.allclose(got, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max()):
            raise AssertionError(f"allreduce{s}: wrong sum")
        return r.cycles

    return {"gemm": _fit_and_check(gemm_cycles, gemm_features, GEMM_FIT, GEMM_CHECK),
            "allreduce": _fit_and_check(allreduce_cycles, allreduce_features, ALLREDUCE_FIT, ALLREDUCE_CHECK)}
