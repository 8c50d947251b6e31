/* OpenMP helpers shared by every wse_core kernel; they compile to serial fallbacks without OpenMP. */
#ifndef WSE_PARALLEL_H
#define WSE_PARALLEL_H
#include <stddef.h>
#ifdef _OPENMP
#include <omp.h>
static inline int wse_openmp_enabled(void) { return 1; }
static inline int wse_max_threads(void) { return omp_get_max_threads(); }
#else
static inline int wse_openmp_enabled(void) { return 0; }
static inline int wse_max_threads(void) { return 1; }
#endif

/* Elements per thread below which a kernel stays on one thread: a fork/join costs microseconds. */
#define WSE_GRAIN 32768

/* Threads worth starting for n elements: one per `grain` elements, at most the OpenMP maximum.
   Small arrays (biases, norms) stay on one thread, where a fork/join would cost more than the work. */
static inline int wse_threads_for(ptrdiff_t n, ptrdiff_t grain) {
    int maxt = wse_max_threads();
    ptrdiff_t want = grain > 0 ? n / grain : maxt;
    if (want < 1) return 1;
    return want < maxt ? (int)want : maxt;
}
#endif
