"""The numerics environment: what, besides the params, decides the bits a run computes.

The determinism contract (docs/design.md section 5) holds within one numerics environment: the
same numpy build, the same BLAS library, version and CPU kernel, and the same SIMD code paths of
numpy. Thread counts are recorded but are not part of it (bits do not depend on them: tested).
``environment()`` is written to every ``run.json`` and checkpoint; ``differences`` says, in words,
what would change the bits between a recorded environment and another.
"""
import os
import platform
import sys

import numpy as np

#: Environment variables that steer BLAS, OpenMP or numpy's own kernels: they travel with an
#: appliance submission (and nothing else of the user's environment) and are recorded with every
#: run. OPENBLAS_CORETYPE picks OpenBLAS's kernel (other bits), NPY_DISABLE_CPU_FEATURES numpy's
#: SIMD paths, ATEN_CPU_CAPABILITY torch's; the thread counts change no bits but decide how fast a
#: job runs.
ENV_PREFIXES = ("OPENBLAS_", "GOTO", "OMP_", "GOMP_", "KMP_", "MKL_", "BLIS_", "NPY_", "ATEN_")
ENV_NAMES = ("VECLIB_MAXIMUM_THREADS", "NUMEXPR_NUM_THREADS")

#: The entries of ``environment()`` that decide bits, with the words a mismatch is said in.
BITS_KEYS = {
    "machine": "CPU architecture",
    "numpy": "numpy",
    "blas": "BLAS library",
    "blas_version": "BLAS version",
    "blas_kernel": "BLAS kernel",
    "numpy_simd": "numpy's SIMD paths",
    "torch": "PyTorch",
}


def is_numerics_variable(name):
    """True for an environment variable that steers numerics (see ``ENV_PREFIXES``)."""
    return name.startswith(ENV_PREFIXES) or name in ENV_NAMES


def numerics_variables(environ=None):
    """The numerics variables of ``environ`` (default: this process's), sorted by name."""
    environ = os.environ if environ is None else environ
    return {k: environ[k] for k in sorted(environ) if is_numerics_variable(k)}


def environment():
    """This process's numerics environment as a JSON-able dict (loads the BLAS, not our kernels)."""
    from threadpoolctl import threadpool_info

    blas = next((lib for lib in threadpool_info() if lib.get("user_api") == "blas"), {})
    return {
        "machine": platform.machine(),
        "numpy": np.__version__,
        "blas": f"{blas.get('internal_api', 'unknown')} ({os.path.basename(blas.get('filepath', '?'))})",
        "blas_version": str(blas.get("version")),
        # The kernel OpenBLAS selected at load time (OPENBLAS_CORETYPE or its CPU probe); BLIS and
        # MKL report theirs the same way, others None.
        "blas_kernel": str(blas.get("architecture")),
        "blas_threads": blas.get("num_threads"),
        "numpy_simd": _numpy_simd(),
        "cpu_flags": _cpu_flags(),
        "variables": numerics_variables(),
        # A compiled PyTorch model's units compute with torch (wse_core.compiler): its version decides
        # their bits. Recorded where torch is loaded (the launcher and ranks of such a run), so a
        # run of the built-in families records and compares nothing of it.
        # (sys.modules["torch"] is None while tensorboardX is imported without it: see the coordinator)
        **({"torch": sys.modules["torch"].__version__} if getattr(sys.modules.get("torch"), "__version__", None)
           else {}),
    }


def describe(env):
    """One line of what decides the bits in ``env``: numpy, BLAS and its kernel, numpy's SIMD paths."""
    return (f"numpy {env['numpy']}, BLAS {env['blas']} {env['blas_version']}, kernel {env['blas_kernel']}, "
            f"SIMD {_show(env['numpy_simd']) or 'baseline'}")


def differences(recorded, current):
    """What differs between two environments in what decides bits: one phrase per entry, [] if none.

    An entry missing from ``recorded`` (a run of an earlier version, which recorded nothing) is
    not a difference: nothing is known to differ.
    """
    out = []
    for key, words in BITS_KEYS.items():
        if key in recorded and recorded[key] != current.get(key):
            out.append(f"{words} {_show(recorded[key])} -> {_show(current.get(key))}")
    return out


def _show(value):
    return "+".join(value) if isinstance(value, list) else str(value)


def _numpy_simd():
    """numpy's runtime-dispatched SIMD targets this CPU enables (they pick numpy's loops)."""
    try:
        from numpy._core import _multiarray_umath as um
    except ImportError:  # numpy 1.x
        from numpy.core import _multiarray_umath as um
    features = getattr(um, "__cpu_features__", {})
    return [t for t in getattr(um, "__cpu_dispatch__", []) if features.get(t)]


def _cpu_flags():
    """The CPU's vector and FMA flags (informational: BLAS and numpy choose by them)."""
    wanted = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "asimd", "sve")
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    have = set(line.split(":", 1)[1].split())
                    return [flag for flag in wanted if flag in have]
    except OSError:
        pass
    return []
