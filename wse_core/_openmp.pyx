"""OpenMP build facts of the compiled kernels, and the threaded copy benchmarks use as a baseline."""
from cython cimport floating
from cython.parallel cimport prange

from wse_core._parallel cimport WSE_GRAIN, wse_max_threads, wse_openmp_enabled, wse_threads_for

def openmp_info():
    """Return ``{"openmp": bool, "max_threads": int}`` as the compiled kernels see them."""
    return {"openmp": bool(wse_openmp_enabled()), "max_threads": int(wse_max_threads())}


def parallel_copy(floating[::1] dst, const floating[::1] src):
    """dst := src on the kernels' threads: the memory-bandwidth baseline of every benchmark."""
    cdef Py_ssize_t i, n = dst.shape[0]
    cdef int nt = wse_threads_for(n, WSE_GRAIN)
    with nogil:
        for i in prange(n, schedule="static", num_threads=nt):
            dst[i] = src[i]
