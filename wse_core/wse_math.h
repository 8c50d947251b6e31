/* Float32 math for the kernels' inner loops, written so that gcc can vectorise it.
   glibc's expf/tanhf are scalar calls (measured here: 10 ns and 28 ns per element), which made
   GELU slower than the GEMMs around it. Pure arithmetic, no FMA contraction (no -march flags),
   so the bits are the same on every x86-64 machine. */
#ifndef WSE_MATH_H
#define WSE_MATH_H
#include <stdint.h>
#include <string.h>

/* exp(x) for float: Cody-Waite reduction x = k ln2 + r with |r| <= ln2/2, degree-7 Taylor
   polynomial for exp(r) (truncation error below 6e-9 relative), scaled by 2^k built in the
   exponent bits. Inputs are clamped to [-87, 88] so 2^k stays a normal float. k is x / ln2 rounded
   to nearest (ties to even) by adding and taking away 1.5 * 2^23, which is exact for |t| < 2^22:
   the float-to-int-to-float round trip it replaces kept gcc's 8-lane code 2.3x slower (measured). */
static inline float wse_expf(float x) {
    x = x < -87.0f ? -87.0f : x;
    x = x > 88.0f ? 88.0f : x;
    float t = x * 1.44269504088896341f;
    float kf = (t + 12582912.0f) - 12582912.0f;
    int32_t k = (int32_t)kf;
    float r = (x - kf * 0.693359375f) + kf * 2.12194440e-4f;   /* ln2 = 0.693359375 - 2.12194440e-4 */
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t bits = (k + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* tanh(x) = 1 - 2 / (exp(2x) + 1): absolute error about 1e-7, exact limits +-1. */
static inline float wse_tanhf(float x) {
    return 1.0f - 2.0f / (wse_expf(2.0f * x) + 1.0f);
}
/* erf(x) for float: Abramowitz & Stegun 7.1.26, erf|x| = 1 - t (a1 + t (a2 + ... + t a5)) exp(-x^2)
   with t = 1 / (1 + p |x|): absolute error below 1.5e-7 (2.5e-7 measured against glibc's erff with
   this expf), the sign restored after. PyTorch's vectorised erf is the same formula; glibc's erff
   is a scalar call (12.6 ms for 2M values here: the exact GELU's whole cost). */
static inline float wse_erff(float x) {
    float ax = x < 0.0f ? -x : x;
    float t = 1.0f / (1.0f + 0.3275911f * ax);
    float r = 1.061405429f;
    r = r * t - 1.453152027f;
    r = r * t + 1.421413741f;
    r = r * t - 0.284496736f;
    r = r * t + 0.254829592f;
    float y = 1.0f - r * t * wse_expf(-ax * ax);
    return x < 0.0f ? -y : y;
}
#endif
