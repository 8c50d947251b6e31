/* Row-range CSR kernels, one C function per (value type, index type); the Cython layer
   (_kernels.pyx) splits rows between threads and calls these without the GIL.

   Every output element is accumulated in one fixed order (a row's nonzeros in storage order), so
   results never depend on the number of threads or on the instruction set. Arithmetic is written
   with GCC vector extensions of 8 lanes: each lane is an independent element (or, in sddmm,
   one of 8 fixed partial sums), so vectorising changes no result. Each function is also
   built for AVX2 (target_clones; picked at load time when the CPU has it): twice the width of the
   x86-64 baseline, and without FMA, so a*b+c still rounds twice, exactly as the baseline does.

   spmm keeps a block of WSE_CB columns of the output row in registers across all of the row's
   nonzeros: one load of each X row block per nonzero, one store of Y per block. */
#ifndef WSE_CSR_KERNELS_H
#define WSE_CSR_KERNELS_H
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#if defined(__GNUC__) && defined(__x86_64__) && !defined(__clang__)
#define WSE_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define WSE_CLONES
#endif

typedef float wse_v8f __attribute__((vector_size(32)));
typedef double wse_v8d __attribute__((vector_size(64)));

#define WSE_CB 64   /* output columns per register block in spmm: 8 vectors of 8 lanes */

#define WSE_LOAD(V, p) ({ V v_; memcpy(&v_, (p), sizeof(V)); v_; })
#define WSE_STORE(p, v) do { __typeof__(v) v_ = (v); memcpy((p), &v_, sizeof(v_)); } while (0)
#define WSE_HSUM8(s) ((((s)[0] + (s)[1]) + ((s)[2] + (s)[3])) + (((s)[4] + (s)[5]) + ((s)[6] + (s)[7])))

#define WSE_CSR_DEFINE(T, V, I, SUF)                                                               \
/* Scalar on purpose: gcc would vectorise the gather with lane inserts, slower than 4 scalar chains. */ \
__attribute__((optimize("no-tree-vectorize")))                                                    \
static void wse_spmv_##SUF(const I* restrict indptr, const I* restrict indices,                   \
                           const T* restrict data, const T* restrict x, T* restrict y,           \
                           ptrdiff_t r0, ptrdiff_t r1) {                                           \
    for (ptrdiff_t r = r0; r < r1; r++) {                                                          \
        ptrdiff_t j = indptr[r];                                                                   \
        const ptrdiff_t hi = indptr[r + 1];                                                        \
        T s0 = 0, s1 = 0, s2 = 0, s3 = 0;                                                          \
        for (; j + 4 <= hi; j += 4) {                                                              \
            s0 += data[j] * x[indices[j]];                                                         \
            s1 += data[j + 1] * x[indices[j + 1]];                                                 \
            s2 += data[j + 2] * x[indices[j + 2]];                                                 \
            s3 += data[j + 3] * x[indices[j + 3]];                                                 \
        }                                                                                          \
        for (; j < hi; j++) s0 += data[j] * x[indices[j]];                                         \
        y[r] = (s0 + s1) + (s2 + s3);                                                              \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
WSE_CLONES static void wse_spmm_##SUF(const I* restrict indptr, const I* restrict indices,        \
                           const T* restrict data, const T* restrict X, T* restrict Y,           \
                           ptrdiff_t n, ptrdiff_t r0, ptrdiff_t r1) {                              \
    for (ptrdiff_t r = r0; r < r1; r++) {                                                          \
        const ptrdiff_t lo = indptr[r], hi = indptr[r + 1];                                        \
        T* restrict yr = Y + r * n;                                                                \
        ptrdiff_t c0 = 0;                                                                          \
        for (; c0 + WSE_CB <= n; c0 += WSE_CB) {                                                   \
            V a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0}, a4 = {0}, a5 = {0}, a6 = {0}, a7 = {0};     \
            for (ptrdiff_t j = lo; j < hi; j++) {                                                  \
                const T a = data[j];                                                               \
                const T* restrict xr = X + (ptrdiff_t)indices[j] * n + c0;                         \
                a0 += a * WSE_LOAD(V, xr);      a1 += a * WSE_LOAD(V, xr + 8);                     \
                a2 += a * WSE_LOAD(V, xr + 16); a3 += a * WSE_LOAD(V, xr + 24);                    \
                a4 += a * WSE_LOAD(V, xr + 32); a5 += a * WSE_LOAD(V, xr + 40);                    \
                a6 += a * WSE_LOAD(V, xr + 48); a7 += a * WSE_LOAD(V, xr + 56);                    \
            }                                                                                      \
            WSE_STORE(yr + c0, a0);      WSE_STORE(yr + c0 + 8, a1);                               \
            WSE_STORE(yr + c0 + 16, a2); WSE_STORE(yr + c0 + 24, a3);                              \
            WSE_STORE(yr + c0 + 32, a4); WSE_STORE(yr + c0 + 40, a5);                              \
            WSE_STORE(yr + c0 + 48, a6); WSE_STORE(yr + c0 + 56, a7);                              \
        }                                                                                          \
        if (c0 < n) {                                                                              \
            for (ptrdiff_t c = c0; c < n; c++) yr[c] = 0;                                          \
            for (ptrdiff_t j = lo; j < hi; j++) {                                                  \
                const T a = data[j];                                                               \
                const T* restrict xr = X + (ptrdiff_t)indices[j] * n;                              \
                for (ptrdiff_t c = c0; c < n; c++) yr[c] += a * xr[c];                             \
            }                                                                                      \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* Y[k, n] = A^T X for the columns [c0, c1) of Y and X; Y's strip must be zeroed by the caller. */ \
WSE_CLONES static void wse_spmm_t_##SUF(const I* restrict indptr, const I* restrict indices,      \
                             const T* restrict data, const T* restrict X, T* restrict Y,         \
                             ptrdiff_t m, ptrdiff_t n, ptrdiff_t c0, ptrdiff_t c1) {               \
    for (ptrdiff_t r = 0; r < m; r++) {                                                            \
        const T* restrict xr = X + r * n;                                                          \
        for (ptrdiff_t j = indptr[r]; j < indptr[r + 1]; j++) {                                    \
            const T a = data[j];                                                                   \
            T* restrict yr = Y + (ptrdiff_t)indices[j] * n;                                        \
            ptrdiff_t c = c0;                                                                      \
            for (; c + 8 <= c1; c += 8) WSE_STORE(yr + c, WSE_LOAD(V, yr + c) + a * WSE_LOAD(V, xr + c)); \
            for (; c < c1; c++) yr[c] += a * xr[c];                                                \
        }                                                                                          \
    }                                                                                              \
}                                                                                                  \
                                                                                                   \
/* Two nonzeros at a time share each load of U's row; each keeps its own 8 partial sums. */      \
WSE_CLONES static void wse_sddmm_##SUF(const I* restrict indptr, const I* restrict indices,       \
                            const T* restrict U, const T* restrict V_, T* restrict out,          \
                            ptrdiff_t n, ptrdiff_t r0, ptrdiff_t r1) {                             \
    for (ptrdiff_t r = r0; r < r1; r++) {                                                          \
        const T* restrict u = U + r * n;                                                           \
        const ptrdiff_t hi = indptr[r + 1];                                                        \
        ptrdiff_t j = indptr[r];                                                                   \
        for (; j + 2 <= hi; j += 2) {                                                              \
            const T* restrict v0 = V_ + (ptrdiff_t)indices[j] * n;                                 \
            const T* restrict v1 = V_ + (ptrdiff_t)indices[j + 1] * n;                             \
            V s0 = {0}, s1 = {0};                                                                  \
            ptrdiff_t c = 0;                                                                       \
            for (; c + 8 <= n; c += 8) {                                                           \
                const V uc = WSE_LOAD(V, u + c);                                                   \
                s0 += uc * WSE_LOAD(V, v0 + c);                                                    \
                s1 += uc * WSE_LOAD(V, v1 + c);                                                    \
            }                                                                                      \
            T t0 = 0, t1 = 0;                                                                      \
            for (; c < n; c++) { t0 += u[c] * v0[c]; t1 += u[c] * v1[c]; }                         \
            s0[0] += t0; s1[0] += t1;                                                              \
            out[j] = WSE_HSUM8(s0);                                                                \
            out[j + 1] = WSE_HSUM8(s1);                                                            \
        }                                                                                          \
        for (; j < hi; j++) {                                                                      \
            const T* restrict v = V_ + (ptrdiff_t)indices[j] * n;                                  \
            V s = {0};                                                                             \
            ptrdiff_t c = 0;                                                                       \
            for (; c + 8 <= n; c += 8) s += WSE_LOAD(V, u + c) * WSE_LOAD(V, v + c);               \
            T t = 0;                                                                               \
            for (; c < n; c++) t += u[c] * v[c];                                                   \
            s[0] += t;                                                                             \
            out[j] = WSE_HSUM8(s);                                                                 \
        }                                                                                          \
    }                                                                                              \
}

WSE_CSR_DEFINE(float, wse_v8f, int32_t, f32_i32)
WSE_CSR_DEFINE(float, wse_v8f, int64_t, f32_i64)
WSE_CSR_DEFINE(double, wse_v8d, int32_t, f64_i32)
WSE_CSR_DEFINE(double, wse_v8d, int64_t, f64_i64)
#undef WSE_CSR_DEFINE
#endif
