"""The wafer: compiled performance core of wse-cluster (Cython + OpenMP) and its thin wrappers.

Importing ``wse_core`` changes nothing in the calling process. ``configure_process()`` sets the
process up the way the cluster's ranks and the ``wse`` command line run (docs/design/numerics.md
"The process"); call it first thing if you want the same behaviour in a script of your own.
"""
import os
import warnings

_configured = {"done": False}


def openmp_info():
    """OpenMP build flag and thread count of the compiled kernels (loads them)."""
    from wse_core._openmp import openmp_info as info

    return info()


def configure_process():
    """Set this process up for the kernels, once: idle OpenMP threads sleep, freed activations are
    kept for reuse, and BLAS runs on one thread. Call it before anything imports the kernels.

    * ``OMP_WAIT_POLICY=PASSIVE`` (unless set): OpenMP threads that finish a parallel loop otherwise
      spin for a while, stealing the core from the BLAS call or MPI rank that runs next. libgomp
      reads it once, when the first kernel module loads it, hence "before".
    * glibc keeps what it is given back: every allocation comes from the heap (no mmap) and freed
      memory is never returned to the system. Layers allocate and free arrays of up to hundreds of
      MB per call (a step's activations), which glibc would otherwise serve with fresh, zeroed
      pages every time. Measured: a quarter of a GPT-2 block's forward + backward time once went to
      page faults; one CS-2's pass of GPT-2 124M took 22.0 s with a 256 MiB trim threshold (2.5 s
      system time, 62,000 faults) and 19.0 s with none (0 s, 0 faults). The cost: a process holds
      its peak heap until it exits, as PyTorch's caching allocator does. glibc only; elsewhere a
      no-op.
    * BLAS pinned to one thread for good (``wse_core.nn.gemm.pin_blas``): OpenBLAS gives other bits
      with other thread counts; ``matmul`` parallelises on its own, in fixed chunks.
    """
    if _configured["done"]:
        return
    _configured["done"] = True
    import sys

    if "OMP_WAIT_POLICY" not in os.environ and "wse_core._openmp" in sys.modules:
        warnings.warn("wse_core.configure_process(): the kernels were loaded before it was called, so idle "
                      "OpenMP threads may spin; call it before importing them", RuntimeWarning, stacklevel=2)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    _keep_freed_memory()
    from wse_core.nn.gemm import pin_blas

    pin_blas()
    if not openmp_info()["openmp"]:
        warnings.warn(
            "wse_core was built without OpenMP: every kernel runs on one thread "
            "(reinstall with a compiler that supports -fopenmp; see `wse doctor`)",
            RuntimeWarning,
            stacklevel=2,
        )


def _keep_freed_memory():
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_max = -1, -4
    mallopt(m_mmap_max, 0)  # no allocation is served by mmap (glibc falls back to it only if brk fails)
    mallopt(m_trim_threshold, -1)  # mallopt(3): -1 disables trimming


__all__ = ["configure_process", "openmp_info"]
