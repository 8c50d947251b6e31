/* Dense products of bfloat16 operands with float32 accumulation: the products of a mixed-precision
   run in bfloat16 (docs/design/numerics.md "Products in bfloat16").

   c[i, j] := sum over k of A(i, k) B(k, j), where A(i, k) = a[i*sai + k*sak] and B(k, j) =
   b[k*sbk + j*sbn] are float32 arrays read through any strides, each operand first rounded to
   bfloat16 (nearest, ties to even; a NaN stays a NaN). The arithmetic is AVX512-BF16's VDPBF16PS,
   one instruction per pair of k (pinned down on an AMD EPYC, Zen 4, over 2^21 operands; emulated
   exactly by `wse_gemm_bf16_portable`, which the tests hold the fast path to):
       for k = 0, 2, 4, ...:  acc = ftz(fma(A(i, k+1), B(k+1, j), acc))
                              acc = ftz(fma(A(i, k),   B(k, j),   acc))
   with bfloat16 subnormal operands read as zero and float32 subnormal sums flushed to zero (the
   instruction's DAZ/FTZ), starting from acc = 0 (a missing k+1 when K is odd is a zero term).
   Every c[i, j] is that one chain, in that order, whatever M, N, the element's place among them or
   the number of threads: threads share whole blocks of rows, and K is never split. So a sample's
   rows get the same bits whatever else is in the batch, as a product through `gemm.matmul` does.

   The fast path packs both operands to bfloat16 pairs (A by blocks of MR rows, B by panels of NR
   columns), then a register-blocked MR x NR kernel runs over blocks of KC pairs of k (the
   accumulators go through c between blocks: a float32 store and load change no bits). */
#ifndef WSE_BF16_GEMM_H
#define WSE_BF16_GEMM_H
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <immintrin.h>
#include "wse_parallel.h"

#define WSE_BF_MR 8     /* rows of A per kernel call: 16 zmm accumulators */
#define WSE_BF_NR 32    /* columns of B per kernel call: two zmm of 16 float32 */
#define WSE_BF_KC 128   /* pairs of k per block: a B panel of 16 KiB stays in L1 */

static inline uint32_t wse_bf16_bits(float x) {
    uint32_t u;
    memcpy(&u, &x, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u >> 16) | 0x40u;   /* NaN: quiet, keep its sign */
    return (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
}

static inline float wse_bf16_value(uint32_t bits) {  /* with DAZ: a subnormal reads as a signed zero */
    uint32_t u = (bits & 0x7f80u) ? bits << 16 : (bits & 0x8000u) << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static inline float wse_ftz(float x) {
    return fabsf(x) < 1.17549435e-38f ? copysignf(0.0f, x) : x;
}

/* The exact arithmetic of the header's comment, row by row: c[i, :] from A's row i and bv, B's
   bfloat16 values [K][N]. Each c[i, j] is its own chain and the loop over j vectorises; built again
   for CPUs with FMA (AVX2 era), where fmaf is one instruction (an OpenMP region's body would not be). */
#if defined(__GNUC__) && defined(__x86_64__)
__attribute__((target_clones("fma", "default")))
#endif
static void wse_bf16_portable_row(const float* a, int64_t sak, const float* bv, int64_t N, int64_t K, float* ci) {
    for (int64_t j = 0; j < N; j++) ci[j] = 0.0f;
    for (int64_t kk = 0; kk < K; kk += 2) {
        for (int64_t q = kk + 1 < K ? kk + 1 : kk; q >= kk; q--) {   /* k + 1 first, then k */
            float av = wse_bf16_value(wse_bf16_bits(a[q * sak]));
            const float* row = bv + q * N;
            for (int64_t j = 0; j < N; j++) ci[j] = wse_ftz(fmaf(av, row[j], ci[j]));
        }
    }
}

/* The reference the fast path is tested against, and the path of CPUs without AVX512-BF16.
   0, or -1 when out of memory. */
static int wse_gemm_bf16_portable(int64_t M, int64_t N, int64_t K, const float* a, int64_t sai, int64_t sak,
                                  const float* b, int64_t sbk, int64_t sbn, float* c, int64_t ldc,
                                  const float* bias, int threads) {
    float* bv = (float*)malloc((size_t)(K * N) * sizeof(float));
    if (!bv) return -1;
    int64_t i, k;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (k = 0; k < K; k++)
        for (int64_t j = 0; j < N; j++) bv[k * N + j] = wse_bf16_value(wse_bf16_bits(b[k * sbk + j * sbn]));
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (i = 0; i < M; i++) {
        wse_bf16_portable_row(a + i * sai, sak, bv, N, K, c + i * ldc);
        if (bias)
            for (int64_t j = 0; j < N; j++) c[i * ldc + j] += bias[j];
    }
    free(bv);
    return 0;
}

#if defined(__GNUC__) && defined(__x86_64__)
#define WSE_BF16_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

static int wse_bf16_native(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16");
}

/* 16 float32 -> their bfloat16 bit patterns in the low halves of 16 lanes (wse_bf16_bits). */
WSE_BF16_TARGET static inline __m512i wse_bf16_round16(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)),
                                                   _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
    __mmask16 nan = _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                             _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_or_epi32(r, nan, _mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40));
}

/* The same for 8 float32 (the low half of wse_bf16_round16). */
WSE_BF16_TARGET static inline __m256i wse_bf16_round8(__m256 x) {
    return _mm512_castsi512_si256(wse_bf16_round16(_mm512_zextps256_ps512(x)));
}

/* r[q][j] := r[j][q]: an 8 x 8 transpose of 32-bit lanes. */
WSE_BF16_TARGET static inline void wse_transpose8(__m256i r[8]) {
    __m256i t[8], u[8];
    for (int q = 0; q < 8; q += 2) {
        t[q] = _mm256_unpacklo_epi32(r[q], r[q + 1]);
        t[q + 1] = _mm256_unpackhi_epi32(r[q], r[q + 1]);
    }
    for (int q = 0; q < 8; q += 4) {
        u[q] = _mm256_unpacklo_epi64(t[q], t[q + 2]);
        u[q + 1] = _mm256_unpackhi_epi64(t[q], t[q + 2]);
        u[q + 2] = _mm256_unpacklo_epi64(t[q + 1], t[q + 3]);
        u[q + 3] = _mm256_unpackhi_epi64(t[q + 1], t[q + 3]);
    }
    for (int q = 0; q < 4; q++) {
        r[q] = _mm256_permute2x128_si256(u[q], u[q + 4], 0x20);
        r[q + 4] = _mm256_permute2x128_si256(u[q], u[q + 4], 0x31);
    }
}

/* dst[((i / w) * k2n + p) * w + i % w] := bfloat16 pair (X(i, 2p), X(i, 2p + 1)), low half first,
   for X(i, k) = x[i + k*sk] (i runs along memory), of the pairs p in [p0, p1): eight rows of a pair
   at a time, rows 2p and 2p + 1 of the source read whole; i < rows padded to a multiple of w (8, 16,
   32, ...) with zeros, k >= K zero. */
WSE_BF16_TARGET static void wse_bf16_pack_pairs(uint32_t* dst, const float* x, int64_t sk, int64_t rows, int64_t K,
                                                int64_t w, int64_t p0, int64_t p1) {
    int64_t k2n = (K + 1) / 2, blocks = (rows + w - 1) / w;
    for (int64_t p = p0; p < p1; p++) {
        const float* x0 = x + 2 * p * sk;
        int has1 = 2 * p + 1 < K;
        int64_t i = 0;
        for (; i + 8 <= rows; i += 8) {
            __m256i lo = wse_bf16_round8(_mm256_loadu_ps(x0 + i));
            __m256i hi = has1 ? wse_bf16_round8(_mm256_loadu_ps(x0 + sk + i)) : _mm256_setzero_si256();
            _mm256_storeu_si256((__m256i*)(dst + ((i / w) * k2n + p) * w + i % w),
                                _mm256_or_si256(lo, _mm256_slli_epi32(hi, 16)));
        }
        for (; i < rows; i++)
            dst[((i / w) * k2n + p) * w + i % w] = wse_bf16_bits(x0[i]) | (has1 ? wse_bf16_bits(x0[sk + i]) << 16 : 0);
        for (; i < blocks * w; i++) dst[((i / w) * k2n + p) * w + i % w] = 0;
    }
}

/* The same layout for X(i, k) = src[i*si + k*sk] in any layout, of the blocks of w rows in [b0,
   b1): vectorised where k runs along memory (sk == 1: eight rows of sixteen k, transposed in
   registers), else element by element. */
WSE_BF16_TARGET static void wse_bf16_pack_blocks(uint32_t* dst, const float* src, int64_t si, int64_t sk,
                                                 int64_t rows, int64_t K, int64_t w, int64_t b0, int64_t b1) {
    int64_t k2n = (K + 1) / 2;
    for (int64_t blk = b0; blk < b1; blk++) {
        uint32_t* out = dst + blk * k2n * w;
        int64_t full = rows - blk * w >= w ? w : rows - blk * w, i = 0, p;
        if (sk == 1 && w % 8 == 0) {
            for (; i + 8 <= full; i += 8) {
                const float* x = src + (blk * w + i) * si;
                for (p = 0; p + 8 <= K / 2; p += 8) {   /* 8 rows x 8 pairs, transposed in registers */
                    __m256i r[8];
                    for (int q = 0; q < 8; q++)
                        r[q] = _mm512_cvtepi32_epi16(wse_bf16_round16(_mm512_loadu_ps(x + q * si + 2 * p)));
                    wse_transpose8(r);
                    for (int q = 0; q < 8; q++) _mm256_storeu_si256((__m256i*)(out + (p + q) * w + i), r[q]);
                }
                for (int q = 0; q < 8; q++) {
                    const float* xq = x + q * si;
                    for (int64_t pp = p; pp < K / 2; pp++)
                        out[pp * w + i + q] = wse_bf16_bits(xq[2 * pp]) | (wse_bf16_bits(xq[2 * pp + 1]) << 16);
                    if (K & 1) out[(k2n - 1) * w + i + q] = wse_bf16_bits(xq[K - 1]);
                }
            }
        }
        for (; i < full; i++) {   /* what the vector loops left: rows at the end, or other strides */
            const float* x = src + (blk * w + i) * si;
            for (p = 0; p < K / 2; p++)
                out[p * w + i] = wse_bf16_bits(x[2 * p * sk]) | (wse_bf16_bits(x[(2 * p + 1) * sk]) << 16);
            if (K & 1) out[(k2n - 1) * w + i] = wse_bf16_bits(x[(K - 1) * sk]);
        }
        for (; i < w; i++)
            for (p = 0; p < k2n; p++) out[p * w + i] = 0;
    }
}

/* dst := X packed in blocks of w rows (wse_bf16_pack_pairs' layout), rows < `rows`, on `threads`
   threads (1: on the calling thread, no parallel region): where i runs along memory the threads
   share the pairs, each reading two rows of the source whole, else the blocks. */
WSE_BF16_TARGET static void wse_bf16_pack(uint32_t* dst, const float* src, int64_t si, int64_t sk, int64_t rows,
                                          int64_t K, int64_t w, int threads) {
    int64_t k2n = (K + 1) / 2, blocks = (rows + w - 1) / w, j;
    int pairs = si == 1 && w % 8 == 0;
    if (threads <= 1) {
        if (pairs)
            wse_bf16_pack_pairs(dst, src, sk, rows, K, w, 0, k2n);
        else
            wse_bf16_pack_blocks(dst, src, si, sk, rows, K, w, 0, blocks);
        return;
    }
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (j = 0; j < (pairs ? k2n : blocks); j++) {
        if (pairs)
            wse_bf16_pack_pairs(dst, src, sk, rows, K, w, j, j + 1);
        else
            wse_bf16_pack_blocks(dst, src, si, sk, rows, K, w, j, j + 1);
    }
}

/* c[rows of block r] over pairs [k0, k1) of every panel; from zero when k0 == 0, else from c. With
   `add` (k0 == 0 and k1 == k2n only) c := c + the float32 sums, as `c += a @ b` adds them; with
   `bias` (non-NULL: at the last block of k) the sums + bias, as `c = a @ b; c += bias` gives them. */
WSE_BF16_TARGET static void wse_bf16_block(const uint32_t* ap, const uint32_t* bp, int64_t k2n, int64_t k0,
                                           int64_t k1, int64_t rows, int64_t N, float* c, int64_t ldc, int add,
                                           const float* bias) {
    int64_t panels = (N + WSE_BF_NR - 1) / WSE_BF_NR;
    for (int64_t p = 0; p < panels; p++) {
        int64_t n0 = p * WSE_BF_NR, w = N - n0;
        __mmask16 m0 = w >= 16 ? 0xffff : (__mmask16)((1u << w) - 1);
        __mmask16 m1 = w >= 32 ? 0xffff : (w > 16 ? (__mmask16)((1u << (w - 16)) - 1) : 0);
        __m512 acc[WSE_BF_MR][2];
        for (int i = 0; i < WSE_BF_MR; i++) {
            if (k0 == 0 || i >= rows) {
                acc[i][0] = _mm512_setzero_ps();
                acc[i][1] = _mm512_setzero_ps();
            } else {
                acc[i][0] = _mm512_maskz_loadu_ps(m0, c + i * ldc + n0);
                acc[i][1] = _mm512_maskz_loadu_ps(m1, c + i * ldc + n0 + 16);
            }
        }
        const uint32_t* A = ap + k0 * WSE_BF_MR;
        const uint32_t* B = bp + (p * k2n + k0) * WSE_BF_NR;
        for (int64_t q = k0; q < k1; q++, A += WSE_BF_MR, B += WSE_BF_NR) {
            __m512bh b0 = (__m512bh)_mm512_loadu_si512(B), b1 = (__m512bh)_mm512_loadu_si512(B + 16);
            for (int i = 0; i < WSE_BF_MR; i++) {
                __m512bh av = (__m512bh)_mm512_set1_epi32((int)A[i]);
                acc[i][0] = _mm512_dpbf16_ps(acc[i][0], av, b0);
                acc[i][1] = _mm512_dpbf16_ps(acc[i][1], av, b1);
            }
        }
        __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
        if (bias && k1 == k2n) {
            b0 = _mm512_maskz_loadu_ps(m0, bias + n0);
            b1 = _mm512_maskz_loadu_ps(m1, bias + n0 + 16);
        }
        for (int64_t i = 0; i < rows; i++) {
            if (bias && k1 == k2n) {
                acc[i][0] = _mm512_add_ps(acc[i][0], b0);
                acc[i][1] = _mm512_add_ps(acc[i][1], b1);
            }
            if (add) {
                acc[i][0] = _mm512_add_ps(_mm512_maskz_loadu_ps(m0, c + i * ldc + n0), acc[i][0]);
                acc[i][1] = _mm512_add_ps(_mm512_maskz_loadu_ps(m1, c + i * ldc + n0 + 16), acc[i][1]);
            }
            _mm512_mask_storeu_ps(c + i * ldc + n0, m0, acc[i][0]);
            _mm512_mask_storeu_ps(c + i * ldc + n0 + 16, m1, acc[i][1]);
        }
    }
}

/* Rows [r MR, r MR + MR) of c := A B (+ bias; or c + A B: `add`, for one block of k only) over every
   block of k. */
WSE_BF16_TARGET static inline void wse_bf16_rows(const uint32_t* ap, const uint32_t* bp, int64_t k2n, int64_t r,
                                                 int64_t M, int64_t N, float* c, int64_t ldc, int add,
                                                 const float* bias) {
    int64_t rows = M - r * WSE_BF_MR < WSE_BF_MR ? M - r * WSE_BF_MR : WSE_BF_MR;
    for (int64_t k0 = 0; k0 < k2n; k0 += WSE_BF_KC)
        wse_bf16_block(ap + r * k2n * WSE_BF_MR, bp, k2n, k0, k0 + WSE_BF_KC < k2n ? k0 + WSE_BF_KC : k2n, rows, N,
                       c + r * WSE_BF_MR * ldc, ldc, add, bias);
}

WSE_BF16_TARGET static void wse_gemm_bf16_native(int64_t M, int64_t N, int64_t K, const uint32_t* ap,
                                                 const uint32_t* bp, float* c, int64_t ldc, const float* bias,
                                                 int threads) {
    int64_t k2n = (K + 1) / 2, blocks = (M + WSE_BF_MR - 1) / WSE_BF_MR, r;
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (r = 0; r < blocks; r++) wse_bf16_rows(ap, bp, k2n, r, M, N, c, ldc, 0, bias);
}

/* c := A B, or c + A B (add), on the calling thread, A and B packed into `scratch`
   (wse_bf16_scratch(M, N, K, add) values; a product too long for one block of k adds through it). */
WSE_BF16_TARGET static void wse_gemm_bf16_serial(int64_t M, int64_t N, int64_t K, const float* a, int64_t sai,
                                                 int64_t sak, const float* b, int64_t sbk, int64_t sbn, float* c,
                                                 int64_t ldc, int add, uint32_t* scratch) {
    int64_t k2n = (K + 1) / 2, blocks = (M + WSE_BF_MR - 1) / WSE_BF_MR;
    uint32_t* ap = scratch;
    uint32_t* bp = scratch + blocks * WSE_BF_MR * k2n;
    wse_bf16_pack(ap, a, sai, sak, M, K, WSE_BF_MR, 1);
    wse_bf16_pack(bp, b, sbn, sbk, N, K, WSE_BF_NR, 1);
    int direct = !add || k2n <= WSE_BF_KC;
    float* t = direct ? c : (float*)(bp + (N + WSE_BF_NR - 1) / WSE_BF_NR * WSE_BF_NR * k2n);
    int64_t ldt = direct ? ldc : N;
    for (int64_t r = 0; r < blocks; r++) wse_bf16_rows(ap, bp, k2n, r, M, N, t, ldt, add && direct, NULL);
    if (!direct)
        for (int64_t i = 0; i < M; i++)
            for (int64_t j = 0; j < N; j++) c[i * ldc + j] += t[i * N + j];
}
#else
static int wse_bf16_native(void) { return 0; }
#endif

/* c := A B in bfloat16 products (see the top of this file), + bias[j] on every row when bias is not
   NULL (added to the float32 sums, as `c = a @ b; c += bias`); 0, or -1 when out of memory. */
static int wse_gemm_bf16(int64_t M, int64_t N, int64_t K, const float* a, int64_t sai, int64_t sak,
                         const float* b, int64_t sbk, int64_t sbn, float* c, int64_t ldc, const float* bias,
                         int threads, int portable) {
    if (M <= 0 || N <= 0) return 0;
    if (K <= 0) {
        for (int64_t i = 0; i < M; i++) {
            memset(c + i * ldc, 0, (size_t)N * sizeof(float));
            if (bias)
                for (int64_t j = 0; j < N; j++) c[i * ldc + j] += bias[j];
        }
        return 0;
    }
#if defined(__GNUC__) && defined(__x86_64__)
    if (!portable && wse_bf16_native()) {
        int64_t k2n = (K + 1) / 2;
        int64_t mp = (M + WSE_BF_MR - 1) / WSE_BF_MR * WSE_BF_MR, np_ = (N + WSE_BF_NR - 1) / WSE_BF_NR * WSE_BF_NR;
        uint32_t* ap = (uint32_t*)malloc((size_t)(mp * k2n) * 4);
        uint32_t* bp = (uint32_t*)malloc((size_t)(np_ * k2n) * 4);
        if (!ap || !bp) {
            free(ap);
            free(bp);
            return -1;
        }
        wse_bf16_pack(ap, a, sai, sak, M, K, WSE_BF_MR, threads);
        wse_bf16_pack(bp, b, sbn, sbk, N, K, WSE_BF_NR, threads);
        wse_gemm_bf16_native(M, N, K, ap, bp, c, ldc, bias, threads);
        free(ap);
        free(bp);
        return 0;
    }
#endif
    return wse_gemm_bf16_portable(M, N, K, a, sai, sak, b, sbk, sbn, c, ldc, bias, threads);
}

/* The uint32 values of scratch wse_gemm_bf16_into needs for an [M, K] x [K, N] product. */
static inline int64_t wse_bf16_scratch(int64_t M, int64_t N, int64_t K, int add) {
    int64_t k2n = (K + 1) / 2;
    return ((M + WSE_BF_MR - 1) / WSE_BF_MR * WSE_BF_MR + (N + WSE_BF_NR - 1) / WSE_BF_NR * WSE_BF_NR) * k2n
           + (add && k2n > WSE_BF_KC ? M * N : 0);
}

/* c := c + A B (add) or A B, for a caller that is itself one of the threads: c + A B adds the
   float32 product to c afterwards, as `c += a @ b` does through numpy. The fast path packs into
   `scratch` (wse_bf16_scratch values: no allocation, no parallel region, many small products a
   thread); the portable one allocates. 0, or -1 when out of memory. */
static int wse_gemm_bf16_into(int64_t M, int64_t N, int64_t K, const float* a, int64_t sai, int64_t sak,
                              const float* b, int64_t sbk, int64_t sbn, float* c, int64_t ldc, int add,
                              uint32_t* scratch) {
    if (M <= 0 || N <= 0) return 0;
#if defined(__GNUC__) && defined(__x86_64__)
    if (K > 0 && wse_bf16_native()) {
        wse_gemm_bf16_serial(M, N, K, a, sai, sak, b, sbk, sbn, c, ldc, add, scratch);
        return 0;
    }
#endif
    if (!add) return wse_gemm_bf16(M, N, K, a, sai, sak, b, sbk, sbn, c, ldc, NULL, 1, 0);
    float* t = (float*)malloc((size_t)(M * N) * sizeof(float));
    if (!t || wse_gemm_bf16(M, N, K, a, sai, sak, b, sbk, sbn, t, N, NULL, 1, 1)) {
        free(t);
        return -1;
    }
    for (int64_t i = 0; i < M; i++)
        for (int64_t j = 0; j < N; j++) c[i * ldc + j] += t[i * N + j];
    free(t);
    return 0;
}
#endif
