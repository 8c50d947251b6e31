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
   exponent bits. Inputs are clamped to [-87, 88] so 2^k stays a normal float. */
static inline float wse_expf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float t = x * 1.44269504088896341f;
    int32_t k = (int32_t)(t + (t >= 0.0f ? 0.5f : -0.5f));
    float kf = (float)k;
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
#endif
