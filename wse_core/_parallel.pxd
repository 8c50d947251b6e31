# OpenMP helpers every kernel cimports (implemented in wse_parallel.h, serial without OpenMP).
cdef extern from "wse_parallel.h" nogil:
    enum: WSE_GRAIN
    int wse_openmp_enabled() noexcept
    int wse_max_threads() noexcept
    int wse_threads_for(Py_ssize_t n, Py_ssize_t grain) noexcept
