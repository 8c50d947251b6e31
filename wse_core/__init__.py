"""The wafer: compiled performance core of wse-cluster (Cython + OpenMP) and its thin wrappers."""
import os
import warnings

# OpenMP threads that finish a parallel loop otherwise spin for a while before sleeping, stealing
# the core from the BLAS call or the MPI rank that runs next (DESIGN.md section 3: never spin).
# libgomp reads this once, when the first kernel module loads it, so it is set before that import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from wse_core._openmp import openmp_info  # noqa: E402


def _keep_freed_memory():
    """Let glibc reuse freed activations instead of returning them to the OS after every layer.

    Layers allocate and free arrays of several MB per call; by default glibc serves those with
    fresh mmap pages (or trims the heap), so every step page-faults its activations back in:
    measured here, a quarter of a GPT-2 block's forward + backward time. Raising the mmap and trim
    thresholds keeps up to 256 MiB of freed memory for reuse. glibc only; elsewhere a no-op.
    """
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest allowed value
    mallopt(m_trim_threshold, 256 << 20)


_keep_freed_memory()

if not openmp_info()["openmp"]:
    warnings.warn(
        "wse_core was built without OpenMP: every kernel runs on one thread "
        "(reinstall with a compiler that supports -fopenmp; see `wse doctor`)",
        RuntimeWarning,
        stacklevel=2,
    )

__all__ = ["openmp_info"]
